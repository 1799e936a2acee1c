"""The autograd Functions behind :mod:`mpidp.ops.collectives`, one per primitive, each backward
``.apply``-ing its partner (so double backward works), and their plumbing: the transport a
group names, the debug agreement of arguments, the checks of extents."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mpidp.comm import Transport
from mpidp.errors import CommError
from mpidp.runtime.grid import blocks_refused
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized
from mpidp.runtime.partition import ShardSpec

Sizes = Sequence[int] | ShardSpec

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# -- plumbing ---------------------------------------------------------------------------------


def resolve_transport(group: Any = None, device: torch.device | str | None = None) -> Transport:
    """The transport for tensors on ``device`` over ``group`` (see the module docstring)."""
    if isinstance(group, Transport):
        return group
    if isinstance(group, DistributedManager):
        return group.transport(None, device)
    if isinstance(group, (dist.ProcessGroup, DeviceMesh)) and not _knows(group):
        from mpidp.runtime.adopt import manager_for  # a group mpidp did not build

        return manager_for(group).transport(None, device)
    return get_manager().transport(group, device)


def band_transport(group: Any, device: torch.device | str | None, op: str) -> Transport:
    """:func:`resolve_transport` for a primitive that cuts or joins along one dim (``op``):
    ``group`` None or a manager names the domain group, whose ranks are bands only while the
    grid does not cut the longitude; on blocks it raises :func:`blocks_refused` (a group
    passed explicitly, such as an axis transport of the grid, is used as it is)."""
    if group is None or isinstance(group, DistributedManager):  # (not an ABC: no Python call)
        m = get_manager() if group is None else group
        if m._blocks:
            raise blocks_refused(m, f"{op} over the domain group")
        return m.transport(None, device)
    if isinstance(group, Transport):
        return group
    return resolve_transport(group, device)


def _knows(group: Any) -> bool:
    """Whether the default manager has ``group`` (its domain, dp or world group)."""
    if not is_initialized():
        return False
    m = get_manager()
    return group is dist.group.WORLD or group in (m.domain_group, m.data_parallel_group)


def debug_enabled(debug: bool | None = None) -> bool:
    """``debug`` if given, else whether ``MPIDP_DEBUG`` is set to something other than 0."""
    if debug is not None:
        return debug
    return os.environ.get("MPIDP_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")


def _check_agreement(t: Transport, op: str, same: dict[str, Any], problems: list[str]) -> None:
    """Debug mode: compare ``same`` (must be equal everywhere) and collect every rank's local
    ``problems``; raise one message on every rank when anything is off. Collective."""
    if t.size == 1:
        return
    _, lines = t.agree(problems, same)
    if lines:
        raise CommError(
            f"rank {t.rank}: {op} called with inconsistent arguments over a group of {t.size} "
            f"ranks (debug check):\n  " + "\n  ".join(lines) + "\nfix: every rank must pass "
            "the same sizes, dim and root, and a tensor whose extent along dim is its own size"
        )


def _ndim_dim(tensor: torch.Tensor, dim: int) -> int | None:
    return dim % tensor.dim() if -tensor.dim() <= dim < max(tensor.dim(), 1) else None


def _shape_facts(tensor: torch.Tensor, dim: int) -> dict[str, Any]:
    d = _ndim_dim(tensor, dim)
    other = tuple(s for i, s in enumerate(tensor.shape) if i != d)
    return {"dim": d, "ndim": tensor.dim(), "dtype": str(tensor.dtype), "other dims": other}


def _extent_problem(tensor: torch.Tensor, dim: int, want: int, what: str) -> list[str]:
    d = _ndim_dim(tensor, dim)
    if d is None:
        return [f"dim {dim} out of range for shape {tuple(tensor.shape)}"]
    if tensor.size(d) != want:
        return [f"shape {tuple(tensor.shape)} has {tensor.size(d)} along dim {d}, {what}={want}"]
    return []


class _NoGradCtx:
    """Stands in for autograd's ctx when no gradient flows: one per call, dropped with what
    the forward stored in it (a plain instance: storing costs no Python call)."""


def _call(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, or its forward alone when no input needs a gradient: the same
    computation without autograd's bookkeeping (about 20 us a call)."""
    if torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    ):
        return fn.apply(*args)
    return fn.forward(_NoGradCtx(), *args)


