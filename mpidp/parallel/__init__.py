"""Domain parallelism composed with DDP, FSDP2 and tensor parallelism on one DeviceMesh.

The world is a 3-D mesh ``(dp, tp, domain)``, domain innermost: a domain group is a run of
consecutive ranks, exactly the manager's, so the domain-parallel layers and the mesh agree.

Order (each step optional; see docs/launching.md):

1. ``meshes = build_device_mesh({"data": "fsdp2", "tensor": 2, "domain": 2})``
2. ``broadcast_parameters(model, meshes.manager)``: every rank starts from the same weights
3. ``apply_tensor_parallel(model, meshes["tp"])``: the opted-in 1x1 convs and linears keep
   their slice of the channels
4. ``model = apply_domain_parallel(model, meshes["domain"])``: halos and band statistics
5. ``apply_fsdp2(model, meshes["dp"])`` or ``model = apply_ddp(model, meshes["dp"])``
6. per step: forward on this replica's samples and this rank's band, loss with
   :func:`mpidp.global_mean` over the domain group, ``backward()`` (DDP/FSDP2 average over dp),
   then ``sync_domain_gradients(model, meshes.manager)`` (sum over the domain), then step.

Gradient algebra: a domain rank holds part of every parameter's gradient (its band's), so the
domain ranks' gradients are summed; data-parallel replicas saw different samples, so theirs
are averaged. Tensor-parallel shards are never summed with each other: the ranks of one
domain group share a tp coordinate, so the domain sum adds the same shard's partial gradients.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mpidp.comm import TorchTransport, Transport
from mpidp.errors import ConfigError
from mpidp.ops.collectives import copy_to, reduce_from
from mpidp.parallel.convert import convert_to_domain_parallel
from mpidp.runtime.adopt import manager_for
from mpidp.runtime.manager import (
    MESH_MANAGERS,
    DistributedManager,
    _destroy_groups,
    get_manager,
    init,
    is_initialized,
)
from mpidp.runtime.partition import Balanced, PartitionPolicy, ShardSpec

__all__ = [
    "DATA_MODES",
    "MESH_DIMS",
    "MixedPrecision",
    "ParallelMesh",
    "ParallelismConfig",
    "TensorParallelConv2d",
    "TensorParallelLinear",
    "apply_ddp",
    "apply_domain_parallel",
    "apply_fsdp2",
    "apply_tensor_parallel",
    "build_device_mesh",
    "full_optimizer_state",
    "full_state_dict",
    "load_full_state_dict",
    "sync_domain_gradients",
    "tensor_parallel_size",
]

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
    channels, ``domain`` ranks sharing each sample's latitude bands. ``mixed_precision``
    (FSDP2 only) and ``reshard_after_forward`` are passed to :func:`apply_fsdp2`.

    ``data="none"`` leaves data-parallel gradients to :func:`mpidp.sync_gradients`, which
    cannot handle tensor-parallel shards: with ``tensor`` > 1 it needs dp = 1.
    """

    data: str = "none"
    tensor: int = 1
    domain: int = 1
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

    def sizes(self, world_size: int) -> tuple[int, int, int]:
        """``(dp, tensor, domain)`` for a world of ``world_size`` ranks; ConfigError naming the
        sizes when the world is not a multiple of tensor x domain."""
        inner = self.tensor * self.domain
        if world_size % inner:
            fits = [w for w in range(inner, 4 * inner + 1, inner)]
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor {self.tensor} x domain "
                f"{self.domain} = {inner}; launch a multiple of {inner} ranks (e.g. {fits}) or "
                f"change tensor/domain"
            )
        dp = world_size // inner
        if self.data == "none" and self.tensor > 1 and dp > 1:
            raise ConfigError(
                f"parallelism config: data='none' with tensor {self.tensor} leaves dp = "
                f"{world_size} / ({self.tensor} x {self.domain}) = {dp} replicas whose "
                f"tensor-parallel gradients nothing would average; set data='ddp' or 'fsdp2'"
            )
        return dp, self.tensor, self.domain

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
_MPI_GROUPS: dict[tuple[int, ...], Any] = {}


