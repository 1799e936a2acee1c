"""The spectral layout of :mod:`mpidp.ops.fft` (which global modes a rank holds, recorded on a
transform's output and queried by :func:`layout`, :func:`modes` and :func:`mode_spec`) and the
steps its transforms share: the group and partitions of a call, the one all-to-all, and the
FFT of one rank's part (an empty one included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.ops.bands import learn_spec
from mpidp.ops.collectives import all_to_all_v
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import ShardSpec, as_sizes

__all__ = [
    "FFT_OPS",
    "Spec",
    "SpectralLayout",
    "context",
    "input_spec",
    "layout",
    "mark",
    "mode_spec",
    "modes",
    "output_spec",
    "policy",
    "run_fft",
    "size_arg",
    "transpose",
    "two_dims",
]

_ATTR = "_mpidp_spectral"
Spec = ShardSpec | Sequence[int] | None


@dataclasses.dataclass(frozen=True)
class SpectralLayout:
    """Which global modes a rank holds: ``spec`` cuts dim ``dim`` (counted from the end) of the
    spectral tensor over the group; this rank (``rank``) holds ``spec.slice(rank)``."""

    spec: ShardSpec
    dim: int
    rank: int

    @property
    def modes(self) -> slice:
        """This rank's global mode numbers along ``dim``, as a slice."""
        return self.spec.slice(self.rank)


# -- plumbing ---------------------------------------------------------------------------------


def context(
    x: torch.Tensor, manager: DistributedManager | None, group: Any
) -> tuple[DistributedManager, Transport]:
    m = manager if manager is not None else get_manager()
    if isinstance(group, Transport):
        return m, group
    return m, m.transport(group, x.device)


def policy(m: DistributedManager, n: int, parts: int) -> ShardSpec:
    """The manager's policy for ``n`` entries over ``parts`` ranks; with fewer entries than
    ranks (3 modes over 4 ranks) a balanced cut whose last ranks hold none."""
    return m.partition.derived(n, parts)


def _given(spec: Spec, t: Transport, x: torch.Tensor, d: int, what: str) -> ShardSpec | None:
    if spec is None:
        return None
    s = spec if isinstance(spec, ShardSpec) else ShardSpec.from_sizes(as_sizes(spec))
    if s.parts != t.size:
        raise ConfigError(
            f"rank {t.rank}: {what} {s} has {s.parts} parts for a group of {t.size} ranks; "
            f"give one size per rank"
        )
    if x is not None and x.size(d) != s[t.rank]:
        raise ConfigError(
            f"rank {t.rank}: {what} {s} gives this rank {s[t.rank]} entries along dim {d}, "
            f"but the tensor {tuple(x.shape)} holds {x.size(d)}; pass the partition the "
            f"tensor was cut by (or leave {what} out to learn it)"
        )
    return s


def input_spec(x: torch.Tensor, d: int, t: Transport, spec: Spec) -> ShardSpec:
    """The partition of ``x`` along ``d``: ``spec`` when given, else the layout recorded by an
    mpidp.ops.fft transform, else every rank's extent (one all-gather of one integer)."""
    given = _given(spec, t, x, d, "spec")
    if given is not None:
        return given
    recorded = getattr(x, _ATTR, None)
    if (
        isinstance(recorded, SpectralLayout)
        and recorded.dim == d - x.dim()
        and recorded.spec.parts == t.size
        and recorded.spec[t.rank] == x.size(d)
    ):
        return recorded.spec
    return learn_spec(x, d, t)


def output_spec(m: DistributedManager, t: Transport, n: int, out_spec: Spec) -> ShardSpec:
    if out_spec is None:
        return policy(m, n, t.size)
    s = out_spec if isinstance(out_spec, ShardSpec) else ShardSpec.from_sizes(as_sizes(out_spec))
    if s.parts != t.size or s.total != n:
        raise ConfigError(
            f"rank {t.rank}: out_spec {s} must cut {n} entries over {t.size} ranks "
            f"(it cuts {s.total} over {s.parts})"
        )
    return s


def two_dims(x: torch.Tensor, dim: Sequence[int], shard_dim: int) -> tuple[int, int, int]:
    """(first, second, sharded) as non-negative dims of ``x``."""
    nd = x.dim()
    if len(dim) != 2:
        raise ConfigError(f"dim={tuple(dim)}: a 2-D transform takes two dims")
    try:
        a, b, sd = (d + nd if -nd <= d < 0 else d for d in (*dim, shard_dim))
        if not (0 <= a < nd and 0 <= b < nd and 0 <= sd < nd) or a == b:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"dim={tuple(dim)}, shard_dim={shard_dim} do not name two different dims of a "
            f"{nd}-D tensor {tuple(x.shape)}"
        ) from None
    return a, b, sd


