"""Handlers of calls with tokens of blocks: a ShardedTensor dim that holds this rank's block's
rows x columns flattened (:class:`~mpidp.sharded.block_layout.TokenSpec`; DESIGN.md, "Blocks").

A patch or cube embedding flattens a block's (..., h, w) into one token dim (``flatten(2)``,
``reshape(B, C, -1)``), and a window partition folds the window grid into the batch the same
way. Each rank then holds ``lead`` x h x w tokens, row-major within its block: not a run of the
global order (a band's tokens are one), so the rules on them are:

* ops that act per token run on the local tokens: the element-wise rule and the batch rule
  (:mod:`mpidp.sharded.pointwise`, :mod:`mpidp.sharded.batch`: a linear, a layer norm over the
  channels, a window's attention or product with the token dim in the batch), dim moves and
  reshapes of the other dims; a plain tensor holding every token (a (1, H W, C) position
  embedding) is cut to this rank's tokens by index (its gradient reaches those entries);
* a reduction over the token dim is the domain group's (the band rule: the tokens of all
  ranks are every token once);
* a reshape of the token dim into (..., H, W) gives the block again, into (..., L H W) (a
  batch split off or merged in) tokens with another ``lead``;
* attention with the tokens as the queries' rows (dim -2: one window over several blocks,
  ``q @ k.transpose(-2, -1)``, ``@ v``, their einsums; SDPA and ``nn.MultiheadAttention`` in
  :mod:`mpidp.sharded.tokens_attention`): the band rule, the keys and values gathered whole in
  the global order and each rank's queries against all of them; a bias or mask of the global
  (L, S) shape cut to the queries' tokens by their ids;
* anything else that mixes tokens in their global order or indexes them by position (the
  tokens contracted, a convolution over tokens, ``x[:, 5]``) is refused on every rank
  (:data:`mpidp.sharded.dispatch.TOKENS_MIX`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpidp.runtime.grid import BlockSpec
from mpidp.sharded import pointwise as _pointwise
from mpidp.sharded.block_layout import TokenSpec, whole_of
from mpidp.sharded.cuts import placed
from mpidp.sharded.dispatch import _GRID_OK, _HANDLERS, _TOKENS, key, refuse, register_grid
from mpidp.sharded.products import _expand_ellipsis
from mpidp.sharded.select import index_parts
from mpidp.sharded.shapes import _MOVES, _groups, _infer, _plain, _shape_arg, flattened, unflattened
from mpidp.sharded.tensor import ShardedTensor

__all__ = ["REDUCE", "block_to_tokens"]


def _tokens(x: ShardedTensor) -> TokenSpec:
    g = x.grid
    assert isinstance(g, TokenSpec)
    return g


def _made(x: ShardedTensor, local: torch.Tensor, g: TokenSpec | BlockSpec) -> ShardedTensor:
    spec = g.counts if isinstance(g, TokenSpec) else g.lat
    return ShardedTensor(local, spec, g.dims[0], x.manager, grid=g)


# -- reshapes -------------------------------------------------------------------------------------


def block_to_tokens(x: ShardedTensor, new: list[int], call: tuple[Any, Any, Any]) -> ShardedTensor:
    """The reshape of a block ``x`` to ``new`` that merges its two cut dims (latitude then
    longitude, adjacent) with the dims before them: the block's rows x columns flattened (row-
    major, as the serial tensor's), then :func:`_reshaped` as tokens."""
    g = x.grid
    assert isinstance(g, BlockSpec)
    d0, d1 = g.dims
    if g.merged:
        raise refuse(
            *call,
            f"a reshape that merges the cut dims {g.dims} of a block whose cuts hold merged "
            f"blocks (lead {g.lead})",
            "reshape the merged blocks out of the cut dims first",
        )
    if d1 != d0 + 1:
        raise refuse(
            *call,
            f"a reshape that merges the cut dims {g.dims} when the longitude does not follow "
            f"the latitude (the tokens would run down the columns)",
            "move the longitude dim right after the latitude first (permute)",
        )
    old = list(x.shape)
    virtual = [*old[:d0], old[d0] * old[d1], *old[d1 + 1 :]]
    tokens = TokenSpec(g.lat, g.lon, 1, d0)
    return _reshaped(x, x.local.flatten(d0, d1), virtual, new, tokens, call)


