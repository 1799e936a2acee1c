"""Handlers: ``torch.fft`` transforms that read across a cut dim, through the one distributed
FFT of :mod:`mpidp.ops.fft` (one implementation, two front ends). A transform over dims that are
not cut runs on each rank's part (the batch rule, :mod:`mpidp.sharded.batch`).

On bands: ``rfft2`` / ``fft2`` of a band cut along H gives its spectrum cut along the W modes
by the manager's policy, the inverse returns bands, and a 1-D transform along the sharded dim
leaves the result cut along that dim again.

On latitude x longitude blocks: ``rfft2`` / ``fft2`` (and ``rfftn`` / ``fftn`` over the same two
dims) of a block over its (latitude, longitude) dims gives the op's spectral layout: every H
frequency, the W modes cut over the whole domain group in domain rank order. That is a band of
the domain group on a grid that cuts the longitude, which no field is: it is marked
:attr:`~mpidp.ShardedTensor.spectral`, dispatch runs on it the band rules that read no field
(element-wise ops, slices, products, reductions: a spectral layer's mode truncation, complex
weights, zeroed modes), the layers refuse it, and ``irfft2`` / ``ifft2`` (``irfftn`` /
``ifftn``) of it returns blocks cut by the manager's policy. A 1-D transform along one cut dim
of a block is the band transform over that axis's group (the latitude column or the longitude
row; the other dims are its batch): a block again, that dim cut by the policy over the axis.
"""

from __future__ import annotations

from typing import Any

import torch

import mpidp.ops.fft as dfft
from mpidp.runtime.grid import AXES, BlockSpec, axis_transport
from mpidp.sharded.dispatch import refuse, register
from mpidp.sharded.layer_calls import bind_args, meta_result
from mpidp.sharded.rows import move_to_dim
from mpidp.sharded.tensor import ShardedTensor

__all__: list[str] = []

#: torch's 2-D transform -> (mpidp's, whether it is a forward one)
_FFT2 = {
    torch.fft.rfft2: (dfft.rfft2, True),
    torch.fft.fft2: (dfft.fft2, True),
    torch.fft.irfft2: (dfft.irfft2, False),
    torch.fft.ifft2: (dfft.ifft2, False),
}
#: torch's n-D transform -> its 2-D form (the one the n-D one is over two dims)
_FFTN = {
    torch.fft.rfftn: torch.fft.rfft2,
    torch.fft.fftn: torch.fft.fft2,
    torch.fft.irfftn: torch.fft.irfft2,
    torch.fft.ifftn: torch.fft.ifft2,
}
_FFT1 = {
    torch.fft.rfft: dfft.rfft,
    torch.fft.irfft: dfft.irfft,
    torch.fft.fft: dfft.fft,
    torch.fft.ifft: dfft.ifft,
}