def _group_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


class ParallelMesh:
    """What :func:`build_device_mesh` returns: the 3-D ``mesh`` (dims ``"dp"``, ``"tp"``,
    ``"domain"``), the ``submeshes`` present, the ``config`` and the ``manager`` whose domain
    group is the mesh's domain dimension.

    ``meshes["tp"]`` is a sub-mesh (KeyError naming those present when absent); ``"tp" in
    meshes``, ``meshes.get("dp")``; ``mesh, submeshes = meshes`` unpacks.
    A sub-mesh is present for ``"dp"`` when data is ``ddp``/``fsdp2`` or dp > 1, for ``"tp"``
    when tensor > 1 and for ``"domain"`` when domain > 1.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        submeshes: dict[str, DeviceMesh],
        config: ParallelismConfig,
        manager: DistributedManager,
    ) -> None:
        self.mesh = mesh
        self.submeshes = submeshes
        self.config = config
        self.manager = manager
        self._closed = False
        self.dp_size, self.tp_size, self.domain_size = (int(s) for s in mesh.mesh.shape)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # every rank of the world is in the mesh
        self.dp_rank, self.tp_rank, self.domain_rank = (int(c) for c in coordinate)

    def __getitem__(self, name: str) -> DeviceMesh:
        if name not in self.submeshes:
            raise KeyError(
                f"no {name!r} sub-mesh in {self.config.as_dict()}: present are "
                f"{sorted(self.submeshes)} (a dimension of size 1 is absent, except dp when "
                f"data is ddp/fsdp2)"
            )
        return self.submeshes[name]

    def __contains__(self, name: object) -> bool:
        return name in self.submeshes

    def get(self, name: str, default: Any = None) -> Any:
        return self.submeshes.get(name, default)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.mesh, self.submeshes))

    def close(self) -> None:
        """Free the mesh's process groups and MPI communicators (local); the manager's
        ``shutdown`` calls it. The meshes are unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        for name in MESH_DIMS:
            comm = _MPI_GROUPS.pop(_group_ranks(self.mesh[name]), None)
            if comm is not None:
                comm.Free()
        if dist.is_initialized():
            _destroy_groups(self.mesh)
        gc.collect()  # the process groups go once nothing (cyclic garbage included) holds them

    def __enter__(self) -> ParallelMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def sync_gradients(self, model: nn.Module) -> None:
        """The gradient reduction this layout still needs after ``backward()``: the domain sum
        (:func:`sync_domain_gradients`) when DDP/FSDP2 average over dp or dp is 1; with
        ``data="none"`` and dp > 1, :func:`mpidp.sync_gradients` (domain sum and dp average in
        one all-reduce). Collective."""
        if self.config.data == "none" and self.dp_size > 1:
            from mpidp.ops.training import sync_gradients

            sync_gradients(model, self.manager)
        else:
            sync_domain_gradients(model, self.manager)

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(dp={self.dp_size}, tp={self.tp_size}, domain={self.domain_size}, "
            f"data={self.config.data!r}, coordinate=({self.dp_rank}, {self.tp_rank}, "
            f"{self.domain_rank}), submeshes={sorted(self.submeshes)})"
        )


