"""Distributed FFT on latitude bands: exact ``torch.fft`` transforms of the global field.

Layouts (B, C, H, W fields, cut into bands along H):

* **band layout**: this rank holds rows ``spec.slice(rank)`` of H, every column of W;
* **spectral layout**: this rank holds every (full) H frequency and a contiguous range of the
  W frequencies, ``modes(X)``: the partition policy of the manager cuts the ``W // 2 + 1``
  modes of ``rfft2`` (the ``W`` of ``fft2``) as it cuts rows.

``rfft2`` transforms W on the band (local), makes ONE uneven ``all_to_all_v`` (split the modes,
gather the rows), then transforms H (now local). The inverse runs backwards. A forward and
inverse pair is two all-to-alls; the spectral filter between them is local. Every step is a
differentiable op (torch's own FFT gradients, the Hermitian weighting of ``irfft`` included, and
the all-to-all's reverse exchange), so the gradient is torch's gradient of the serial transform
and double backward works.

The functions take torch.fft's arguments (``s``/``n``, ``dim``, ``norm``) plus ``manager``,
``group`` (default: the manager's domain group), ``spec`` (the partition of the input's sharded
dim; learned with one small all-gather when left out) and ``out_spec`` (the partition of the
output's sharded dim; default: the manager's policy). A transform whose dims leave out the
sharded dim (``shard_dim``, default -2) is local: plain ``torch.fft``. Every call that moves
data is collective over the group.

**Blocks** (a manager whose grid cuts the longitude, ``P_lon > 1``, ``group`` left out): the
2-D transforms take this rank's block (rows of the latitude column's cut, columns of the
longitude row's) and first make one all-to-all within the longitude row (the pencil transpose:
the block's rows are sub-cut over the row, each rank gets its sub-cut's rows with every column),
then run the band steps above over the domain group on those rows, which in domain rank order
are a band cut of H. The spectral layout is the band one over the domain group: every H
frequency, the modes cut by the policy over all ``P_lat * P_lon`` ranks in domain rank order
(``modes(K)`` as on bands). The inverse runs backwards and returns blocks (``out_spec``: a
:class:`~mpidp.runtime.grid.BlockSpec`, default ``manager.block_spec``). On bands the longitude
row is this rank alone and the pencil step is skipped: the band path, unchanged. The 1-D
transforms and the halved-cut layout take their input for a band and refuse on blocks.

The spectral layout and the steps the transforms share are in :mod:`mpidp.ops.spectral_layout`
(:class:`SpectralLayout`, :func:`layout`, :func:`modes` and :func:`mode_spec` re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from mpidp.errors import ConfigError
from mpidp.ops.spectral_layout import (
    FFT_OPS,
    Spec,
    SpectralLayout,
    block_input,
    block_output,
    context,
    input_spec,
    layout,
    lon_row,
    mark,
    mode_spec,
    modes,
    output_spec,
    pencils,
    policy,
    run_fft,
    size_arg,
    transpose,
    two_dims,
)
from mpidp.runtime.grid import BlockSpec, blocks_refused
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "DistributedIRFFT2",
    "DistributedRFFT2",
    "SpectralLayout",
    "fft",
    "fft2",
    "ifft",
    "ifft2",
    "irfft",
    "irfft2",
    "layout",
    "mode_spec",
    "modes",
    "rfft",
    "rfft2",
    "rfft2_halved_cut",
    "irfft2_halved_cut",
]

# -- 2-D transforms ---------------------------------------------------------------------------


def _lat(spec: BlockSpec | Spec) -> Spec:
    """A band transform's partition of the rows: on bands a BlockSpec is its latitude cut."""
    return spec.lat if isinstance(spec, BlockSpec) else spec


def _bands_only(manager: DistributedManager | None, group: Any, what: str) -> None:
    """Refuse, on every rank alike, a transform that takes its input for a band of the domain
    group (``group`` None) when the grid cuts the longitude."""
    if group is not None or (manager is None and not is_initialized()):
        return
    m = manager if manager is not None else get_manager()
    if m._blocks:
        raise blocks_refused(m, what)


class _Dims2(NamedTuple):
    """A 2-D transform's dims of its input (non-negative): the transformed ``a`` and ``b``,
    the sharded ``sd`` (one of them) and the other, ``local``; the sizes ``s`` asks along
    ``local`` and along ``sd`` (None: the input's)."""

    a: int
    b: int
    sd: int
    local: int
    local_n: int | None
    shard_n: int | None


