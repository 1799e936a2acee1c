"""Attention over tokens of blocks (:class:`~mpidp.sharded.block_layout.TokenSpec`; DESIGN.md,
"Blocks"): ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``
(``F.multi_head_attention_forward``) with a block's rows x columns flattened as the sequence.

A rank's tokens are not a run of the global order, but each query row of attention needs only
every key and value, whole, in that order: the band rule, with the keys and values gathered by
:func:`mpidp.sharded.tokens._whole` (the gather the products of tokens use) and each rank's
queries attending all of them with torch's own code. What reads the queries' positions takes
them from the tokens' global ids (:meth:`~mpidp.sharded.block_layout.TokenSpec.index`):

* a mask of the global ``(L, S)`` shape (or ``(N * heads, L, S)``) is cut to the queries' rows
  by their ids;
* causal attention is exact, since the global order is the serial one (row-major over the
  whole field, ``lead`` first): query ``i`` attends key ``j`` when ``j <= i``, ``i`` its id
  (:func:`mpidp.ops.attention.causal_rows`).

Dropout over the attention is refused (a rank's draws are not the serial ones), as are queries
whole on every rank against tokens, and a mask that is itself a ShardedTensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mpidp.ops.attention import causal_rows, mha_rows_mask
from mpidp.sharded.block_layout import TokenSpec
from mpidp.sharded.cuts import placed
from mpidp.sharded.dispatch import refuse, register_grid
from mpidp.sharded.products import _MHA_ARGS
from mpidp.sharded.shapes import _plain
from mpidp.sharded.tensor import ShardedTensor
from mpidp.sharded.tokens import _tokens, _whole

__all__: list[str] = []

_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


@register_grid(F.scaled_dot_product_attention, tokens=True)
def _sdpa(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Queries whose tokens are the rows (dim -2; one window over several blocks): the keys
    and values (tokens at dim -2) gathered whole in their global order, this rank's queries
    attending all of them with torch's kernel; a mask of the global (L, S) shape cut to the
    queries' tokens along dim -2 by their ids, ``is_causal`` the causal mask's rows for them
    (with a mask: both, as torch applies both)."""
    a = dict(zip(_SDPA, args, strict=False))
    a.update(kwargs)
    q, mask = a.pop("query"), a.get("attn_mask")
    g = q.grid if isinstance(q, ShardedTensor) else None
    k = v = None
    if isinstance(g, TokenSpec) and g.dim == q.dim() - 2:
        k, v = (_whole(a.pop(n), q, (-2,)) for n in ("key", "value"))
    if k is None or v is None or isinstance(mask, ShardedTensor):
        raise refuse(
            func, args, kwargs, "attention with tokens other than the queries', keys' and "
            "values' rows (dim -2), or a sharded mask", "put the tokens at dim -2; pass the "
            "mask of the global (L, S) shape",
        )  # fmt: skip
    if a.get("dropout_p"):
        raise refuse(
            func, args, kwargs, "dropout over tokens of blocks (a rank's draws are not the "
            "serial ones)", "dropout_p=0",
        )  # fmt: skip
    n, ids = q.shape[-2], _tokens(q).index(q.rank, q.local.device)
    if isinstance(mask, torch.Tensor):
        if mask.dim() >= 2 and mask.size(-2) not in (1, n):
            raise refuse(
                func, args, kwargs, f"a mask of {mask.size(-2)} query rows for {n} tokens",
                f"pass the mask of the global (L, S) shape (L = {n}) or 1 row",
            )  # fmt: skip
        mask = _plain(mask, q.transport)
        if mask.dim() >= 2 and mask.size(-2) == n != 1:  # (1 row: the same for every token)
            mask = mask.index_select(mask.dim() - 2, ids.to(mask.device))
    if a.pop("is_causal", False):
        mask = causal_rows(ids, k.size(-2), mask)
    a["attn_mask"] = mask
    return placed(q, func(q.local, k, v, **a), (q.dim() - 2,))


@register_grid(F.multi_head_attention_forward, tokens=True)
def _mha(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nn.MultiheadAttention`` with the queries' tokens as the sequence (dim 0 of the
    ``(L, N, E)`` or ``(L, E)`` that torch's module passes, batch_first or not): the keys and
    values (tokens at dim 0, or plain and whole: a memory) gathered whole in their global
    order, this rank's queries attending all of them with torch's code (its projections per
    token, any heads, ``bias_k``, ``add_zero_attn``, separate projection weights). Masks of the
    global shapes: ``attn_mask``'s rows cut by the queries' ids, ``key_padding_mask`` whole.
    ``is_causal``, torch's hint that ``attn_mask`` is causal, means what it means in torch:
    where torch uses its own causal mask (no ``key_padding_mask``, ``need_weights=False``),
    that mask's rows for the queries' ids; elsewhere ``attn_mask``. The output and the weights
    (``(N, L, S)``, ``(N, heads, L, S)`` or unbatched) hold this rank's query rows."""
    a = dict(zip(_MHA_ARGS, args, strict=False))
    a.update(kwargs)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    g = q.grid if isinstance(q, ShardedTensor) else None
    kw = vw = kpm = None
    pad, mask = a.get("key_padding_mask"), a.get("attn_mask")
    if isinstance(g, TokenSpec) and g.dim == 0:
        kw = _whole(k, q, (-k.dim(),))
        vw = kw if v is k else _whole(v, q, (-v.dim(),))
        kpm = _whole(pad, q, (-1,))
    if kw is None or vw is None or (kpm is None and pad is not None):
        raise refuse(
            func, args, kwargs, "multi-head attention with tokens other than the sequence "
            "(dim 0) of the queries and of the keys and values (or plain whole keys), or a "
            "key_padding_mask cut otherwise", "cut the queries' tokens as the keys'; pass the "
            "masks of the global shapes",
        )  # fmt: skip
    if a.get("dropout_p") and a.get("training", True):
        raise refuse(
            func, args, kwargs, "attention dropout over tokens of blocks (a rank's draws are "
            "not the serial ones)", "dropout=0.0, or eval()",
        )  # fmt: skip
    if isinstance(mask, ShardedTensor):
        raise refuse(func, args, kwargs, "a sharded attn_mask", "pass it whole (global shape)")
    extra = a.get("bias_k") is not None or a.get("add_zero_attn") or a.get("static_k") is not None
    a["attn_mask"] = mha_rows_mask(
        _plain(mask, q.transport), kpm, _tokens(q).counts, q.rank, kw.size(0), func.__name__,
        is_causal=bool(a.get("is_causal")), need_weights=bool(a.get("need_weights", True)),
        extra_keys=extra, ids=_tokens(q).index(q.rank, q.local.device),
    )  # fmt: skip
    a["is_causal"] = False
    a["key_padding_mask"] = kpm
    a = {name: _plain(z, q.transport) for name, z in a.items()}
    out, weights = func(q.local, kw, vw, **a)
    return placed(q, out, (0,)), None if weights is None else placed(
        q, weights, (weights.dim() - 2,)
    )