def _reshaped(
    x: ShardedTensor,
    local: torch.Tensor,
    old: list[int],
    new: list[int],
    g: TokenSpec,
    call: tuple[Any, Any, Any],
) -> ShardedTensor:
    """Tokens ``local`` (global shape ``old``, tokens ``g``) reshaped to ``new``. The run of
    dims that holds the token dim must end with it; its global entries are then ``before``
    (the dims merged before it, times ``lead``) blocks of H x W, and the new run must end with
    (H, W) (a block again) or with one dim of L x H x W (tokens, ``lead`` L). Each rank's
    entries keep their order: the local reshape is the same with h x w in place of H x W."""
    k, (n_h, n_w) = g.dim, g.shape
    a, b, c, e = next(r for r in _groups(old, new) if r[0] <= k < r[1])
    before = math.prod(old[a:k]) * g.lead
    h, w = (s.sizes[i] for s, i in zip((g.lat, g.lon), x.manager.grid_coords, strict=True))
    local_new = list(new)
    if k == b - 1 and e - c >= 2 and new[e - 2 : e] == [n_h, n_w]:
        if math.prod(new[c : e - 2]) == before:
            local_new[e - 2 : e] = [h, w]
            return _made(x, local.reshape(local_new), BlockSpec(g.lat, g.lon, (e - 2, e - 1)))
    if k == b - 1 and new[e - 1] % (n_h * n_w) == 0:
        lead = new[e - 1] // (n_h * n_w)
        local_new[e - 1] = lead * h * w
        return _made(x, local.reshape(local_new), TokenSpec(g.lat, g.lon, lead, e - 1))
    raise refuse(
        *call,
        f"a reshape of {tuple(old)} to {tuple(new)} that splits the tokens of dim {k} "
        f"({before} block(s) of {n_h} x {n_w} rows x columns) other than into (..., {n_h}, "
        f"{n_w}) or (..., L * {n_h * n_w}), or merges dims after them into them: no rank's part "
        f"of the result is a block or its tokens",
        f"reshape the token dim into (..., {n_h}, {n_w}) (the block) first",
    )


@register_grid(torch.Tensor.view, torch.Tensor.reshape, torch.reshape, tokens=True)
def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    rest = list(args[1:]) or [kwargs.get("shape", kwargs.get("size"))]
    if len(rest) == 1 and isinstance(rest[0], torch.dtype):
        raise refuse(func, args, kwargs, "a view of tokens as another dtype", "use .to(dtype)")
    new = _infer(list(x.shape), _shape_arg(rest))
    return _reshaped(x, x.local, list(x.shape), new, _tokens(x), (func, args, kwargs))


@register_grid(torch.flatten, torch.Tensor.flatten, tokens=True)
def _flatten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    new = flattened(args, kwargs)
    return _reshaped(x, x.local, list(x.shape), new, _tokens(x), (func, args, kwargs))


@register_grid(torch.unflatten, torch.Tensor.unflatten, tokens=True)
def _unflatten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    new = unflattened(args, kwargs)
    return _reshaped(x, x.local, list(x.shape), new, _tokens(x), (func, args, kwargs))


#: the size that marks the token dim in :func:`_move`'s probe (a meta tensor: nothing allocated)
_MARK = 1_000_003


