"""What a parallel run is made of: the data-parallel mode, the tensor and domain sizes, mixed
precision (:class:`ParallelismConfig`, :class:`MixedPrecision`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from mpidp.errors import ConfigError

#: The data-parallel modes of :class:`ParallelismConfig`.
DATA_MODES = ("fsdp2", "ddp", "none")
#: Mesh dimension names, outermost first.
MESH_DIMS = ("dp", "tp", "domain")

_DTYPES = {name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64")} | {
    "half": torch.float16,
    "float": torch.float32,
    "double": torch.float64,
    "bf16": torch.bfloat16,
}


def _dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"{what}={value!r} is not a dtype; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"parallelism config: {what} must be an integer >= 1, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """FSDP2 mixed precision: parameters cast to ``param_dtype`` for compute, gradients reduced
    in ``reduce_dtype``, outputs cast to ``output_dtype``; None keeps the parameters' dtype.
    Dtypes may be given by name (``"bfloat16"``)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(
                self, field.name, _dtype(getattr(self, field.name), f"mixed_precision.{field.name}")
            )

    @classmethod
    def coerce(cls, value: Any) -> MixedPrecision | None:
        """None, a :class:`MixedPrecision`, a mapping of its fields, or FSDP2's own
        ``MixedPrecisionPolicy``."""
        if value is None or isinstance(value, MixedPrecision):
            return value
        if isinstance(value, Mapping):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ConfigError(f"mixed_precision: unknown key(s) {unknown}; use {sorted(names)}")
            return cls(**dict(value))
        if all(hasattr(value, n) for n in ("param_dtype", "reduce_dtype", "output_dtype")):
            return cls(value.param_dtype, value.reduce_dtype, value.output_dtype)
        raise ConfigError(
            f"mixed_precision={value!r}: give a mapping such as "
            f"{{'param_dtype': 'bfloat16', 'reduce_dtype': 'float32'}}"
        )

    def policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=self.output_dtype,
        )


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """How the world is used: ``data`` (``"fsdp2"``, ``"ddp"`` or ``"none"``) over
    dp = world / (tensor x domain) replicas, ``tensor`` ranks sharing each opted-in layer's
    channels, ``domain`` ranks sharing each sample's latitude bands (an int P) or its latitude x
    longitude blocks (a pair ``(P_lat, P_lon)``: a grid of P_lat x P_lon ranks, as
    :func:`mpidp.init` takes it). ``mixed_precision``
    (FSDP2 only) and ``reshard_after_forward`` are passed to :func:`apply_fsdp2`.

    ``data="none"`` leaves data-parallel gradients to :func:`mpidp.sync_gradients`, which
    cannot handle tensor-parallel shards: with ``tensor`` > 1 it needs dp = 1.
    """

    data: str = "none"
    tensor: int = 1
    domain: int | tuple[int, int] = 1
    mixed_precision: MixedPrecision | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        data = "none" if self.data is None else str(self.data).lower()
        if data not in DATA_MODES:
            raise ConfigError(
                f"parallelism config: data={self.data!r} is not one of {', '.join(DATA_MODES)}"
            )
        object.__setattr__(self, "data", data)
        _positive(self.tensor, "tensor")
        if isinstance(self.domain, (tuple, list)):
            if len(self.domain) != 2:
                raise ConfigError(
                    f"parallelism config: domain={self.domain!r}: give ranks per domain group "
                    f"(an int) or a (P_lat, P_lon) grid of two ints"
                )
            grid = tuple(_positive(n, "each of domain's (P_lat, P_lon)") for n in self.domain)
            object.__setattr__(self, "domain", grid)
        else:
            _positive(self.domain, "domain")
        object.__setattr__(self, "mixed_precision", MixedPrecision.coerce(self.mixed_precision))
        if self.mixed_precision is not None and data != "fsdp2":
            raise ConfigError(
                f"parallelism config: mixed_precision is applied by FSDP2, but data={data!r}; "
                f"set data='fsdp2' or use torch.autocast"
            )

    @classmethod
    def coerce(cls, value: ParallelismConfig | Mapping[str, Any]) -> ParallelismConfig:
        """A config from itself or a plain mapping (unknown keys are an error)."""
        if isinstance(value, ParallelismConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"parallelism config must be a mapping or ParallelismConfig, got "
                f"{type(value).__name__}; e.g. {{'data': 'ddp', 'tensor': 1, 'domain': 2}}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(map(str, value)) - set(names))
        if unknown:
            raise ConfigError(f"parallelism config: unknown key(s) {unknown}; known: {names}")
        return cls(**{str(k): v for k, v in value.items()})

    @property
    def grid(self) -> tuple[int, int]:
        """``(P_lat, P_lon)`` of the domain group: ``(domain, 1)`` for bands."""
        return self.domain if isinstance(self.domain, tuple) else (self.domain, 1)

    @property
    def domain_ranks(self) -> int:
        """Ranks per domain group: ``P_lat x P_lon``."""
        return self.grid[0] * self.grid[1]

    def sizes(self, world_size: int) -> tuple[int, int, int]:
        """``(dp, tensor, domain ranks)`` for a world of ``world_size`` ranks; ConfigError naming
        the sizes when the world is not a multiple of tensor x domain."""
        domain = self.domain_ranks
        shown = f"{self.grid[0]} x {self.grid[1]}" if isinstance(self.domain, tuple) else domain
        inner = self.tensor * domain
        if world_size % inner:
            fits = [w for w in range(inner, 4 * inner + 1, inner)]
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor {self.tensor} x domain "
                f"{shown} = {inner}; launch a multiple of {inner} ranks (e.g. {fits}) or "
                f"change tensor/domain"
            )
        dp = world_size // inner
        if self.data == "none" and self.tensor > 1 and dp > 1:
            raise ConfigError(
                f"parallelism config: data='none' with tensor {self.tensor} leaves dp = "
                f"{world_size} / ({self.tensor} x {shown}) = {dp} replicas whose "
                f"tensor-parallel gradients nothing would average; set data='ddp' or 'fsdp2'"
            )
        return dp, self.tensor, domain

    def as_dict(self) -> dict[str, Any]:
        mp = self.mixed_precision
        return {
            "data": self.data,
            "tensor": self.tensor,
            "domain": self.domain,
            "mixed_precision": None
            if mp is None
            else {f.name: str(getattr(mp, f.name)) for f in dataclasses.fields(mp)},
            "reshard_after_forward": self.reshard_after_forward,
        }


# Communicators of the mesh dimensions, by the global ranks of this rank's group: the MPI
# transport is used for CPU tensors when MPI runs the job (decision 2).