def _dims2(
    x: torch.Tensor,
    s: Sequence[int] | None,
    dim: Sequence[int],
    shard_dim: int,
    manager: DistributedManager | None,
    group: Any,
    halving: str | None,
) -> _Dims2 | None:
    """The dims of a 2-D transform of ``x``; None when neither transformed dim is the sharded
    one (the transform is torch's, local; refused on blocks on every rank alike). A real
    transform (``halving`` names it) halves the local dim: ``dim[1]`` sharded is a
    ConfigError."""
    a, b, sd = two_dims(x, dim, shard_dim)
    if sd not in (a, b):
        _bands_only(manager, group, f"a 2-D transform over dims {(a, b)} without shard_dim {sd}")
        return None
    if halving is not None and sd == b:
        raise ConfigError(
            f"{halving} over dim=({a}, {b}) would halve dim {b}, the sharded one: mpidp.ops.fft "
            f"halves the local dim; pass dim=({b}, {a}) (the sharded dim first, W last), or "
            f"call {halving}_halved_cut for a field cut along the halved dim"
        )
    if sd == a:
        return _Dims2(a, b, sd, b, size_arg(s, 1), size_arg(s, 0))
    return _Dims2(a, b, sd, a, size_arg(s, 0), size_arg(s, 1))


def _forward2(
    x: torch.Tensor,
    s: Sequence[int] | None,
    dim: Sequence[int],
    norm: str | None,
    real: bool,
    manager: DistributedManager | None,
    group: Any,
    spec: Spec | BlockSpec,
    out_spec: Spec,
    shard_dim: int,
) -> torch.Tensor:
    d = _dims2(x, s, dim, shard_dim, manager, group, "rfft2" if real else None)
    if d is None:  # both transformed dims are local
        op = torch.fft.rfft2 if real else torch.fft.fft2
        return op(x, s=s, dim=dim, norm=norm)
    a, b, sd, local, local_n, shard_n = d
    m, t = context(x, manager, group)
    t_lon = lon_row(m, group, x.device)
    if t_lon is None:
        rows = input_spec(x, sd, t, _lat(spec))
    else:  # blocks: the pencil transpose along the longitude row gives whole rows
        p = pencils(m, block_input(m, x, (sd, local), spec))
        x = transpose(x, t_lon, p.sub, sd, p.blocks.lon, local)
        rows = p.rows
    if t.size == 1:
        op = torch.fft.rfft2 if real else torch.fft.fft2
        out = op(x, s=s, dim=(a, b), norm=norm)
        return mark(out, ShardSpec((out.size(local),)), local, t)
    y = run_fft("rfft" if real else "fft", x, local_n, local, norm)
    split = output_spec(m, t, y.size(local), out_spec)
    y = transpose(y, t, split, local, rows, sd)
    y = run_fft("fft", y, shard_n, sd, norm)
    return mark(y, split, local, t)


def _inverse2(
    X: torch.Tensor,
    s: Sequence[int] | None,
    dim: Sequence[int],
    norm: str | None,
    real: bool,
    manager: DistributedManager | None,
    group: Any,
    spec: Spec,
    out_spec: Spec | BlockSpec,
    shard_dim: int,
) -> torch.Tensor:
    d = _dims2(X, s, dim, shard_dim, manager, group, "irfft2" if real else None)
    if d is None:  # both transformed dims are local
        op = torch.fft.irfft2 if real else torch.fft.ifft2
        return op(X, s=s, dim=dim, norm=norm)
    a, b, sd, local, local_n, shard_n = d
    m, t = context(X, manager, group)
    split = input_spec(X, local, t, spec)
    if t.size == 1:
        op = torch.fft.irfft2 if real else torch.fft.ifft2
        return op(X, s=s, dim=(a, b), norm=norm)
    y = run_fft("ifft", X, shard_n, sd, norm)
    if real:
        n = local_n if local_n is not None else 2 * (split.total - 1)
    else:
        n = local_n if local_n is not None else split.total
    t_lon = lon_row(m, group, X.device)
    p = None
    if t_lon is None:
        rows = output_spec(m, t, y.size(sd), _lat(out_spec))
    else:  # blocks: back to the pencils' rows, then along the longitude row to blocks
        p = pencils(m, block_output(m, (y.size(sd), n), (sd, local), out_spec))
        rows = p.rows
    y = transpose(y, t, rows, sd, split, local)
    y = run_fft("irfft" if real else "ifft", y, n, local, norm)
    if p is None or t_lon is None:  # bands
        return y
    return transpose(y, t_lon, p.blocks.lon, local, p.sub, sd)