def build_device_mesh(
    parallelism_conf: ParallelismConfig | Mapping[str, Any],
    device: str | torch.device | None = None,
    *,
    manager: DistributedManager | None = None,
) -> ParallelMesh:
    """The ``(dp, tp, domain)`` DeviceMesh of ``parallelism_conf`` and its sub-meshes.

    Initialises mpidp (:func:`mpidp.init` with ``domain_parallel_size=domain`` and ``device``)
    unless ``manager`` is given or mpidp is initialised already; that manager's domain size must
    be the config's. ``device`` (default: the manager's) picks the mesh's device type. The world
    must be a multiple of tensor x domain (ConfigError naming the sizes otherwise; the check
    runs before any communication, the same on every rank). Collective over the world.
    """
    conf = ParallelismConfig.coerce(parallelism_conf)
    if manager is None and is_initialized():
        manager = get_manager()
    world = manager.world_size if manager is not None else DistributedManager.world_from_launcher()
    dp, tp, domain = conf.sizes(world)
    if manager is None:
        manager = init(domain_parallel_size=domain, device=device)
    elif manager.domain_world_size != domain:
        raise ConfigError(
            f"rank {manager.rank}: the manager's domain size is {manager.domain_world_size} but "
            f"the parallelism config asks for domain {domain}; build the manager with "
            f"domain_parallel_size={domain} (or let build_device_mesh initialise mpidp)"
        )
    dev = torch.device(device) if device is not None else manager.device
    mesh = init_device_mesh(dev.type, (dp, tp, domain), mesh_dim_names=MESH_DIMS)
    present = {
        "dp": conf.data != "none" or dp > 1,
        "tp": tp > 1,
        "domain": domain > 1,
    }
    submeshes = {name: mesh[name] for name in MESH_DIMS if present[name]}
    _register_mpi_groups(manager, mesh)
    if manager not in MESH_MANAGERS:
        MESH_MANAGERS.append(manager)
        manager._on_shutdown.append(lambda: MESH_MANAGERS.remove(manager))
    meshes = ParallelMesh(mesh, submeshes, conf, manager)
    manager._on_shutdown.append(meshes.close)
    return meshes


def _register_mpi_groups(manager: DistributedManager, mesh: DeviceMesh) -> None:
    """One MPI communicator per mesh dimension (collective over the world), when MPI spans the
    job: the tensor-parallel layers then move CPU tensors through MPI, as the domain layers do."""
    if not manager.mpi_available or manager.world_size == 1:
        return
    from mpi4py import MPI

    coord = mesh.get_coordinate()
    assert coord is not None
    for axis, name in enumerate(MESH_DIMS):
        ranks = _group_ranks(mesh[name])
        color = 0
        for i, size in enumerate(mesh.mesh.shape):
            if i != axis:
                color = color * int(size) + int(coord[i])
        if ranks in _MPI_GROUPS:
            # Split anyway: every rank must take part, whatever it has cached.
            MPI.COMM_WORLD.Split(color=color, key=int(coord[axis])).Free()
            continue
        _MPI_GROUPS[ranks] = MPI.COMM_WORLD.Split(color=color, key=int(coord[axis]))


def _transport(mesh: DeviceMesh, device: torch.device) -> Transport:
    """The transport over a 1-D (sub-)mesh for tensors on ``device``."""
    comm = _MPI_GROUPS.get(_group_ranks(mesh))
    if comm is not None and device.type == "cpu":
        from mpidp.comm.mpi import MPITransport

        return MPITransport(comm)
    return TorchTransport(mesh.get_group(), device)


