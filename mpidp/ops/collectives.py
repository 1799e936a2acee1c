"""Differentiable collectives: one autograd.Function per primitive, backward = its adjoint.

Every backward ``.apply``-s the partner Function, so double backward works too. Two kinds of
downstream decide which adjoint is right:

* **partial**: each rank's result feeds a different computation and the global loss is the sum
  over ranks of what each rank computes. The backward must add the contributions of every rank
  (``all_gather_v`` -> ``reduce_scatter_v``, ``all_reduce`` -> ``all_reduce``).
* **replicated**: every rank computes the same thing from the same result (the loss counted
  once). The backward takes this rank's part only (``all_gather_v_replicated`` -> slice,
  ``reduce_from`` -> identity).

``group`` accepts what the manager exposes: None (the default manager's domain group),
``"domain"``, ``"dp"``, ``"world"``, ``manager.domain_group`` / ``manager.data_parallel_group``,
a :class:`~mpidp.DistributedManager` (its domain group) or a :class:`~mpidp.comm.Transport`.
On a grid of blocks (``P_lon > 1``) the v-collectives, which cut or join along one dim, refuse
the domain group when it is only implied (None or a manager): a :class:`~mpidp.ConfigError` on
every rank, since the ranks are no bands; pass the group, e.g. ``manager.transport("lat")``.
The reductions (``all_reduce``, ``reduce_from``, ``copy_to``) are the same on bands and blocks.
The transport follows the manager's rule: MPI for CPU tensors when MPI runs the job,
torch.distributed otherwise.

``sizes`` are the shard sizes along ``dim``, one per rank of the group: a list or a
:class:`~mpidp.ShardSpec`. Every function here is collective over its group: every rank calls
it, in the same order, and (when gradients flow) every rank runs its backward.

Debug check: pass ``debug=True``, or set ``MPIDP_DEBUG=1`` in every rank's environment, and
each call first all-gathers the arguments every rank passed and raises the same
:class:`~mpidp.CommError` on every rank when they disagree, instead of a hang or garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.errors import CommError, ConfigError
from mpidp.ops.collectives_kept import keep, kept_call
from mpidp.ops.functions import (
    _LOW_PRECISION,
    Sizes,
    _AllGatherV,
    _AllGatherVReplicated,
    _AllReduce,
    _AllToAllV,
    _call,
    _check_agreement,
    _CopyTo,
    _extent_problem,
    _GatherV,
    _ndim_dim,
    _ReduceFrom,
    _ReduceScatterV,
    _ScatterV,
    _shape_facts,
    band_transport,
    debug_enabled,
    resolve_transport,
)
from mpidp.runtime.partition import ShardSpec, as_sizes

__all__ = [
    "all_gather_v",
    "all_gather_v_replicated",
    "all_reduce",
    "all_to_all_v",
    "copy_to",
    "debug_enabled",
    "gather_v",
    "indexed_all_to_all_v",
    "reduce_from",
    "reduce_scatter_v",
    "repartition",
    "resolve_transport",
    "scatter_v",
]


# -- public API -------------------------------------------------------------------------------


def all_gather_v(
    tensor: torch.Tensor,
    sizes: Sizes,
    dim: int = 0,
    group: Any = None,
    *,
    debug: bool | None = None,
) -> torch.Tensor:
    """Concatenate every rank's part along ``dim``; every rank gets the whole tensor.

    **Partial downstream**: use it when each rank computes something different from the
    result (the loss is the sum over ranks). The backward sums every rank's gradient for this
    rank's part (reduce_scatter_v). When every rank computes the same thing from the result,
    use :func:`all_gather_v_replicated`, or the gradient comes out ``P`` times too large.

    Collective over ``group``.
    """
    key, out = kept_call(_AllGatherV, tensor, sizes, dim, group, debug)
    if out is not None:  # a call of this key ran before: what it resolved and checked served
        return out
    return _gather_to_all(_AllGatherV, "all_gather_v", tensor, sizes, dim, group, debug, key)


def all_gather_v_replicated(
    tensor: torch.Tensor,
    sizes: Sizes,
    dim: int = 0,
    group: Any = None,
    *,
    debug: bool | None = None,
) -> torch.Tensor:
    """Concatenate every rank's part along ``dim`` for a **replicated downstream**.

    Every rank must compute the same thing from the result (the same loss, counted once), so
    every rank's gradient is the same and the backward keeps this rank's slice of it, with no
    communication. This is the adjoint partner of :func:`shard_tensor`.

    Collective over ``group``.
    """
    key, out = kept_call(_AllGatherVReplicated, tensor, sizes, dim, group, debug)
    if out is not None:
        return out
    return _gather_to_all(
        _AllGatherVReplicated, "all_gather_v_replicated", tensor, sizes, dim, group, debug, key
    )


def _gather_to_all(
    fn: type[torch.autograd.Function],
    name: str,
    tensor: torch.Tensor,
    sizes: Sizes,
    dim: int,
    group: Any,
    debug: bool | None,
    key: tuple[Any, ...] | None,
) -> torch.Tensor:
    """The full path of a gather whose call ``key`` (None: not to be kept) no kept call served:
    resolve, check, run, and keep what it resolved."""
    t = band_transport(group, tensor.device, name)
    sz = as_sizes(sizes)
    if debug_enabled(debug):
        _check_agreement(
            t,
            name,
            {"sizes": sz, **_shape_facts(tensor, dim)},
            _extent_problem(tensor, dim, _at(sz, t), "sizes[rank]"),
        )
    d = dim % max(tensor.dim(), 1)
    out = _call(fn, tensor, t, sz, d)
    if key is not None:
        keep(key, tensor, group, t, sz, d)
    return out


def reduce_scatter_v(
    tensor: torch.Tensor,
    sizes: Sizes,
    dim: int = 0,
    group: Any = None,
    op: str = "sum",
    *,
    debug: bool | None = None,
) -> torch.Tensor:
    """Element-wise ``sum`` (or ``avg``) of every rank's whole tensor; rank i keeps part i along
    ``dim``. float16/bfloat16 accumulate in float32.

    Every rank's input is its own partial contribution; the result is sharded. The backward
    all-gathers the gradient (the adjoint of the sum is a copy to every rank).

    Collective over ``group``.
    """
    if op not in ("sum", "avg"):
        raise NotImplementedError(f"reduce_scatter_v with op={op!r} has no adjoint; use sum/avg")
    t = band_transport(group, tensor.device, "reduce_scatter_v")
    sz = as_sizes(sizes)
    if debug_enabled(debug):
        _check_agreement(
            t,
            "reduce_scatter_v",
            {"sizes": sz, "op": op, "shape": tuple(tensor.shape), "dtype": str(tensor.dtype)},
            _extent_problem(tensor, dim, sum(sz), "sum(sizes)"),
        )
    return _call(_ReduceScatterV, tensor, t, sz, dim % max(tensor.dim(), 1), op)


def scatter_v(
    tensor: torch.Tensor | None,
    sizes: Sizes,
    dim: int = 0,
    src: int = 0,
    group: Any = None,
    *,
    debug: bool | None = None,
) -> torch.Tensor:
    """Split ``src``'s tensor along ``dim`` by ``sizes``: rank i gets part i.

    Ranks other than ``src`` may pass None or any tensor; its values are ignored (shape, dtype,
    ``dim`` and whether gradients flow all come from ``src`` in one small broadcast) and its
    gradient is None. A tensor that requires grad there keeps that rank's autograd graph shaped
    like ``src``'s, which keeps the order of collectives in the backward the same on every rank.
    The downstream of each part is this rank's own (sharded); the backward gathers the
    gradients to ``src``, and every rank must run it when ``src``'s tensor requires grad.

    Collective over ``group``.
    """
    device = tensor.device if tensor is not None else None
    t = band_transport(group, device, "scatter_v")
    sz = as_sizes(sizes)
    src_tensor = tensor if t.rank == src else None
    problems = []
    if t.rank == src:
        problems = (
            ["src passed None"]
            if tensor is None
            else _extent_problem(tensor, dim, sum(sz), "sum(sizes)")
        )
    if debug_enabled(debug):
        _check_agreement(t, "scatter_v", {"sizes": sz, "src": src}, problems)
    if not 0 <= src < t.size:
        raise CommError(f"{t._where()}: src {src} is not a rank of this group; use 0..{t.size - 1}")
    # The source's own checks travel in the broadcast every rank takes part in (a string in
    # place of the facts), so a bad tensor on the source raises on every rank at once instead
    # of leaving the others waiting in the scatter.
    meta: Any = f"{t._where()}: scatter_v src {src} passed None; the src rank must pass the tensor"
    if src_tensor is not None:
        d = _ndim_dim(src_tensor, dim)
        if d is None:
            meta = (
                f"{t._where()}: dim {dim} is out of range for the src tensor of shape "
                f"{tuple(src_tensor.shape)}; pass a dim of that tensor"
            )
        elif src_tensor.size(d) != sum(sz):
            meta = (
                f"{t._where()}: scatter_v src tensor of shape {tuple(src_tensor.shape)} has "
                f"{src_tensor.size(d)} entries along dim {d} but sum(sizes) = {sum(sz)} "
                f"(sizes {sz}); pass the sizes of the partition this tensor belongs to"
            )
        else:
            meta = (tuple(src_tensor.shape), src_tensor.dtype, d, _grad_flows(src_tensor))
    if t.size > 1:
        meta = t.broadcast_object(meta, src)
    if isinstance(meta, str):
        raise CommError(meta if t.rank == src else f"{t._where()}: from {meta}")
    shape, dtype, d, grad = meta
    anchor = None
    if grad and src_tensor is None and torch.is_grad_enabled():
        # Join the graph where the caller's own (ignored) tensor is, so that this rank's graph
        # has the same shape as src's and autograd runs its collectives in the same order.
        use = tensor is not None and tensor.requires_grad
        anchor = tensor if use else torch.empty(0, requires_grad=True)
    return _call(_ScatterV, src_tensor, anchor, t, sz, d, src, shape, dtype)


def gather_v(
    tensor: torch.Tensor,
    sizes: Sizes,
    dim: int = 0,
    dst: int = 0,
    group: Any = None,
    *,
    debug: bool | None = None,
) -> torch.Tensor:
    """Concatenate every rank's part along ``dim`` on rank ``dst``.

    Ranks other than ``dst`` get an **empty tensor** (extent 0 along ``dim``, never None) so
    that every rank's result stays in the autograd graph. The backward scatters ``dst``'s
    gradient back (the downstream lives on ``dst`` alone): every rank must backpropagate
    through its result, e.g. ``loss = f(out) if rank == dst else out.sum()``.

    Collective over ``group``.
    """
    t = band_transport(group, tensor.device, "gather_v")
    sz = as_sizes(sizes)
    if debug_enabled(debug):
        _check_agreement(
            t,
            "gather_v",
            {"sizes": sz, "dst": dst, **_shape_facts(tensor, dim)},
            _extent_problem(tensor, dim, _at(sz, t), "sizes[rank]"),
        )
    return _call(_GatherV, tensor, t, sz, dim % max(tensor.dim(), 1), dst)


def all_to_all_v(
    tensor: torch.Tensor,
    split_sizes: Sizes,
    cat_sizes: Sizes,
    split_dim: int = 0,
    cat_dim: int | None = None,
    group: Any = None,
    *,
    debug: bool | None = None,
) -> torch.Tensor:
    """Send part j of ``tensor`` (split along ``split_dim`` by ``split_sizes``) to rank j, and
    concatenate the parts received from ranks 0..P-1 along ``cat_dim`` (default: the same dim);
    the part from rank i has ``cat_sizes[i]`` entries along ``cat_dim``.

    With two different dims and both sizes partitions of their dims, this is the distributed
    transpose: a tensor sharded along ``cat_dim`` (this rank holds ``cat_sizes[rank]``) becomes
    sharded along ``split_dim`` (this rank gets ``split_sizes[rank]``). With one dim it is the
    plain all-to-all: ``split_sizes`` are the rows sent to each rank, ``cat_sizes`` the rows
    received from each. Sharded in, sharded out; the backward is the reverse exchange.

    Collective over ``group``.
    """
    t = band_transport(group, tensor.device, "all_to_all_v")
    ss, cs = as_sizes(split_sizes), as_sizes(cat_sizes)
    sd = _ndim_dim(tensor, split_dim)
    cd = sd if cat_dim is None else _ndim_dim(tensor, cat_dim)
    problems = _extent_problem(tensor, split_dim, sum(ss), "sum(split_sizes)")
    transpose = cd is not None and sd is not None and cd != sd
    if transpose:
        problems += _extent_problem(tensor, cd, _at(cs, t), "cat_sizes[rank]")  # type: ignore[arg-type]
    same: dict[str, Any] = {"split_dim": sd, "cat_dim": cd, "ndim": tensor.dim()}
    if transpose:
        same.update(split_sizes=ss, cat_sizes=cs, dtype=str(tensor.dtype))
    if debug_enabled(debug):
        if not transpose and t.size > 1:  # rank i's sends to j must be j's receives from i
            pairs = t.all_gather_object((ss, cs))
            problems += [
                f"sends {ss[j]} rows to rank {j}, which expects {pairs[j][1][t.rank]}"
                for j in range(min(t.size, len(ss)))
                if len(pairs[j][1]) == t.size and pairs[j][1][t.rank] != ss[j]
            ]
        _check_agreement(t, "all_to_all_v", same, problems)
    if sd is None or cd is None:
        raise CommError(
            f"{t._where()}: dims ({split_dim}, {cat_dim}) out of range for shape "
            f"{tuple(tensor.shape)}"
        )
    if transpose:
        t._sizes(ss, "split_sizes")
        t._sizes(cs, "cat_sizes")
        t._local(tensor, sd, sum(ss), "sum(split_sizes)")
        t._local(tensor, cd, cs[t.rank], f"cat_sizes[{t.rank}]")
    return _call(_AllToAllV, tensor, t, ss, cs, sd, cd)


def indexed_all_to_all_v(
    tensor: torch.Tensor,
    indices: Sequence[torch.Tensor],
    sizes: Sequence[Sequence[int]] | None = None,
    dim: int = 0,
    group: Any = None,
    *,
    debug: bool | None = None,
) -> torch.Tensor:
    """Send the entries ``indices[j]`` of ``tensor`` along ``dim`` to rank j; concatenate what
    arrives, in rank order. Indices may repeat.

    ``sizes[i][j]`` is how many entries rank i sends to rank j (the same matrix on every rank);
    when None it is learned with one small all-gather. The backward sends the gradients back
    and adds them at their indices (float16/bfloat16 accumulate in float32).

    Collective over ``group``.
    """
    t = band_transport(group, tensor.device, "indexed_all_to_all_v")
    if len(indices) != t.size:
        raise CommError(
            f"{t._where()}: expecting {t.size} index tensors, one per rank, got {len(indices)}"
        )
    counts = [int(i.numel()) for i in indices]
    if sizes is None:
        matrix = [list(row) for row in t.all_gather_object(counts)]
    else:
        matrix = [[int(v) for v in row] for row in sizes]
        if len(matrix) != t.size or any(len(row) != t.size for row in matrix):
            raise CommError(f"{t._where()}: sizes must be a {t.size} x {t.size} matrix")
    problems = []
    if matrix[t.rank] != counts:
        problems.append(f"index counts {counts} but sizes[{t.rank}] = {matrix[t.rank]}")
    if debug_enabled(debug):
        _check_agreement(t, "indexed_all_to_all_v", {"sizes": matrix}, problems)
    if problems:
        raise CommError(f"{t._where()}: " + "; ".join(problems))
    d = dim % max(tensor.dim(), 1)
    idx = torch.cat([i.reshape(-1).to(device=tensor.device, dtype=torch.long) for i in indices])
    work = tensor.to(torch.float32) if tensor.dtype in _LOW_PRECISION else tensor
    picked = work.index_select(d, idx)
    recv = [matrix[i][t.rank] for i in range(t.size)]
    out = _call(_AllToAllV, picked, t, counts, recv, d, d)
    return out.to(tensor.dtype) if work is not tensor else out


def repartition(
    tensor: torch.Tensor,
    sizes: Sizes,
    new_sizes: Sizes,
    dim: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """The same global tensor, cut along ``dim`` by ``new_sizes`` instead of ``sizes`` (both
    partitions of one length): only the rows that change owner travel (boundary rows when the
    two cuts are close), in one all-to-all; a rank whose rows stay keeps them without a copy
    through the transport. Sharded in, sharded out; the backward is the reverse move.

    Collective over ``group`` (every rank calls it, even when nothing moves on it)."""
    t = band_transport(group, tensor.device, "repartition")
    old, new = ShardSpec.from_sizes(as_sizes(sizes)), ShardSpec.from_sizes(as_sizes(new_sizes))
    if old.total != new.total or old.parts != t.size or new.parts != t.size:
        raise CommError(
            f"{t._where()}: repartition from {old} to {new}: both must cut one length over "
            f"the group's {t.size} ranks"
        )
    t._local(tensor, dim % max(tensor.dim(), 1), old[t.rank], f"sizes[{t.rank}]")
    if old == new:
        return tensor
    me = t.rank
    send = [0] * t.size
    for rank, lo, hi in new.overlaps(old.start(me), old.stop(me)):
        send[rank] = hi - lo
    recv = [0] * t.size
    for rank, lo, hi in old.overlaps(new.start(me), new.stop(me)):
        recv[rank] = hi - lo
    return all_to_all_v(tensor, send, recv, dim, group=t)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """Element-wise reduction over ``group``; a new tensor (the input is untouched).

    Differentiable for ``sum`` and ``avg`` with a **partial downstream**: the backward
    all-reduces the gradients the same way. For a sum whose result every rank uses the same way
    (replicated downstream) use :func:`reduce_from`. ``max``/``min``/``prod`` are forward-only.

    Collective over ``group``.
    """
    t = resolve_transport(group, tensor.device)
    if op in ("sum", "avg"):
        return _call(_AllReduce, tensor, t, op)
    if _grad_flows(tensor):
        raise NotImplementedError(
            f"all_reduce with op={op!r} is not differentiable; use sum or avg, or detach"
        )
    return t.all_reduce(tensor, op)


def copy_to(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Identity forward, all-reduce (sum) backward: a replicated value entering a region where
    every rank uses it differently (Megatron's *f*). Collective over ``group`` in backward."""
    return _call(_CopyTo, tensor, resolve_transport(group, tensor.device))