def rfft2(
    x: torch.Tensor,
    s: Sequence[int] | None = None,
    dim: Sequence[int] = (-2, -1),
    norm: str | None = None,
    *,
    manager: DistributedManager | None = None,
    group: Any = None,
    spec: Spec | BlockSpec = None,
    out_spec: Spec = None,
    shard_dim: int = -2,
) -> torch.Tensor:
    """``torch.fft.rfft2`` of the global field whose bands (or blocks) the ranks hold.

    ``x`` (..., H_r, W) band layout -> (..., H', K_r) spectral layout, ``K = W' // 2 + 1``
    modes cut by ``out_spec`` (default: the manager's policy; :func:`modes`). ``dim[0]`` must
    be the sharded dim (the halved ``dim[1]`` is local). ``s`` crops or zero-pads as torch
    does (H too: the rows are gathered first). On blocks ``x`` is (..., H_r, W_c), ``spec`` a
    BlockSpec (learned when left out), and one more all-to-all along the longitude row comes
    first; a band there (its cut as ``spec``, or extents that are no blocks of the grid) is a
    ConfigError on every rank: ``group=manager.transport()`` transforms it as a band of the
    domain group. Collective over ``group`` (on blocks: the domain group)."""
    return _forward2(x, s, dim, norm, True, manager, group, spec, out_spec, shard_dim)


def irfft2(
    X: torch.Tensor,
    s: Sequence[int] | None = None,
    dim: Sequence[int] = (-2, -1),
    norm: str | None = None,
    *,
    manager: DistributedManager | None = None,
    group: Any = None,
    spec: Spec = None,
    out_spec: Spec | BlockSpec = None,
    shard_dim: int = -2,
) -> torch.Tensor:
    """``torch.fft.irfft2`` back to bands: ``X`` (..., H, K_r) spectral layout (``spec``: how
    the K modes are cut) -> (..., H'_r, W') with ``W' = s[1]`` or ``2 (K - 1)``, rows cut by
    ``out_spec`` (default: the manager's policy on H'). On blocks: back to (..., H'_r, W'_c),
    ``out_spec`` a BlockSpec (default ``manager.block_spec``), one more all-to-all along the
    longitude row last. Collective over ``group`` (on blocks: the domain group)."""
    return _inverse2(X, s, dim, norm, True, manager, group, spec, out_spec, shard_dim)


def fft2(
    x: torch.Tensor,
    s: Sequence[int] | None = None,
    dim: Sequence[int] = (-2, -1),
    norm: str | None = None,
    *,
    manager: DistributedManager | None = None,
    group: Any = None,
    spec: Spec | BlockSpec = None,
    out_spec: Spec = None,
    shard_dim: int = -2,
) -> torch.Tensor:
    """``torch.fft.fft2`` (real or complex input) of the banded field: (..., H_r, W) ->
    (..., H', W'_r), the W' modes of the other transformed dim cut by ``out_spec`` (default:
    the manager's policy). Collective over ``group``."""
    return _forward2(x, s, dim, norm, False, manager, group, spec, out_spec, shard_dim)


def ifft2(
    X: torch.Tensor,
    s: Sequence[int] | None = None,
    dim: Sequence[int] = (-2, -1),
    norm: str | None = None,
    *,
    manager: DistributedManager | None = None,
    group: Any = None,
    spec: Spec = None,
    out_spec: Spec | BlockSpec = None,
    shard_dim: int = -2,
) -> torch.Tensor:
    """``torch.fft.ifft2`` from the spectral layout of :func:`fft2` back to complex bands.
    Collective over ``group``."""
    return _inverse2(X, s, dim, norm, False, manager, group, spec, out_spec, shard_dim)


# -- 2-D real transforms of a field cut along the halved dim ------------------------------------
#
# The other layout (PhysicsNeMo's): the real field is cut along ``dim[1]``, the dim that rfft2
# halves, and the spectrum comes out cut along ``dim[0]`` with the halved dim whole. Still one
# all-to-all per transform; the halving happens after it, where the halved dim is local.