@register_grid(*_MOVES, torch.unsqueeze, torch.Tensor.unsqueeze, tokens=True)
@register_grid(torch.squeeze, torch.Tensor.squeeze, tokens=True)
def _move(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where the token dim goes: the op applied to a meta tensor of the global shape whose
    token dim is marked by a size no other dim has."""
    x = args[0]
    g = _tokens(x)
    marker = list(x.shape)
    marker[g.dim] = _MARK
    shape = list(func(torch.empty(marker, device="meta"), *args[1:], **kwargs).shape)
    if shape.count(_MARK) != 1 or x.shape[g.dim] == 1:
        raise refuse(func, args, kwargs, "it could move the token dim out of sight", "gather")
    return placed(x, func(x.local, *args[1:], **kwargs), (shape.index(_MARK),))


# -- selecting, reducing, products ----------------------------------------------------------------


@register_grid(torch.Tensor.__getitem__, tokens=True)
def _getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Ints and slices of the other dims (``qkv[0]``); the token dim taken whole."""
    x = args[0]
    if not isinstance(x, ShardedTensor):
        raise refuse(func, args, kwargs, "indexing by tokens", "index with ints and slices")
    k, parts = _tokens(x).dim, index_parts(x, args[1])
    dim = out = 0
    at = None
    for p in parts:
        if p is not None and not isinstance(p, int | slice):
            raise refuse(func, args, kwargs, "tensor, list or boolean indexing", "use slices")
        if p is not None and dim == k:
            if p != slice(None):
                raise refuse(
                    func, args, kwargs, "an index of tokens by position", "take the dim whole"
                )
            at = out
        out += 0 if isinstance(p, int) else 1
        dim += 0 if p is None else 1
    assert at is not None
    return placed(x, x.local[tuple(parts)], (at,))


@register_grid(torch.unbind, torch.Tensor.unbind, tokens=True)
def _unbind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Along another dim (``q, k, v = qkv.unbind(0)``): on the local tokens."""
    x = args[0]
    k, dim = _tokens(x).dim, int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.dim()
    if dim == k:
        raise refuse(func, args, kwargs, "tokens taken one by one", "reshape to (..., H, W)")
    return tuple(placed(x, t, (k - (dim < k),)) for t in x.local.unbind(dim))


#: the reductions of blocks and tokens, with their default dims (all: None or ())
REDUCE = {
    f: default
    for fs, default in (
        ((torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum), None),
        ((torch.mean, torch.Tensor.mean, torch.nanmean, torch.Tensor.nanmean), None),
        ((torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin), ()),
    )
    for f in fs
}


@register_grid(*REDUCE, tokens=True)
def _reduce(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Over the token dim: the band rule's exact global value over the domain group (every
    token once, Replicated); over other dims, on the local tokens."""
    x = args[0]
    k, nd = _tokens(x).dim, x.dim()
    dim = args[1] if len(args) > 1 else kwargs.get("dim", REDUCE[func])
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        dims = set(range(nd))
    else:
        dims = {int(d) % nd for d in ([dim] if isinstance(dim, int) else dim)}
    if k in dims:
        return _HANDLERS[key(func)](func, args, kwargs)
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    local = func(x.local, *args[1:], **kwargs)
    return placed(x, local, (k if keepdim else k - sum(1 for r in dims if r < k),))


@register_grid(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, tokens=True)
def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A product batched over the token dim (a window's ``q @ k.transpose(-2, -1)``): on the
    local tokens when every ShardedTensor operand holds the same tokens at the same place
    (counted from the end) among the batch dims, and a plain one does not reach that dim.
    Tokens as the rows or the contracted dim: :func:`_rows_product`."""
    ref = next(a for a in args if isinstance(a, ShardedTensor) and a.grid is not None)
    g, tail = _tokens(ref), ref.dim() - _tokens(ref).dim
    if tail <= 2:
        return _rows_product(func, args, kwargs)
    local = []
    for a in args[:2]:
        if isinstance(a, ShardedTensor):
            at = a.grid
            if not isinstance(at, TokenSpec) or at.at(g.dim) != g or a.dim() - at.dim != tail:
                raise refuse(
                    func, args, kwargs, "a product over tokens", "reshape to (..., H, W) first"
                )
            local.append(a.local)
        elif isinstance(a, torch.Tensor) and a.dim() >= tail:
            raise refuse(func, args, kwargs, "a plain operand along the tokens", "shard it")
        else:
            local.append(a)
    out = func(*local, *args[2:], **kwargs)
    return placed(ref, out, (out.dim() - tail,))


def _whole(x: Any, q: ShardedTensor, at: tuple[int, ...]) -> torch.Tensor | None:
    """``x``'s tokens (``q``'s, at one of its dims ``at`` counted from the end) whole on every
    rank in their global order, for a computation that differs by rank (each rank's queries
    against every key: the backward sums every rank's gradient); a plain ``x`` as it is;
    None for tokens of other blocks or at another dim."""
    g = _tokens(q)
    if not isinstance(x, ShardedTensor):
        return _plain(x, q.transport)
    h = x.grid
    if not isinstance(h, TokenSpec) or h.at(g.dim) != g or h.dim - x.dim() not in at:
        return None
    return whole_of(x.local, h, x.manager, partial=True)


def _rows_product(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a @ b`` with ``a``'s tokens the rows (dim -2: a window's queries when one window spans
    several blocks): ``b``'s tokens, the keys at dim -1 (``k.transpose(-2, -1)``) or the
    values at dim -2 (contracted), are gathered whole in their global order and this rank's
    rows multiply them (the band rule, DESIGN.md); a plain ``b`` is per token. The result has
    ``a``'s tokens at dim -2. Any other place of the tokens (``a``'s contracted: a partial
    sum in block order) is refused."""
    a, b = args[0], args[1]
    g = a.grid if isinstance(a, ShardedTensor) else None
    bw = None
    if isinstance(g, TokenSpec) and g.dim == a.dim() - 2 and len(args) == 2 and not kwargs:
        bw = _whole(b, a, (-1, -2))
    if bw is None:
        raise refuse(
            func,
            args,
            kwargs,
            "a product with tokens other than as the rows of its first operand (dim -2) and "
            "the keys (dim -1) or values (dim -2) of its second: the tokens contracted, or a "
            "plain operand along them",
            "put the queries' tokens at dim -2 of the first operand, or reshape to (..., H, W)",
        )
    out = func(a.local, bw)
    return placed(a, out, (out.dim() - 2 if bw.dim() > 1 else out.dim() - 1,))


@register_grid(torch.einsum, tokens=True)
def _einsum(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """:func:`_rows_product`'s rule by letters: the first operand whose token letter the
    result keeps gives the rows (``q`` in ``"bhid,bhjd->bhij"``); another operand with those
    tokens under that letter is taken locally, under another letter gathered whole in the
    global order (``k``, ``v``); a plain one of the global length along the rows' letter is
    cut by token ids. Tokens of other blocks, or no token letter kept (contracted), refused."""
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], list | tuple) else list(args[1:])
    eq = _expand_ellipsis(args[0].replace(" ", ""), ops)
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    rows = [
        (o, t[o.grid.dim])
        for t, o in zip(terms, ops, strict=True)
        if isinstance(o, ShardedTensor) and isinstance(o.grid, TokenSpec) and t[o.grid.dim] in rhs
    ]
    local: list[Any] = []
    if rows and not kwargs:
        q, letter = rows[0]
        g, n = _tokens(q), q.shape[_tokens(q).dim]
        for term, op in zip(terms, ops, strict=True):
            if isinstance(op, ShardedTensor):
                h = op.grid
                if not isinstance(h, TokenSpec) or h.at(g.dim) != g:
                    break
                same = term[h.dim] == letter
                local.append(op.local if same else whole_of(op.local, h, op.manager, partial=True))
                continue
            op = _plain(op, q.transport)
            at = term.find(letter)
            if at >= 0 and op.size(at) not in (1, n):
                break
            local.append(g.part(op, at, q.rank) if at >= 0 and op.size(at) == n != 1 else op)
    if len(local) != len(ops):
        raise refuse(
            func, args, kwargs, "an einsum that contracts the tokens, meets tokens of other "
            "blocks, or a plain operand of another length along them",
            "keep the queries' token letter in the result; pass plain operands whole",
        )  # fmt: skip
    q, letter = rows[0]
    return placed(q, torch.einsum(f"{lhs}->{rhs}", *local), (rhs.index(letter),))


def _recut(t: ShardedTensor, g: TokenSpec, call: tuple[Any, Any, Any]) -> torch.Tensor:
    """The local tokens of ``t`` cut as ``g`` (the same lead and field): as blocks (the token
    dim unflattened into lead x h x w), only the rows or columns that change owner move."""
    have = t.grid
    if have == g:
        return t.local
    if not isinstance(have, TokenSpec) or (have.lead, have.shape, have.dim) != (
        g.lead,
        g.shape,
        g.dim,
    ):
        raise refuse(*call, "tokens of other blocks, or a block, meet tokens", "cut alike")
    k, (h, w) = g.dim, have.coords(t.manager.domain_rank)
    sizes = (have.lat.sizes[h], have.lon.sizes[w])
    local = t.local.unflatten(k, (g.lead, *sizes))
    block = ShardedTensor(
        local, have.lat, k + 1, t.manager, grid=BlockSpec(have.lat, have.lon, (k + 1, k + 2))
    )
    moved = _pointwise.to_blocks(block, BlockSpec(g.lat, g.lon, (k + 1, k + 2)), call)
    return moved.local.flatten(k, k + 2)


@register_grid(torch.cat, torch.concat, torch.concatenate, torch.stack, tokens=True)
def _join(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Tokens of one field joined along another dim (the channels): the local tokens joined,
    each moved to the first one's cut where theirs differs."""
    tensors = list(args[0] if args else kwargs["tensors"])
    ref = next(t for t in tensors if isinstance(t, ShardedTensor))
    g, nd, stack = _tokens(ref), ref.dim(), func is torch.stack
    d = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (nd + stack)
    call = (func, args, kwargs)
    if not all(isinstance(t, ShardedTensor) and t.dim() == nd for t in tensors) or (
        not stack and d == g.dim
    ):
        raise refuse(
            *call,
            "tokens joined along the token dim, or with tensors cut otherwise",
            "join along the channels",
        )
    local = func([_recut(t, g, call) for t in tensors], d)
    return placed(ref, local, (g.dim + (stack and d <= g.dim),))


# every rule of the element-wise and metadata handlers reads no field: they take tokens as
# they take blocks (their cuts, :func:`mpidp.sharded.cuts.cuts`, are the tokens' one)
for _k, _h in list(_HANDLERS.items()):
    if _h in _GRID_OK and _h.__module__ == _pointwise.__name__:
        _TOKENS.setdefault(_k, _h)