@register(*_FFT2, grid=True)
def _fft2(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = bind_args(
        args, kwargs, ("input", "s", "dim", "norm"), {"s": None, "dim": (-2, -1), "norm": None}
    )
    x = a["input"]
    nd = x.dim()
    dims = [int(i) % nd for i in a["dim"]]
    fn, forward = _FFT2[func]
    if x.grid is not None:
        return _of_blocks(func, args, kwargs, dims)
    if not forward and x.spectral:
        return _to_blocks(func, args, kwargs, dims)
    if x.shard_dim not in dims:
        local = func(x.local, a["s"], a["dim"], a["norm"])
        return ShardedTensor(local, x.spec, x.shard_dim, x.manager)
    # the forward transforms want bands along dim[0]; the inverse the modes along dim[1]
    want = dims[0] if forward else dims[1]
    if x.shard_dim != want:
        x = move_to_dim(x, want)
    m = x.manager
    # a spectrum of blocks is a band of the domain group, never a block: its group is named
    group = x.transport if x.spectral else None
    y = fn(
        x.local,
        a["s"],
        a["dim"],
        a["norm"],
        manager=m,
        group=group,
        spec=x.spec,
        shard_dim=dims[0] - nd,
    )
    if forward:
        lay = dfft.layout(y)
        return ShardedTensor(y, lay.spec, y.dim() + lay.dim, m)
    n_out = meta_result(func, args, kwargs)[dims[0]]
    return ShardedTensor(y, m.partition.derived(n_out, m.domain_world_size), dims[0], m)


def _of_blocks(func: Any, args: Any, kwargs: Any, dims: list[int]) -> ShardedTensor:
    """A 2-D transform of a block over its (latitude, longitude) dims: the spectrum, every H
    frequency and the W modes cut over the domain group (marked spectral). An inverse of a
    block is refused: its input must be a spectrum in that layout."""
    a = bind_args(args, kwargs, ("input", "s", "dim", "norm"), {"s": None, "norm": None})
    x = a["input"]
    g = x.grid
    assert g is not None
    fn, forward = _FFT2[func]
    if not forward:
        raise refuse(
            func,
            args,
            kwargs,
            "an inverse transform of a block (a field cut into rows x columns): it takes the "
            "spectrum that torch.fft.rfft2 / fft2 of a block gives (its modes cut over the "
            "domain group)",
            "invert the spectrum of the forward transform, or gather (.full_tensor())",
        )
    if tuple(dims) != g.dims:
        raise refuse(
            func,
            args,
            kwargs,
            f"a 2-D transform over dims {tuple(dims)} of a block cut along dims {g.dims}",
            f"transform over the block's (latitude, longitude) dims in that order, dim={g.dims} "
            f"(permute the tensor first for another order)",
        )
    m = x.manager
    y = fn(x.local, a["s"], dims, a["norm"], manager=m, spec=g, shard_dim=dims[0] - x.dim())
    lay = dfft.layout(y)
    return ShardedTensor(y, lay.spec, y.dim() + lay.dim, m, spectral=True)


def _to_blocks(func: Any, args: Any, kwargs: Any, dims: list[int]) -> ShardedTensor:
    """The inverse 2-D transform of a spectrum of blocks: its modes cut along ``dims[1]`` over
    the domain group in, blocks of the manager's policy (``dims``: latitude, longitude) out."""
    a = bind_args(args, kwargs, ("input", "s", "dim", "norm"), {"s": None, "norm": None})
    x = a["input"]
    if x.shard_dim != dims[1]:
        x = move_to_dim(x, dims[1])
    m = x.manager
    out = m.block_spec(meta_result(func, args, kwargs), (dims[0], dims[1]))
    y = _FFT2[func][0](
        x.local,
        a["s"],
        dims,
        a["norm"],
        manager=m,
        spec=x.spec,
        out_spec=out,
        shard_dim=dims[0] - x.dim(),
    )
    return ShardedTensor(y, out.lat, dims[0], m, grid=out)


@register(*_FFTN, grid=True)
def _fftn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An n-D transform over two dims, among them a cut one: its 2-D form. Over more dims it
    is refused (the other dims' transforms are local: call them apart)."""
    a = bind_args(
        args, kwargs, ("input", "s", "dim", "norm"), {"s": None, "dim": None, "norm": None}
    )
    x, s, dim = a["input"], a["s"], a["dim"]
    nd = x.dim()
    if dim is not None:
        dims = [int(i) % nd for i in ([dim] if isinstance(dim, int) else dim)]
    else:  # torch's default: the last len(s) dims, or every dim
        dims = list(range(nd - len(s) if s is not None else 0, nd))
    if len(dims) != 2:
        raise refuse(
            func,
            args,
            kwargs,
            f"an n-D transform over the {len(dims)} dims {dims}, a cut one among them",
            "transform the two cut dims with torch.fft.rfft2 / fft2 (or their inverses) and "
            "the other dims with torch.fft.fftn, which is local on them",
        )
    two = _FFTN[func]
    return _fft2(two, (x, s, dims, a["norm"]), {})


@register(*_FFT1, grid=True)
def _fft1(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = bind_args(args, kwargs, ("input", "n", "dim", "norm"), {"n": None, "dim": -1, "norm": None})
    x = a["input"]
    d = int(a["dim"]) % x.dim()
    if x.grid is not None:
        return _along_axis(func, args, kwargs, d)
    if d != x.shard_dim:
        local = func(x.local, a["n"], d, a["norm"])
        return ShardedTensor(local, x.spec, x.shard_dim, x.manager)
    m = x.manager
    group = x.transport if x.spectral else None  # a spectrum of blocks: a band of the domain
    y = _FFT1[func](x.local, a["n"], d, a["norm"], manager=m, group=group, spec=x.spec, shard_dim=d)
    n_out = meta_result(func, args, kwargs)[d]
    return ShardedTensor(y, m.partition.derived(n_out, m.domain_world_size), d, m)


def _along_axis(func: Any, args: Any, kwargs: Any, d: int) -> ShardedTensor:
    """A 1-D transform along cut dim ``d`` of a block: the band transform over that axis's
    group (the block's other dims its batch); the result cut along ``d`` by the policy over the
    axis, the other cut dim as it was."""
    a = bind_args(args, kwargs, ("input", "n", "dim", "norm"), {"n": None, "norm": None})
    x = a["input"]
    g = x.grid
    assert g is not None and d in g.dims  # (a transform of neither cut dim: the batch rule)
    axis = g.dims.index(d)
    m = x.manager
    t = axis_transport(m, AXES[axis], x.local.device)
    cuts = [g.lat, g.lon]
    new = m.partition.derived(meta_result(func, args, kwargs)[d], t.size)
    y = _FFT1[func](
        x.local,
        a["n"],
        d,
        a["norm"],
        manager=m,
        group=t,
        spec=cuts[axis],
        out_spec=new,
        shard_dim=d,
    )
    cuts[axis] = new
    out = BlockSpec(cuts[0], cuts[1], g.dims)
    return ShardedTensor(y, out.lat, g.dims[0], m, grid=out)