def _one_dim(mesh: Any, what: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise ConfigError(
            f"{what} must be a 1-D DeviceMesh (meshes[...]), got {type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        raise ConfigError(
            f"{what} must be a 1-D DeviceMesh, got {mesh.ndim} dims {mesh.mesh_dim_names}; "
            f"pass meshes['tp'] / meshes['dp'] / meshes['domain']"
        )
    return mesh


# -- tensor parallelism -------------------------------------------------------------------------


class _TensorParallel:
    """Shared by the tensor-parallel layers: ``style`` is ``"col"`` (output channels split,
    input replicated: Megatron's column-parallel) or ``"row"`` (input channels split, partial
    outputs summed over the tp group, bias added once: row-parallel). ``spec`` is the split of
    the channels over the tp ranks; ``shards`` maps a parameter name to the dim it is split on."""

    style: str
    spec: ShardSpec
    tp_rank: int
    shards: dict[str, int]
    _tp_mesh: DeviceMesh
    _mpidp_safe = True  # channel-wise: exact on a latitude band, left alone by the conversion

    def _setup(
        self, source: nn.Module, style: str, mesh: DeviceMesh, spec: ShardSpec, rank: int
    ) -> None:
        assert isinstance(self, nn.Module)
        self.style, self.spec, self.tp_rank, self._tp_mesh = style, spec, rank, mesh
        rows = spec.slice(rank)
        self.shards = {"weight": 0, "bias": 0} if style == "col" else {"weight": 1}
        with torch.no_grad():
            for name, param in source.named_parameters(recurse=False):
                dim = self.shards.get(name)
                value = (
                    param.detach()
                    if dim is None
                    else param.detach().narrow(dim, rows.start, rows.stop - rows.start)
                )
                setattr(self, name, nn.Parameter(value.clone(), param.requires_grad))
        if getattr(source, "bias", None) is None:
            self.register_parameter("bias", None)
        self.shards = {n: d for n, d in self.shards.items() if getattr(self, n) is not None}

    def transport(self, device: torch.device) -> Transport:
        return _transport(self._tp_mesh, device)

    def _tp_forward(self, x: torch.Tensor, local: Any) -> torch.Tensor:
        assert isinstance(self, nn.Module)
        t = self.transport(x.device)
        if self.style == "col":
            return local(copy_to(x, t), self.weight, self.bias)
        y = reduce_from(local(x, self.weight, None), t)
        bias = self.bias
        return y if not isinstance(bias, torch.Tensor) else y + self._bias_view(bias)

    def _bias_view(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def extra_repr(self) -> str:
        assert isinstance(self, nn.Module)
        base = super().extra_repr()  # type: ignore[misc]  # the torch layer's own description
        return f"{base}, tp={self.style} {list(self.spec.sizes)} rank {self.tp_rank}"


class TensorParallelLinear(_TensorParallel, nn.Linear):
    """An ``nn.Linear`` whose output (``col``) or input (``row``) features are split over the tp
    group; built by :func:`apply_tensor_parallel`. Parameter names are the serial layer's."""

    def __init__(
        self, source: nn.Linear, style: str, mesh: DeviceMesh, spec: ShardSpec, rank: int
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = source.in_features, source.out_features
        self._setup(source, style, mesh, spec, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tp_forward(x, F.linear)


class TensorParallelConv2d(_TensorParallel, nn.Conv2d):
    """A 1x1 ``nn.Conv2d`` with its output (``col``) or input (``row``) channels split over the
    tp group; built by :func:`apply_tensor_parallel`. Parameter names are the serial layer's."""

    def __init__(
        self, source: nn.Conv2d, style: str, mesh: DeviceMesh, spec: ShardSpec, rank: int
    ) -> None:
        nn.Module.__init__(self)
        for name in (
            "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
            "transposed", "output_padding", "groups", "padding_mode",
            "_reversed_padding_repeated_twice",
        ):  # fmt: skip
            setattr(self, name, getattr(source, name))
        self._setup(source, style, mesh, spec, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tp_forward(x, self._conv_forward)

    def _bias_view(self, bias: torch.Tensor) -> torch.Tensor:
        return bias.view(-1, 1, 1)


def _tp_problem(layer: nn.Module, style: str, parts: int) -> str | None:
    if isinstance(layer, nn.Linear):
        size = layer.out_features if style == "col" else layer.in_features
    elif isinstance(layer, nn.Conv2d) and not isinstance(layer, nn.ConvTranspose2d):
        if tuple(layer.kernel_size) != (1, 1) or layer.groups != 1:
            return (
                f"a tensor-parallel Conv2d must be 1x1 with groups=1 (kernel "
                f"{tuple(layer.kernel_size)}, groups {layer.groups})"
            )
        size = layer.out_channels if style == "col" else layer.in_channels
    else:
        return f"{type(layer).__name__} is not nn.Linear or a 1x1 nn.Conv2d"
    if size < parts:
        what = "output" if style == "col" else "input"
        return f"{size} {what} channels cannot be split over {parts} tensor-parallel ranks"
    return None


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh | None, *, partition: PartitionPolicy | None = None
) -> nn.Module:
    """Split the layers that opt in over ``tp_mesh``, in place; returns ``model``.

    A module opts in by declaring ``_tp_col`` and ``_tp_row``: dotted paths, relative to that
    module, to its column-parallel layers (output channels split; pair each with a row layer)
    and row-parallel layers (input channels split; outputs summed over tp). ``nn.Linear`` and
    1x1 ``nn.Conv2d`` are supported; only channel-wise operations (activations, dropout)
    belong between a column layer and its row layer. Channels are split by ``partition``
    (default balanced: 6 over 4 ranks is 2, 2, 1, 1), so uneven channel counts work.

    The weights must already be the same on every tp rank (seed, or
    :func:`mpidp.broadcast_parameters` first): each rank keeps its slice. ``tp_mesh`` None or
    of size 1 leaves the model as it is. Raises ConfigError listing every layer that cannot be
    split, before anything changes. No communication.
    """
    if tp_mesh is None:
        return model
    mesh = _one_dim(tp_mesh, "tp_mesh")
    parts = mesh.size()
    rank = mesh.get_local_rank()
    policy = partition if partition is not None else Balanced()
    plan: list[tuple[str, nn.Module, str]] = []
    problems: list[str] = []
    for owner_path, owner in model.named_modules():
        cols, rows = _paths(owner, "_tp_col"), _paths(owner, "_tp_row")
        for style, paths in (("col", cols), ("row", rows)):
            for rel in paths:
                where = f"{owner_path}.{rel}" if owner_path else rel
                if rel in cols and rel in rows:
                    problems.append(f"{where}: listed in both _tp_col and _tp_row")
                    continue
                try:
                    layer = owner.get_submodule(rel)
                except AttributeError:
                    problems.append(
                        f"{where}: no such module (declared in {owner_path or 'the model'})"
                    )
                    continue
                if isinstance(layer, _TensorParallel):
                    continue  # applied already
                problem = _tp_problem(layer, style, parts)
                if problem:
                    problems.append(f"{where}: {problem}")
                else:
                    plan.append((where, layer, style))
    if problems:
        raise ConfigError(
            "apply_tensor_parallel: cannot split\n  " + "\n  ".join(sorted(set(problems)))
        )
    if parts == 1:
        return model
    for where, layer, style in plan:
        size = _split_size(layer, style)
        spec = policy.spec(size, parts)
        kind = TensorParallelLinear if isinstance(layer, nn.Linear) else TensorParallelConv2d
        replacement = kind(layer, style, mesh, spec, rank)  # type: ignore[arg-type]
        parent_path, _, name = where.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, replacement)
    return model


def _paths(owner: nn.Module, attribute: str) -> list[str]:
    value = getattr(owner, attribute, None) or ()
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _split_size(layer: nn.Module, style: str) -> int:
    if isinstance(layer, nn.Linear):
        return layer.out_features if style == "col" else layer.in_features
    assert isinstance(layer, nn.Conv2d)
    return layer.out_channels if style == "col" else layer.in_channels


# -- domain, DDP, FSDP2 -------------------------------------------------------------------------


def apply_domain_parallel(
    model: nn.Module, domain: DeviceMesh | DistributedManager | None = None, **convert: Any
) -> nn.Module:
    """:func:`mpidp.convert_to_domain_parallel` over ``domain``: the domain sub-mesh of
    :func:`build_device_mesh`, a :class:`~mpidp.DistributedManager`, or None (the default
    manager). Keyword arguments go to the conversion. Use the return value."""
    return convert_to_domain_parallel(model, manager_for(domain), **convert)


def _block_paths(model: nn.Module, blocks: Any) -> list[nn.Module]:
    if blocks is None:
        declared = getattr(model, "_fsdp_blocks", None)
        if declared is not None:
            blocks = [declared] if isinstance(declared, str) else list(declared)
        else:
            return [
                child for child in model.children() if next(child.parameters(), None) is not None
            ]
    if isinstance(blocks, type) or (
        isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)
    ):
        kinds = blocks if isinstance(blocks, tuple) else (blocks,)
        return [m for m in model.modules() if isinstance(m, kinds) and m is not model]
    out = []
    for b in blocks:
        if isinstance(b, nn.Module):
            out.append(b)
        else:
            try:
                out.append(model.get_submodule(str(b)))
            except AttributeError:
                raise ConfigError(
                    f"apply_fsdp2: block {b!r} is not a module of the model"
                ) from None
    return out


def apply_fsdp2(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: Iterable[str | nn.Module] | type | tuple[type, ...] | None = None,
    mixed_precision: MixedPrecision | Mapping[str, Any] | ParallelismConfig | Any = None,
    reshard_after_forward: bool | None = None,
    config: ParallelismConfig | Mapping[str, Any] | None = None,
) -> nn.Module:
    """FSDP2 over ``dp_mesh``: ``fully_shard`` each block, then the root; returns ``model``
    (sharded in place).

    ``blocks``: module paths, modules or module types; default the model's ``_fsdp_blocks``
    paths, else every direct child that has parameters. ``mixed_precision`` (a
    :class:`MixedPrecision`, a mapping such as ``{"param_dtype": "bfloat16", "reduce_dtype":
    "float32"}``, or FSDP2's policy) and ``reshard_after_forward`` default to ``config``'s
    (a :class:`ParallelismConfig` or mapping). FSDP2 averages gradients over dp; call
    :func:`sync_domain_gradients` after ``backward()`` to sum them over the domain.
    Apply tensor and domain parallelism first. Collective over ``dp_mesh``.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = _one_dim(dp_mesh, "dp_mesh")
    conf = None if config is None else ParallelismConfig.coerce(config)
    if isinstance(mixed_precision, ParallelismConfig):
        conf, mixed_precision = mixed_precision, None
    mp = MixedPrecision.coerce(mixed_precision)
    if mp is None and conf is not None:
        mp = conf.mixed_precision
    if reshard_after_forward is None:
        reshard_after_forward = True if conf is None else conf.reshard_after_forward
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = mp.policy()
    for block in _block_paths(model, blocks):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel`` over ``dp_mesh``'s process group; returns the wrapper
    (its gradients are averaged over dp in ``backward()``; call :func:`sync_domain_gradients`
    after it to sum them over the domain). Extra keyword arguments go to DDP. Collective
    over ``dp_mesh``."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = _one_dim(dp_mesh, "dp_mesh")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
    return DistributedDataParallel(model, process_group=mesh.get_group(), **ddp_kwargs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (FSDP2's sharded parameters and gradients)."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def sync_domain_gradients(
    model: nn.Module, manager: DistributedManager | ParallelMesh | None = None
) -> None:
    """Sum every gradient over the domain group, in place: after ``backward()`` when DDP or
    FSDP2 own the data-parallel average (the domain ranks' gradients are parts of one sample's
    gradient). Works on FSDP2's sharded gradients (the ranks of a domain group hold the same
    shard) and tensor-parallel shards (they share a tp coordinate). One all-reduce per bucket
    of about 32 MB. Collective over the domain group."""
    from mpidp.ops.training import sum_in_buckets

    m = manager.manager if isinstance(manager, ParallelMesh) else manager or get_manager()
    if m.domain_world_size == 1:
        return
    sum_in_buckets([_local(p.grad) for p in model.parameters() if p.grad is not None], m, "domain")


# -- whole state: gather and scatter of sharded parameters ---------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/compile wrappers (their state_dict keys gain prefixes)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _tp_keys(model: nn.Module) -> dict[str, tuple[_TensorParallel, int]]:
    """state_dict key -> (tensor-parallel layer, split dim)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, _TensorParallel):
            for name, dim in module.shards.items():
                out[f"{path}.{name}" if path else name] = (module, dim)
    return out