def reduce_from(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward: partial results summed into a value every
    rank then uses the same way (Megatron's *g*). Collective over ``group``."""
    return _call(_ReduceFrom, tensor, resolve_transport(group, tensor.device))


def _at(sizes: list[int], t: Transport) -> int:
    return sizes[t.rank] if t.rank < len(sizes) else -1


def _grad_flows(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def fetch_global_rows(
    local: torch.Tensor,
    spec: ShardSpec,
    dim: int,
    wanted: Sequence[Sequence[tuple[int, int]]],
    group: Any = None,
) -> torch.Tensor:
    """Rows of a field cut by ``spec`` along ``dim`` (this rank holds ``local``), wherever
    they live: this rank gets ``wanted[rank]`` (``[lo, hi)`` runs of global rows, in that
    order), concatenated. ``wanted`` is every rank's request and must be the same on every
    rank (each rank computes it from the spec), so one ``all_to_all_v`` moves exactly the
    rows asked for, and none when every rank asks for its own. The backward is the reverse
    exchange and an index-add. Collective over ``group``."""
    t = band_transport(group, local.device, "fetch_global_rows")
    me, p = t.rank, t.size
    bad = [(q, a, b) for q in range(p) for a, b in wanted[q] if not 0 <= a <= b <= spec.total]
    if bad:
        raise ConfigError(
            f"rank {me}: internal error: rows {bad[:4]} asked of a field of {spec.total} rows "
            f"along dim {dim}"
        )
    if all(list(wanted[q]) == [(spec.start(q), spec.stop(q))] for q in range(p)):
        return local
    lo, hi = spec.start(me), spec.stop(me)
    send_idx: list[int] = []
    send_counts = []
    for q in range(p):
        count = 0
        for a, b in wanted[q]:
            s, e = max(a, lo), min(b, hi)
            if e > s:
                send_idx.extend(range(s - lo, e - lo))
                count += e - s
        send_counts.append(count)
    # where each received row goes: the rows from rank r arrive in my order of asking
    recv_counts = [0] * p
    places: list[list[int]] = [[] for _ in range(p)]
    at = 0
    for a, b in wanted[me]:
        for r, s, e in spec.overlaps(a, b):
            places[r].extend(range(at + s - a, at + e - a))
            recv_counts[r] += e - s
        at += b - a
    device = local.device
    send = local.index_select(dim, torch.tensor(send_idx, dtype=torch.long, device=device))
    got = all_to_all_v(send, send_counts, recv_counts, dim, group=t)
    order = [i for block in places for i in block]  # position of each received row
    if order == list(range(len(order))):
        return got
    inverse = [0] * len(order)
    for k, i in enumerate(order):
        inverse[i] = k
    return got.index_select(dim, torch.tensor(inverse, dtype=torch.long, device=device))