def _fresh(out: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
    """A one-rank transport returns its input; a Function must not return an alias of it."""
    if source is not None and out.data_ptr() == source.data_ptr() and out.numel():
        return out.clone()
    return out


# -- autograd Functions -----------------------------------------------------------------------


class _AllGatherV(torch.autograd.Function):
    """Partial downstream: backward reduce-scatters (sums) every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: Transport, sizes: list[int], dim: int) -> Any:
        ctx.t, ctx.sizes, ctx.dim = t, sizes, dim
        return _fresh(t.all_gather_v(x, sizes, dim), x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _ReduceScatterV.apply(g, ctx.t, ctx.sizes, ctx.dim, "sum"), None, None, None


class _AllGatherVReplicated(_AllGatherV):
    """Replicated downstream: :class:`_AllGatherV`'s forward; backward keeps this rank's
    slice of the (equal) gradients."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _Shard.apply(g, ctx.t, ctx.sizes, ctx.dim), None, None, None


class _Shard(torch.autograd.Function):
    """This rank's slice of a replicated tensor (no communication); backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: Transport, sizes: list[int], dim: int) -> Any:
        ctx.t, ctx.sizes, ctx.dim = t, sizes, dim
        start = sum(sizes[: t.rank])
        return x.narrow(dim, start, sizes[t.rank]).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _AllGatherVReplicated.apply(g, ctx.t, ctx.sizes, ctx.dim), None, None, None


class _ReduceScatterV(torch.autograd.Function):
    """Sum (or average) of every rank's tensor, split by sizes; backward all-gathers."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, t: Transport, sizes: list[int], dim: int, op: str
    ) -> Any:
        ctx.t, ctx.sizes, ctx.dim, ctx.op = t, sizes, dim, op
        return _fresh(t.reduce_scatter_v(x, sizes, dim, op), x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        out = _AllGatherV.apply(g, ctx.t, ctx.sizes, ctx.dim)
        if ctx.op == "avg":
            out = out / ctx.t.size
        return out, None, None, None, None


class _ScatterV(torch.autograd.Function):
    """Split ``src``'s tensor over the group; backward gathers the gradient back to ``src``.

    ``anchor`` is an empty tensor that requires grad on ranks other than ``src`` when ``src``'s
    tensor does, so that their results join the graph and they take part in the backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor | None,
        anchor: torch.Tensor | None,
        t: Transport,
        sizes: list[int],
        dim: int,
        src: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> Any:
        ctx.t, ctx.sizes, ctx.dim, ctx.src = t, sizes, dim, src
        ctx.has_x = x is not None
        ctx.anchor_shape = anchor.shape if anchor is not None else None
        out = t.scatter_v(x if t.rank == src else None, sizes, dim, src, shape=shape, dtype=dtype)
        return _fresh(out, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        full = _GatherV.apply(g, ctx.t, ctx.sizes, ctx.dim, ctx.src)
        grad = full if ctx.t.rank == ctx.src and ctx.has_x else None
        anchor = None
        if ctx.anchor_shape is not None:  # zero, but in the graph: a double backward must
            anchor = (full.sum() * 0).expand(ctx.anchor_shape)  # reach this rank's gather too
        return grad, anchor, None, None, None, None, None, None


class _GatherV(torch.autograd.Function):
    """Concatenate on ``dst`` (others get an empty tensor); backward scatters from ``dst``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, t: Transport, sizes: list[int], dim: int, dst: int
    ) -> Any:
        ctx.t, ctx.sizes, ctx.dim, ctx.dst = t, sizes, dim, dst
        ctx.full = tuple(sum(sizes) if i == dim else s for i, s in enumerate(x.shape))
        out = t.gather_v(x, sizes, dim, dst)
        if out is None:
            empty = tuple(0 if i == dim else s for i, s in enumerate(x.shape))
            return x.new_empty(empty)
        return _fresh(out, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        t = ctx.t
        mine, anchor = (g, None) if t.rank == ctx.dst else (None, g)
        # The other ranks' (empty) gradient anchors their part in the graph, so a double
        # backward reaches them too and they take part in its gather.
        part = _ScatterV.apply(mine, anchor, t, ctx.sizes, ctx.dim, ctx.dst, ctx.full, g.dtype)
        return part, None, None, None, None


class _AllToAllV(torch.autograd.Function):
    """Split along one dim, concatenate along another; backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        t: Transport,
        split_sizes: list[int],
        cat_sizes: list[int],
        split_dim: int,
        cat_dim: int,
    ) -> Any:
        ctx.args = (t, split_sizes, cat_sizes, split_dim, cat_dim)
        return _fresh(_exchange_transpose(x, t, split_sizes, cat_sizes, split_dim, cat_dim), x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        t, split_sizes, cat_sizes, split_dim, cat_dim = ctx.args
        out = _AllToAllV.apply(g, t, cat_sizes, split_sizes, cat_dim, split_dim)
        return out, None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    """Partial downstream: backward all-reduces the gradients the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: Transport, op: str) -> Any:
        ctx.t, ctx.op = t, op
        return t.all_reduce(x, op)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _AllReduce.apply(g, ctx.t, ctx.op), None, None