def tensor_parallel_size(model: nn.Module) -> int:
    """The tensor-parallel group size of ``model``'s split layers (1 when it has none)."""
    for module in _unwrap(model).modules():
        if isinstance(module, _TensorParallel):
            return module.spec.parts
    return 1


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _full(value: torch.Tensor, tp: tuple[_TensorParallel, int] | None) -> torch.Tensor:
    if _is_dtensor(value):
        value = value.full_tensor()  # type: ignore[attr-defined]
    value = value.detach()
    if tp is not None:
        layer, dim = tp
        value = layer.transport(value.device).all_gather_v(value, layer.spec.sizes, dim)
    return value


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> state_dict name, for mapping optimizer state to parameters."""
    return {id(p): n for n, p in _unwrap(model).named_parameters()}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The serial model's state_dict, on every rank: FSDP2 shards gathered over dp,
    tensor-parallel shards over tp, DDP/compile prefixes removed. Collective over the world
    (every rank calls it, in the same order)."""
    inner = _unwrap(model)
    tp = _tp_keys(inner)
    return {k: _full(v, tp.get(k)) for k, v in inner.state_dict().items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every per-parameter tensor gathered like its parameter
    (as :func:`full_state_dict`), so the serial model's optimizer loads it. Collective."""
    inner = _unwrap(model)
    tp = _tp_keys(inner)
    names = _param_names(inner)
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    full_state = {}
    for index, per_param in state["state"].items():
        param = params[index]
        key = tp.get(names.get(id(param), ""))
        full_state[index] = {
            k: _full(v, key if v.dim() and v.shape == param.shape else None)
            if isinstance(v, torch.Tensor) and (v.dim() or _is_dtensor(v))
            else v
            for k, v in per_param.items()
        }
    return {"state": full_state, "param_groups": state["param_groups"]}


def _shard_like(
    full: torch.Tensor, like: torch.Tensor, tp: tuple[_TensorParallel, int] | None
) -> Any:
    """``full`` cut like the live tensor ``like``: its tp slice, then its FSDP2 shard."""
    if tp is not None:
        layer, dim = tp
        part = layer.spec.slice(layer.tp_rank)
        full = full.narrow(dim, part.start, part.stop - part.start)
    if _is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            full.to(like.device, like.dtype),
            like.device_mesh,  # type: ignore[attr-defined]
            like.placements,  # type: ignore[attr-defined]
            src_data_rank=None,  # every rank holds the full tensor: no communication
        )
    return full