def _half_spectrum(X: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """The first ``n // 2 + 1`` modes of ``X`` along ``d``, each weighted as ``irfft`` counts it
    (twice, but once for mode 0 and, ``n`` even, mode ``n / 2``): the real part of their complex
    ``ifft`` (zero-padded to ``n``) is ``irfft(X, n)`` for any ``X``, Hermitian or not, and so is
    its gradient."""
    k = min(X.size(d), n // 2 + 1)
    w = torch.full((k,), 2.0, dtype=X.real.dtype, device=X.device)
    w[0] = 1.0
    if n % 2 == 0 and n // 2 < k:
        w[n // 2] = 1.0
    shape = [1] * X.dim()
    shape[d] = k
    return X.narrow(d, 0, k) * w.view(shape)


def rfft2_halved_cut(
    x: torch.Tensor,
    s: Sequence[int] | None = None,
    dim: Sequence[int] = (-2, -1),
    norm: str | None = None,
    *,
    manager: DistributedManager | None = None,
    group: Any = None,
    spec: Spec = None,
    out_spec: Spec = None,
) -> torch.Tensor:
    """``torch.fft.rfft2`` of a real field cut along the halved dim ``dim[1]`` (``spec``: its
    partition, learned when left out). Out: the spectrum cut along ``dim[0]`` (by ``out_spec``,
    default the manager's policy on ``s[0]``), the ``s[1] // 2 + 1`` modes of ``dim[1]`` whole.
    A full FFT along ``dim[0]``, one all-to-all, a full FFT along ``dim[1]`` and the first half
    of its modes kept. Collective over ``group``."""
    _bands_only(manager, group, "rfft2_halved_cut")
    a, b, _ = two_dims(x, dim, dim[1])
    m, t = context(x, manager, group)
    cols = input_spec(x, b, t, spec)
    if t.size == 1:
        out = torch.fft.rfft2(x, s=s, dim=(a, b), norm=norm)
        return mark(out, ShardSpec((out.size(a),)), a, t)
    y = run_fft("fft", x, size_arg(s, 0), a, norm)
    rows = output_spec(m, t, y.size(a), out_spec)
    y = transpose(y, t, rows, a, cols, b)
    y = run_fft("fft", y, size_arg(s, 1), b, norm)
    y = y.narrow(b, 0, y.size(b) // 2 + 1).contiguous()
    return mark(y, rows, a, t)


def irfft2_halved_cut(
    X: torch.Tensor,
    s: Sequence[int] | None = None,
    dim: Sequence[int] = (-2, -1),
    norm: str | None = None,
    *,
    manager: DistributedManager | None = None,
    group: Any = None,
    spec: Spec = None,
    out_spec: Spec = None,
) -> torch.Tensor:
    """``torch.fft.irfft2`` from the spectrum of :func:`rfft2_halved_cut` (cut along ``dim[0]``
    by ``spec``, the halved ``dim[1]`` whole) back to a real field cut along ``dim[1]``: ``W' =
    s[1]`` or ``2 (K - 1)`` columns cut by ``out_spec`` (default: the manager's policy).
    Collective over ``group``."""
    _bands_only(manager, group, "irfft2_halved_cut")
    a, b, _ = two_dims(X, dim, dim[0])
    m, t = context(X, manager, group)
    rows = input_spec(X, a, t, spec)
    if t.size == 1:
        return torch.fft.irfft2(X, s=s, dim=(a, b), norm=norm)
    n = size_arg(s, 1)
    n = n if n is not None else 2 * (X.size(b) - 1)
    y = run_fft("ifft", _half_spectrum(X, b, n), n, b, norm)
    cols = output_spec(m, t, n, out_spec)
    y = transpose(y, t, cols, b, rows, a)
    return run_fft("ifft", y, size_arg(s, 0), a, norm).real.contiguous()


# -- 1-D transforms along the sharded dim -----------------------------------------------------


def _other_dim(x: torch.Tensor, d: int) -> int:
    """The dim that carries the parallelism while ``d`` is gathered: the largest other one
    (the last of equals)."""
    others = [i for i in range(x.dim()) if i != d]
    return max(reversed(others), key=lambda i: x.size(i))


def _along(
    kind: str,
    x: torch.Tensor,
    n: int | None,
    dim: int,
    norm: str | None,
    manager: DistributedManager | None,
    group: Any,
    spec: Spec,
    out_spec: Spec,
    shard_dim: int,
) -> torch.Tensor:
    nd = x.dim()
    if not -nd <= dim < nd or not -nd <= shard_dim < nd:
        raise ConfigError(f"dim={dim}, shard_dim={shard_dim} out of range for {tuple(x.shape)}")
    d, sd = dim % nd, shard_dim % nd
    op = FFT_OPS[kind]
    _bands_only(manager, group, f"the 1-D {kind}")
    if d != sd:
        return op(x, n=n, dim=d, norm=norm)
    m, t = context(x, manager, group)
    rows = input_spec(x, d, t, spec)
    if t.size == 1:
        return op(x, n=n, dim=d, norm=norm)
    squeeze = nd == 1
    if squeeze:  # a 1-D field: a dim of one carries the exchange
        x, d = x.unsqueeze(0), 1
    o = _other_dim(x, d)
    across = policy(m, x.size(o), t.size)
    y = transpose(x, t, across, o, rows, d)
    y = run_fft(kind, y, n, d, norm)
    out_rows = output_spec(m, t, y.size(d), out_spec)
    y = transpose(y, t, out_rows, d, across, o)
    return y.squeeze(0) if squeeze else y


def _one_d(kind: str, doc: str) -> Any:
    def transform(
        x: torch.Tensor,
        n: int | None = None,
        dim: int = -1,
        norm: str | None = None,
        *,
        manager: DistributedManager | None = None,
        group: Any = None,
        spec: Spec = None,
        out_spec: Spec = None,
        shard_dim: int = -2,
    ) -> torch.Tensor:
        return _along(kind, x, n, dim, norm, manager, group, spec, out_spec, shard_dim)

    transform.__name__ = transform.__qualname__ = kind
    transform.__doc__ = (
        f"``torch.fft.{kind}`` along ``dim``. {doc} Along a local dim (``dim`` is not "
        f"``shard_dim``) it is torch's; along the sharded dim the bands are transposed onto "
        f"another dim, transformed whole and transposed back, so the output is cut along "
        f"``dim`` again (by ``out_spec``, default the manager's policy): two all-to-alls. "
        f"Collective over ``group`` then."
    )
    return transform


rfft = _one_d("rfft", "Real input, ``n // 2 + 1`` modes out.")
irfft = _one_d("irfft", "Modes in, ``n`` (default ``2 (K - 1)``) real values out.")
fft = _one_d("fft", "Real or complex input.")
ifft = _one_d("ifft", "Complex output.")


# -- PhysicsNeMo's call shape -----------------------------------------------------------------


class DistributedRFFT2:
    """PhysicsNeMo's ``DistributedRFFT2.apply(x, s, dim, norm="ortho")`` over mpidp's layouts:
    the exact ``torch.fft.rfft2(x, s, dim, norm)`` of the banded field, in the spectral layout of
    :func:`rfft2`. Unlike PhysicsNeMo's, the input is split along ``dim[0]`` (the rows) and the
    halved ``dim[1]`` is local, any size splits over any rank count, and the gradient is
    torch's (docs/migration.md)."""

    @staticmethod
    def apply(
        x: torch.Tensor,
        s: Sequence[int] | None = None,
        dim: Sequence[int] = (-2, -1),
        norm: str = "ortho",
        *,
        manager: DistributedManager | None = None,
        group: Any = None,
    ) -> torch.Tensor:
        return rfft2(x, s=s, dim=dim, norm=norm, manager=manager, group=group)


class DistributedIRFFT2:
    """PhysicsNeMo's ``DistributedIRFFT2.apply(x, s, dim, norm="ortho")`` over mpidp's layouts:
    the exact ``torch.fft.irfft2`` from the spectral layout of :func:`rfft2` back to bands."""

    @staticmethod
    def apply(
        x: torch.Tensor,
        s: Sequence[int] | None = None,
        dim: Sequence[int] = (-2, -1),
        norm: str = "ortho",
        *,
        manager: DistributedManager | None = None,
        group: Any = None,
    ) -> torch.Tensor:
        return irfft2(x, s=s, dim=dim, norm=norm, manager=manager, group=group)
