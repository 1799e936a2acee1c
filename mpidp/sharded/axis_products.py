"""Products, attention and ``unbind`` of a latitude x longitude block whose two cut axes live
in different dims and roles of the call: one rule per cut axis, for where that axis lives
(DESIGN.md, "Blocks").

A window partition can leave each cut axis of a block in a tensor dim of its own rather than
both in one token dim (:class:`~mpidp.sharded.block_layout.TokenSpec`). FuXi's windows of 4 on
a 4 x 8 token field at 2 x 2 blocks: the latitude cuts the one window row inside (each rank
holds a run of each window's tokens: its rows), the longitude falls between windows (each
rank holds whole windows of the window index merged into the batch). The reshapes carry each
cut on its own (:mod:`mpidp.sharded.grid`); a product then takes each cut axis by the rule
for where it lives. ``einsum``, ``@`` / ``bmm`` (``...ij,...jk->...ik``) and attention
(``...le,...se->...ls``, ``...ls,...sv->...lv``) are read as einsum letters; the first block
among the operands names each axis's letter (the letter of its dim holding that cut):

* the letter is kept in the result, which is cut there as that block is: a batch dim (the
  windows) or the rows (a window's queries, cut inside);
* an operand holding the axis under the same letter is local along it (a plain one of the
  global length there is cut to this rank's entries; length 1 broadcasts);
* an operand holding it under a letter of its own (the keys and values along their tokens)
  is gathered whole over that axis's group in the global order, the gradient summed back
  over it (:func:`~mpidp.ops.collectives.all_gather_v`): the band rule along one axis;
* anything else (the letter contracted, an axis under another's letter, a layout of its own;
  ``unbind`` along a cut dim; dropout in attention) is refused on every rank alike (the
  layout is global), with the op, the layout and the fix.

Bands are the grid (P, 1) and take the band rules (:mod:`mpidp.sharded.products`); tokens of
blocks the token rules (:mod:`mpidp.sharded.tokens`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mpidp.ops.attention import causal_rows
from mpidp.ops.collectives import all_gather_v
from mpidp.runtime.grid import AXES, BlockSpec, axis_transport
from mpidp.sharded.cuts import Cut, cuts, placed
from mpidp.sharded.dispatch import refuse, register_grid
from mpidp.sharded.products import _expand_ellipsis
from mpidp.sharded.shapes import _plain
from mpidp.sharded.tensor import ShardedTensor

__all__: list[str] = []

Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


def _is_block(a: Any) -> bool:
    return isinstance(a, ShardedTensor) and isinstance(a.grid, BlockSpec)


def _axis_at(a: ShardedTensor, i: int) -> int:
    """The dim of ``a`` that holds cut axis ``i`` (0 latitude, 1 longitude)."""
    g = a.grid
    assert isinstance(g, BlockSpec)
    return g.dims[i]


def _gathered(t: torch.Tensor, ref: ShardedTensor, i: int, cut: Cut, at: int) -> torch.Tensor:
    """``t``'s entries along dim ``at`` (cut as axis ``i`` of ``ref``) whole on the ranks of
    that axis, in their global order; the backward sums each rank's gradient back to its
    owner (each rank's rows used them differently). Collective over the axis group."""
    group = axis_transport(ref.manager, AXES[i], t.device)
    if cut.blocks == 1:
        return all_gather_v(t, cut.spec, at, group=group)
    runs = t.unflatten(at, (cut.blocks, cut.spec.sizes[cut.own]))  # each merged block's run
    return all_gather_v(runs, cut.spec, at + 1, group=group).flatten(at, at + 1)


def _by_letters(terms: list[str], rhs: str, ops: list[Any], call: Call) -> tuple[list[Any], Any]:
    """Each operand's local part for the product ``terms -> rhs`` (einsum letters, no
    ellipsis), one rule per cut axis of the first block among ``ops`` (its letter there:
    the axis's letter), and the result's cut dims. The axis's letter must be kept in the
    result (the result is cut there as that block is). Another block of the same cuts holds
    each axis under the axis's letter (local) or under a letter of its own (gathered whole
    over that axis: keys, values); a plain operand with the axis's letter is cut to this
    rank's entries there (length 1 broadcasts). Anything else: refused."""
    q = next(o for o in ops if _is_block(o))
    g = q.grid
    term = next(t for t, o in zip(terms, ops, strict=True) if o is q)
    letters = [term[d] for d in g.dims]
    if letters[0] == letters[1] or any(x not in rhs for x in letters):
        raise refuse(
            *call,
            f"a product that contracts a cut axis of a block (letters {letters} of "
            f"{term!r} -> {rhs!r}): each rank's partial sums would be in block order",
            "keep each cut dim of the first block in the result (the queries' rows, the "
            "batch), or reshape to (..., H, W) first",
        )
    cs, local, gathers = cuts(q), [], []
    for t, o in zip(terms, ops, strict=True):
        if o is q or not isinstance(o, torch.Tensor):
            local.append(q.local if o is q else o)
        elif isinstance(o, ShardedTensor):
            gathers.append((len(local), _gathers(q, o, t, letters, call)))
            local.append(o.local)
        else:
            x = _plain(o, q.transport)
            for c, letter in zip(cs, letters, strict=True):
                at = t.find(letter)
                if at >= 0 and x.size(at) != 1:
                    if x.size(at) != c.total:
                        raise refuse(
                            *call,
                            f"a plain operand of {x.size(at)} entries along the cut letter "
                            f"{letter!r} ({c.total} globally)",
                            f"pass it of the global length ({c.total}) or 1 there",
                        )
                    x = c.part(x, at)
            local.append(x)
    for k, dims in gathers:  # (every refusal above: before any message)
        for i, d in dims:
            local[k] = _gathered(local[k], q, i, cs[i], d)
    return local, tuple(rhs.index(x) for x in letters)


def _gathers(
    q: ShardedTensor, o: ShardedTensor, term: str, letters: list[str], call: Call
) -> list[tuple[int, int]]:
    """The (axis, dim of ``o``) pairs along which the sharded ``o`` beside the block ``q``
    (cut axes under ``letters``) is gathered whole: per axis, none under the same letter
    (local), its dim under a letter of its own; refused otherwise."""
    g, h = q.grid, o.grid
    assert isinstance(g, BlockSpec)
    own = [term[d] for d in h.dims] if isinstance(h, BlockSpec) else []
    fits = isinstance(h, BlockSpec) and (h.lat, h.lon, h.lead) == (g.lat, g.lon, g.lead)
    # each axis under its letter, or under one of its own while the axis's letter is on no
    # dim of ``o`` (a dim it holds whole would not line up with the block's part)
    fits = fits and all(
        m == n or (m not in letters and n not in term) for m, n in zip(own, letters, strict=True)
    )
    if not fits:
        raise refuse(
            *call,
            "a block beside tensors cut otherwise: another layout, or a cut axis under "
            "another cut axis's letter, or its letter on a dim that is not cut",
            "cut the operands alike (each axis in the same batch dim; the keys' and values' "
            "axis in their own token dim), or reshape to (..., H, W) first",
        )
    assert isinstance(h, BlockSpec)
    return [(i, h.dims[i]) for i in range(2) if own[i] != letters[i]]


@register_grid(torch.einsum, blocks=True)
def _einsum(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.einsum`` with a block among the operands: :func:`_by_letters`."""
    call = (func, args, kwargs)
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], list | tuple) else list(args[1:])
    if kwargs:
        raise refuse(*call, "einsum with keyword arguments", "pass the equation and operands")
    lhs, _, rhs = _expand_ellipsis(args[0].replace(" ", ""), ops).partition("->")
    local, dims = _by_letters(lhs.split(","), rhs, ops, call)
    return placed(_first_block(ops), torch.einsum(f"{lhs}->{rhs}", *local), dims)


@register_grid(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, blocks=True)
def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a @ b`` (both 2-D or more) as the einsum ``...ij,...jk->...ik``: a block's cuts in
    the batch dims or its rows (``q @ k.transpose(-2, -1)``, ``attn @ v``), or a second
    operand's columns."""
    call = (func, args, kwargs)
    ops = list(args)
    if len(ops) != 2 or kwargs or any(not isinstance(o, torch.Tensor) or o.dim() < 2 for o in ops):
        raise refuse(*call, "a product of a block with a vector", "make both operands 2-D or more")
    lhs, _, rhs = _expand_ellipsis("...ij,...jk->...ik", ops).partition("->")
    local, dims = _by_letters(lhs.split(","), rhs, ops, call)
    return placed(_first_block(ops), func(*local), dims)


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


@register_grid(F.scaled_dot_product_attention, blocks=True)
def _sdpa(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Attention as the einsums ``...le,...se->...ls`` (plus the mask ``...ls``) and
    ``...ls,...sv->...lv``: a block query's cuts in its batch dims or its rows (dim -2),
    the keys' and values' rows gathered over the rows' axis; torch's kernel on the local
    parts. Causal attention is exact (the keys are whole in their global order: each query
    row masks them by its global position, :func:`~mpidp.ops.attention.causal_rows`);
    dropout is refused (a rank's draws are not the serial call's)."""
    call = (func, args, kwargs)
    a = dict(zip(_SDPA, args, strict=False))
    a.update(kwargs)
    if a.get("dropout_p"):
        raise refuse(
            *call,
            "dropout in attention on a block (a rank's draws are not the serial call's)",
            "dropout_p=0",
        )
    names = [
        n for n in ("query", "key", "value", "attn_mask") if isinstance(a.get(n), torch.Tensor)
    ]
    ops = [a[n] for n in names]
    eq = ",".join(["...le", "...se", "...sv", "...ls"][: len(ops)]) + "->...lv"
    lhs, _, rhs = _expand_ellipsis(eq, ops).partition("->")
    local, dims = _by_letters(lhs.split(","), rhs, ops, call)
    a.update(zip(names, local, strict=True))
    ref = _first_block(ops)
    if a.pop("is_causal", False):  # the query rows' global positions: their cut's, or all
        rows = [c for c, d in zip(cuts(ref), dims, strict=True) if rhs[d] == "l"]
        n = ops[0].shape[-2]
        ids = torch.arange(n, device=ref.local.device)
        if rows:  # this rank's rows of each merged block's run
            ids = rows[0].part(ids, 0)
        a["attn_mask"] = causal_rows(ids, a["key"].size(-2), a.get("attn_mask"))
    return placed(ref, func(**a), dims)


def _first_block(ops: list[Any]) -> ShardedTensor:
    return next(o for o in ops if _is_block(o))


@register_grid(torch.unbind, torch.Tensor.unbind, blocks=True)
def _unbind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Along a dim that is not cut (``q, k, v = qkv.unbind(0)``): on the block, each cut
    keeping its axis."""
    x = args[0]
    dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.dim()
    at = tuple(_axis_at(x, i) for i in range(2))
    if dim in at:
        raise refuse(
            func,
            args,
            kwargs,
            f"a block taken apart along its cut dim {dim}",
            "unbind a dim that is not cut, or slice the block",
        )
    return tuple(placed(x, t, tuple(d - (dim < d) for d in at)) for t in x.local.unbind(dim))