def size_arg(s: Sequence[int] | None, i: int) -> int | None:
    if s is None:
        return None
    return None if s[i] == -1 else int(s[i])


def transpose(
    x: torch.Tensor, t: Transport, split: ShardSpec, split_dim: int, rows: ShardSpec, cat_dim: int
) -> torch.Tensor:
    """Sharded along ``cat_dim`` (by ``rows``) in, sharded along ``split_dim`` (by ``split``)
    out: the one all-to-all of each transform."""
    return all_to_all_v(x, split, rows, split_dim=split_dim, cat_dim=cat_dim, group=t)


FFT_OPS = {
    "rfft": torch.fft.rfft,
    "irfft": torch.fft.irfft,
    "fft": torch.fft.fft,
    "ifft": torch.fft.ifft,
}


def run_fft(kind: str, y: torch.Tensor, n: int | None, d: int, norm: str | None) -> torch.Tensor:
    """``torch.fft.<kind>(y, n=n, dim=d, norm=norm)``; on an empty shard (no rows or no modes
    here) the result's zeros without calling the FFT library (MKL refuses empty batches), still
    joined to ``y`` in the graph, so that this rank's backward reaches the exchanges too."""
    if y.numel():
        return FFT_OPS[kind](y, n=n, dim=d, norm=norm)
    length = {
        "rfft": (n or y.size(d)) // 2 + 1,
        "irfft": n or 2 * (y.size(d) - 1),
    }.get(kind, n or y.size(d))
    shape = list(y.shape)
    shape[d] = length
    real = kind == "irfft"
    dtype = y.dtype if y.is_complex() != real else _partner(y.dtype)
    anchor = y.sum() * 0
    if real and anchor.is_complex():
        anchor = anchor.real
    return torch.zeros(shape, dtype=dtype, device=y.device) + anchor


def _partner(dtype: torch.dtype) -> torch.dtype:
    """complex64 <-> float32, complex128 <-> float64."""
    pairs = {
        torch.float32: torch.complex64,
        torch.float64: torch.complex128,
        torch.complex64: torch.float32,
        torch.complex128: torch.float64,
    }
    return pairs[dtype]


def mark(x: torch.Tensor, spec: ShardSpec, d: int, t: Transport) -> torch.Tensor:
    setattr(x, _ATTR, SpectralLayout(spec, d - x.dim(), t.rank))
    return x


# -- the spectral layout, queried -------------------------------------------------------------


def layout(x: torch.Tensor) -> SpectralLayout:
    """The spectral layout an mpidp.ops.fft transform recorded on its output ``x``. Arithmetic on
    ``x`` gives a tensor without it: query the transform's own output, or use :func:`modes` with
    the global mode count."""
    found = getattr(x, _ATTR, None)
    if not isinstance(found, SpectralLayout):
        raise ConfigError(
            "this tensor carries no spectral layout (only the direct output of mpidp.ops.fft."
            "rfft2/fft2/rfft/fft does); call mpidp.ops.fft.modes(n_modes, manager=...) instead"
        )
    return found


def mode_spec(n: int, *, manager: DistributedManager | None = None, group: Any = None) -> ShardSpec:
    """How ``n`` global modes are cut over the group in the spectral layout: the manager's
    partition policy, or, with fewer modes than ranks, a balanced cut with empty last ranks."""
    m = manager if manager is not None else get_manager()
    size = group.size if isinstance(group, Transport) else m.transport(group).size
    return policy(m, n, size)


def modes(
    x: torch.Tensor | int, *, manager: DistributedManager | None = None, group: Any = None
) -> slice:
    """The global mode numbers this rank holds along the split dim of the spectral layout, as
    a slice: ``filt[..., modes(X)]`` is this rank's part of a filter over the ``Kx`` modes.

    ``x`` is the direct output of a transform (its recorded layout), or the global number of
    modes (``W // 2 + 1`` for ``rfft2``, ``W`` for ``fft2``) with the manager that cuts them."""
    if isinstance(x, torch.Tensor):
        return layout(x).modes
    m = manager if manager is not None else get_manager()
    t = group if isinstance(group, Transport) else m.transport(group)
    return mode_spec(int(x), manager=m, group=t).slice(t.rank)
