"""Products, attention and ``unbind`` of a latitude x longitude block whose two cut axes live
in different roles of the call: one rule per cut axis, for where that axis lives (DESIGN.md,
"Blocks").

A window partition can leave each cut axis of a block in a tensor dim of its own rather than
both in one token dim (:class:`~mpidp.sharded.block_layout.TokenSpec`). FuXi's windows of 4 on
a 4 x 8 token field at 2 x 2 blocks: the latitude cuts the one window row inside (each rank
holds a run of each window's tokens: its rows), the longitude falls between windows (each
rank holds whole windows of the window index merged into the batch). The reshapes carry each
cut on its own (:mod:`mpidp.sharded.grid`); the ops of the attention then take each cut axis
by the rule for the place it has in the call:

* a batch dim (before the last two of ``a @ b`` and of attention; any dim ``unbind`` leaves):
  the op is local along it. A sharded operand must hold the same cut at the same place
  (counted from the end); a plain one of the global length there is cut to this rank's
  entries, one of length 1 broadcasts.
* the rows of the first operand (dim -2: a window's queries, cut inside): the band rule along
  that axis's group. The second operand's entries along it (keys at dim -1, values at dim -2)
  are gathered whole from the ranks of that axis in their global order (the gradient summed
  back over them: :func:`~mpidp.ops.collectives.all_gather_v`) and this rank's rows multiply
  them; a plain mask of the global query length is cut to this rank's rows.
* anywhere else (the contracted dim, a dim ``unbind`` takes apart): refused on every rank
  alike (the layout is global), with the op, the layout and the fix.

Bands are the grid (P, 1) and take the band rules (:mod:`mpidp.sharded.products`); tokens of
blocks the token rules (:mod:`mpidp.sharded.tokens`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mpidp.ops.collectives import all_gather_v
from mpidp.runtime.grid import AXES, BlockSpec, axis_transport
from mpidp.sharded.cuts import Cut, cuts, placed
from mpidp.sharded.dispatch import refuse, register_grid
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
    return all_gather_v(t, cut.spec, at, group=group)


def _operand(
    a: ShardedTensor, b: Any, rows_ok: tuple[int, ...], call: Call, what: str
) -> torch.Tensor | None:
    """This rank's operand for ``b`` beside the block ``a``, one rule per cut axis of ``a``
    (``a``'s cut at dim -2: its rows; before: a batch dim): a block ``b`` of the same cuts
    holds each batch cut at ``a``'s place (counted from the end) and each rows cut at one of
    ``rows_ok`` (then gathered whole along that axis); a plain ``b`` reaching a batch cut
    with its global length is cut to this rank's entries. None: ``b`` does not fit."""
    nd, g = a.dim(), a.grid
    assert isinstance(g, BlockSpec)
    if isinstance(b, ShardedTensor):
        h = b.grid
        if not isinstance(h, BlockSpec) or (h.lat, h.lon) != (g.lat, g.lon):
            return None
        local = b.local
        for i, c in enumerate(cuts(a)):
            tail, have = nd - c.dim, b.dim() - h.dims[i]
            if tail > 2 and have != tail:
                return None
            if tail == 2:
                if -have not in rows_ok:
                    return None
                local = _gathered(local, a, i, c, h.dims[i])
        return local
    if not isinstance(b, torch.Tensor):
        return None
    return _plain_part(a, b, call, what, rows=False)


def _plain_part(a: ShardedTensor, t: torch.Tensor, call: Call, what: str, rows: bool) -> Any:
    """The plain ``t`` broadcast against ``a`` (aligned at the end), cut to this rank's
    entries along each batch cut of ``a`` it reaches with its global length (and along the
    rows cut, dim -2, with ``rows``: a mask's query rows); length 1 broadcasts."""
    local = _plain(t, a.transport)
    for c in cuts(a):
        tail = a.dim() - c.dim
        if (tail > 2 or rows) and local.dim() >= tail and local.size(-tail) != 1:
            if local.size(-tail) != c.total:
                raise refuse(
                    *call,
                    f"{what} of {local.size(-tail)} entries along a dim cut over {c.total}",
                    f"pass it of the global length ({c.total}) or 1 there",
                )
            local = c.part(local, local.dim() - tail)
    return local


def _check_rows(a: ShardedTensor, call: Call) -> None:
    """Each cut of ``a`` in a batch dim or its rows (dim -2), else refused."""
    if any(a.dim() - c.dim < 2 for c in cuts(a)):
        raise refuse(
            *call,
            "a block cut along the last dim of the first operand (the contracted one, or the "
            "head features): the partial sums of each rank would be in block order",
            "keep the block's cut dims among the batch dims and the rows (dim -2), or "
            "reshape to (..., H, W) first",
        )


@register_grid(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm)
def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a @ b`` with ``a`` a block whose cuts are batch dims or its rows (a window's
    ``q @ k.transpose(-2, -1)``, ``attn @ v``): per cut axis, local along a batch cut, and
    along the rows cut ``b``'s keys (dim -1) or values (dim -2) gathered over that axis."""
    call = (func, args, kwargs)
    a, b = (*args, None)[:2]
    local_b = None
    if _is_block(a) and a.dim() >= 2 and len(args) == 2 and not kwargs:
        _check_rows(a, call)
        if isinstance(b, torch.Tensor) and b.dim() >= 2:
            local_b = _operand(a, b, (-1, -2), call, "a plain second operand")
    if local_b is None:
        raise refuse(
            *call,
            "a product with a block other than as its first operand, with cuts in batch dims "
            "and its rows (dim -2), beside a second operand (2-D or more) holding the same "
            "cuts in the same batch dims and the rows' axis at dim -1 (keys) or -2 (values)",
            "put the block first with its cut dims among the batch dims and the rows, or "
            "reshape to (..., H, W) first",
        )
    out = func(a.local, local_b)
    return placed(a, out, tuple(out.dim() - (a.dim() - c.dim) for c in cuts(a)))


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


@register_grid(F.scaled_dot_product_attention)
def _sdpa(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Attention with the query a block cut in its batch dims and its rows (dim -2): per cut
    axis, the keys and values local along a batch cut and gathered along the rows' axis
    (their dim -2); a plain mask cut to this rank's batch entries and query rows. Causal
    attention and dropout are refused (a rank's rows are not the serial call's)."""
    call = (func, args, kwargs)
    a = dict(zip(_SDPA, args, strict=False))
    a.update(kwargs)
    q, mask = a.pop("query"), a.get("attn_mask")
    k = v = None
    if _is_block(q) and q.dim() >= 2 and not isinstance(mask, ShardedTensor):
        _check_rows(q, call)
        k, v = (_operand(q, a.pop(n), (-2,), call, f"a plain {n}") for n in ("key", "value"))
    if k is None or v is None:
        raise refuse(
            *call,
            "attention with a block query beside keys or values cut otherwise (each cut axis "
            "of the query at the same batch dim, the rows' axis at dim -2), or a sharded mask",
            "cut the query, keys and values alike; pass the mask of the global shape",
        )
    if a.get("is_causal") or a.get("dropout_p"):
        raise refuse(
            *call,
            "causal attention or dropout on a block (a rank's query rows and draws are not "
            "the serial call's)",
            "pass the causal mask as attn_mask; dropout_p=0",
        )
    if isinstance(mask, torch.Tensor):
        a["attn_mask"] = _plain_part(q, mask, call, "a mask", rows=True)
    out = func(q.local, k, v, **a)
    return placed(q, out, tuple(c.dim for c in cuts(q)))


@register_grid(torch.unbind, torch.Tensor.unbind)
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