class _CopyTo(torch.autograd.Function):
    """Identity forward into a region whose ranks use the value differently; backward sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: Transport) -> Any:
        ctx.t = t
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _ReduceFrom.apply(g, ctx.t), None


class _ReduceFrom(torch.autograd.Function):
    """Sum of partial results into a replicated value; backward passes the gradient through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: Transport) -> Any:
        ctx.t = t
        return t.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _CopyTo.apply(g, ctx.t), None


def _exchange_transpose(
    x: torch.Tensor,
    t: Transport,
    split_sizes: list[int],
    cat_sizes: list[int],
    split_dim: int,
    cat_dim: int,
) -> torch.Tensor:
    """Send part j of ``x`` along ``split_dim`` to rank j; concatenate what rank i sends along
    ``cat_dim`` (``cat_sizes[i]`` entries each)."""
    if split_dim == cat_dim:
        return t.all_to_all_v(x, split_sizes, cat_sizes, split_dim)
    if t.size == 1:
        return x.detach()
    # Two copies, both in x's own dim order (runs of contiguous memory, no full transpose):
    # every part is packed into one flat send buffer, and every received piece, viewed in its
    # sender's shape, is written into its rows of the output.
    x = x.detach()
    mine = split_sizes[t.rank]
    per_split = _numel_without(x.shape, split_dim)
    send = [n * per_split for n in split_sizes]
    # scratch: the MPI transport's reused buffers (a fresh 100 MB tensor costs more in page
    # faults than the copy into it on this kind of machine)
    buf = t.scratch((sum(send),), x.dtype, x.device)
    shape = list(x.shape)
    start = at = 0
    for n, count in zip(split_sizes, send, strict=True):
        if n:
            shape[split_dim] = n
            buf[at : at + count].view(shape).copy_(x.narrow(split_dim, start, n))
        start, at = start + n, at + count
    per_cat = _numel_without(x.shape, split_dim, cat_dim) * mine
    recv = [c * per_cat for c in cat_sizes]
    flat = t.all_to_all_v(buf, send, recv, 0)
    shape[split_dim], shape[cat_dim] = mine, sum(cat_sizes)
    out = t.scratch(tuple(shape), x.dtype, x.device)
    start = at = 0
    for c, count in zip(cat_sizes, recv, strict=True):
        if c:
            shape[cat_dim] = c
            out.narrow(cat_dim, start, c).copy_(flat[at : at + count].view(shape))
        start, at = start + c, at + count
    return out


def _numel_without(shape: torch.Size, *dims: int) -> int:
    n = 1
    for i, s in enumerate(shape):
        if i not in dims:
            n *= s
    return n