def load_full_state_dict(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
    *,
    strict: bool = True,
) -> None:
    """Load a serial (full) state_dict into a tensor-parallel / FSDP2 / DDP model: each rank
    keeps its shards. With ``optimizer`` and ``optimizer_state`` (as saved by
    :func:`full_optimizer_state` or a serial optimizer), the optimizer too. No communication."""
    inner = _unwrap(model)
    tp = _tp_keys(inner)
    live = inner.state_dict()
    local = {
        k: _shard_like(v, live[k], tp.get(k)) if k in live and isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }
    inner.load_state_dict(local, strict=strict)
    if optimizer is None or optimizer_state is None:
        return
    names = _param_names(inner)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cut = {}
    for index, per_param in optimizer_state["state"].items():
        param = params[int(index)]
        key = tp.get(names.get(id(param), ""))
        cut[index] = {
            k: _shard_like(v, param, key)
            if isinstance(v, torch.Tensor) and v.dim() and v.shape == _full_shape(param, key)
            else v
            for k, v in per_param.items()
        }
    optimizer.load_state_dict({"state": cut, "param_groups": optimizer_state["param_groups"]})


def _full_shape(param: torch.Tensor, tp: tuple[_TensorParallel, int] | None) -> torch.Size:
    shape = list(param.shape)  # a DTensor's shape is its global (dp-gathered) shape
    if tp is not None:
        layer, dim = tp
        shape[dim] = layer.spec.total
    return torch.Size(shape)
