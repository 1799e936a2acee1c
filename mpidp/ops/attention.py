"""Attention over a latitude-sharded token sequence: anemoi's head/sequence exchange.

For users migrating from anemoi's distributed transformer: :func:`shard_heads` takes q, k or v
from a cut of the sequence to a cut of the heads (every rank then holds the whole sequence for
its heads), :func:`shard_sequence` takes the attention's result back. Unlike anemoi's, both
take uneven sequence cuts AND uneven head counts (7 heads over 4 ranks: 2, 2, 2, 1, the cut
``torch.tensor_split`` makes) and any batch size. Each is one differentiable ``all_to_all_v``
whose backward is the reverse exchange. A ShardedTensor's ``F.scaled_dot_product_attention``
does the same by itself (docs/sharded_tensor.md).

Layout, as anemoi's: ``(batch, ..., heads, sequence, channels)``.

The sequence is cut over one group of ranks, as a band: on latitude x longitude blocks these
take the domain group only if named as an axis group (``group=manager.transport("lat")``), and
refuse it otherwise, on every rank alike (a block's tokens are not a range of the sequence).
The windowed attention of blocks is :class:`mpidp.models.window.DomainParallelWindowAttention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mpidp.errors import ConfigError
from mpidp.ops.collectives import all_to_all_v, copy_to, reduce_from, resolve_transport
from mpidp.ops.functions import band_transport
from mpidp.ops.halo import halo_exchange
from mpidp.runtime.partition import ShardSpec
from mpidp.runtime.rng import band_stream

__all__ = [
    "attention_over_key_band",
    "head_spec",
    "shard_heads",
    "shard_sequence",
    "sliding_window_attention",
]


def head_spec(num_heads: int, parts: int) -> ShardSpec:
    """How ``num_heads`` heads are cut over ``parts`` ranks: ``torch.tensor_split``'s cut
    (the first ``num_heads % parts`` ranks one more); ranks beyond the heads hold none."""
    return ShardSpec.balanced(num_heads, parts, allow_empty=True)


def _sizes(shapes: Sequence[Any], what: str) -> list[int]:
    """Per-rank sequence lengths from anemoi's ``shapes`` (a shape per rank: its dim -2) or
    plain ints."""
    out = []
    for s in shapes:
        if isinstance(s, int):
            out.append(s)
        elif isinstance(s, (tuple, list, torch.Size)) and len(s) >= 2:
            out.append(int(s[-2]))
        else:
            raise ConfigError(f"{what}: {s!r} is neither a length nor a shape (..., seq, ch)")
    return out


def shard_heads(x: torch.Tensor, shapes: Sequence[Any], group: Any = None) -> torch.Tensor:
    """``(batch, ..., heads, seq_r, ch)`` with this rank's part of the sequence ->
    ``(batch, ..., heads_r, seq, ch)``: the whole sequence for this rank's heads
    (:func:`head_spec`). ``shapes``: every rank's sequence length (or its shard's shape).
    Collective over ``group`` (default: the domain group)."""
    t = band_transport(group, x.device, "shard_heads")
    seq = _sizes(shapes, "shard_heads")
    if x.dim() < 3:
        raise ConfigError(f"shard_heads: expects (..., heads, seq, ch), got {tuple(x.shape)}")
    heads = head_spec(x.size(-3), t.size)
    return all_to_all_v(x, list(heads.sizes), seq, x.dim() - 3, x.dim() - 2, group=t)


def shard_sequence(
    x: torch.Tensor, shapes: Sequence[Any], num_heads: int, group: Any = None
) -> torch.Tensor:
    """The inverse of :func:`shard_heads`: ``(batch, ..., heads_r, seq, ch)`` ->
    ``(batch, ..., heads, seq_r, ch)``, the sequence cut by ``shapes`` again. Collective."""
    t = band_transport(group, x.device, "shard_sequence")
    seq = _sizes(shapes, "shard_sequence")
    heads = head_spec(num_heads, t.size)
    return all_to_all_v(x, seq, list(heads.sizes), x.dim() - 2, x.dim() - 3, group=t)


def query_rows_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    rows: ShardSpec,
    rank: int,
    keys: int,
    where: str,
    ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The part of a global ``(..., L, S)`` attention mask for this rank's queries (rows
    ``rows.start(rank):rows.stop(rank)`` of the sequence, or the rows ``ids`` when the queries
    are not a run of it: tokens of blocks; against all ``keys`` keys). A mask of another shape
    would be a band's own mask (built from local shapes), not the serial one: refused, with the
    fix. ``key_padding_mask`` must cover every key."""
    problems = []
    if attn_mask is not None and (
        attn_mask.dim() < 2 or attn_mask.size(-2) != rows.total or attn_mask.size(-1) != keys
    ):
        problems.append(
            f"attn_mask of shape {tuple(attn_mask.shape)}: expected the whole sequence's "
            f"(..., {rows.total}, {keys})"
        )
    if key_padding_mask is not None and key_padding_mask.size(-1) != keys:
        problems.append(
            f"key_padding_mask of shape {tuple(key_padding_mask.shape)}: expected one entry "
            f"per key of the whole sequence ({keys})"
        )
    if problems:
        raise ConfigError(
            f"rank {rank}: {where}: " + "; ".join(problems) + "; fix: pass the mask of the "
            "serial model (global shapes); each rank takes its rows"
        )
    if attn_mask is None:
        return None
    if ids is not None:
        return attn_mask.index_select(attn_mask.dim() - 2, ids.to(attn_mask.device))
    return attn_mask.narrow(-2, rows.start(rank), rows.sizes[rank])


def mha_rows_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    rows: ShardSpec,
    rank: int,
    keys: int,
    where: str,
    *,
    is_causal: bool = False,
    need_weights: bool = True,
    extra_keys: bool = False,
    ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The ``attn_mask`` with which torch's ``F.multi_head_attention_forward`` on this rank's
    queries (against every key, ``is_causal=False``) gives the serial model's rows.

    ``is_causal`` is torch's hint that ``attn_mask`` is the causal mask: torch needs the mask,
    and takes the hint (its own causal mask, ``attn_mask`` unread) when there is no
    ``key_padding_mask`` and no weights are asked for; then the causal mask's rows for the
    queries (:func:`causal_rows`), else ``attn_mask``'s (:func:`query_rows_masks`, whose
    ``rows`` / ``ids`` these take). With ``extra_keys`` (``bias_k``, a zero key, static keys)
    torch's causal mask spans them too, which a mask of the rows cannot say: refused."""
    if is_causal and attn_mask is None:
        raise ConfigError(
            f"rank {rank}: {where}: is_causal=True needs attn_mask, as in torch (the causal "
            f"mask of the whole sequence)"
        )
    if not is_causal or key_padding_mask is not None or need_weights:
        return query_rows_masks(attn_mask, key_padding_mask, rows, rank, keys, where, ids)
    if extra_keys:
        raise ConfigError(
            f"rank {rank}: {where}: is_causal=True with bias_k, add_zero_attn or static keys "
            f"(torch's causal mask then spans those keys too); fix: pass is_causal=False with "
            f"the causal attn_mask"
        )
    assert attn_mask is not None
    if ids is None:
        ids = torch.arange(rows.start(rank), rows.start(rank) + rows.sizes[rank])
    return ~causal_rows(ids.to(attn_mask.device), keys)  # (True: not attended, as MHA reads)


def causal_rows(ids: torch.Tensor, keys: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of the serial causal mask for queries at the global positions ``ids``:
    ``(len(ids), keys)``, True where key ``j`` is attended (``j <= i``, aligned at the top
    left as torch's ``is_causal``), applied to ``mask`` (boolean, True attends, or additive;
    broadcasting to ``(..., len(ids), keys)``) when one is given, as torch's CPU kernel
    applies both. Exact for any cut of the queries, a run or not, when the keys are whole in
    their global order."""
    allowed = torch.arange(keys, device=ids.device) <= ids.unsqueeze(-1)
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return torch.where(allowed, mask, -torch.inf)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int | tuple[int, int],
    group: Any = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Local attention over a sequence cut into bands along dim -2 (``(..., seq_r, ch)``):
    each query attends the keys at most ``window_size`` positions before and after it
    (anemoi's ``window_size``; a ``(left, right)`` pair as flash-attention's). Each rank
    fetches the ``left`` keys and values before its band and the ``right`` after it (a halo
    exchange, several ranks away on thin bands), and attends its queries with torch's SDPA
    and its rows of the banded mask: the serial banded attention's rows, exact, with memory
    ``seq_r x (seq_r + left + right)`` instead of a whole-sequence mask. Collective over
    ``group`` (default: the domain group)."""

    left, right = (window_size, window_size) if isinstance(window_size, int) else window_size
    if min(left, right) < 0:
        raise ConfigError(f"sliding_window_attention: window_size={window_size} must be >= 0")
    t = band_transport(group, q.device, "sliding_window_attention")
    rows = ShardSpec(tuple(r[0] for r in t.all_gather_ints([q.size(-2)])))
    d = q.dim() - 2
    kx = halo_exchange(k, left, right, d, rows, group=t)
    vx = halo_exchange(v, left, right, d, rows, group=t)
    a, b = rows.start(t.rank), rows.stop(t.rank)
    i = torch.arange(a, b, device=q.device).unsqueeze(-1)
    j = torch.arange(a - left, b + right, device=q.device)
    allowed = (j >= i - left) & (j <= i + right) & (j >= 0) & (j < rows.total)
    return F.scaled_dot_product_attention(q, kx, vx, attn_mask=allowed, scale=scale)


def attention_over_key_band(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_start: int,
    key_total: int,
    group: Any = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    weights: bool = False,
    dropout_p: float = 0.0,
) -> Any:
    """``softmax(q k^T * scale + mask) v`` for queries every rank holds whole (latents, a
    global token) against keys and values cut along the sequence: this rank holds key rows
    ``[key_start, key_start + S_r)`` of ``key_total``.

    Split softmax, merged exactly: each rank scores its key block, and with the global row
    maximum ``M`` (one all-reduce of a max, no gradient: any shift is exact) sums
    ``exp(s - M)`` and ``exp(s - M) v`` over its block; one all-reduce of those sums
    (``reduce_from``: every rank then uses the same value, so its backward hands each rank the
    whole gradient, and each rank's block gets its own share) gives the output, the same on
    every rank. Moves ``O(batch x heads x queries x (head_dim + 2))`` per rank, never the keys.
    ``attn_mask`` (boolean: True attends; or additive) of the global ``(..., L, S)`` shape
    is cut to this rank's columns; ``is_causal``: key ``j`` attends to query ``i`` when
    ``j <= i``. An empty block adds nothing. Collective over ``group``.

    The gradient of ``q`` is this rank's share (its block's part): a plain ``q`` is summed
    by ``mpidp.sync_gradients``; enter a replicated ``q`` through ``copy_to``. ``weights``:
    also return this rank's columns of the attention probabilities, ``(..., L, S_r)``.

    ``dropout_p``: the probabilities are dropped (and the kept ones scaled by ``1 / (1 - p)``)
    after the normaliser, as torch does; each rank draws the mask of its own columns from its
    band stream (:mod:`mpidp.runtime.rng`: the default generators stay in step), and ``weights`` are
    the dropped probabilities, as ``nn.MultiheadAttention`` returns them.
    """
    t = resolve_transport(group, q.device)
    rows = k.size(-2)
    scale = 1.0 / float(q.size(-1)) ** 0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., L, S_r)
    bias = _columns(attn_mask, key_start, rows, key_total, q)
    if is_causal:
        keys = torch.arange(key_start, key_start + rows, device=q.device)
        allowed = keys <= torch.arange(q.size(-2), device=q.device).unsqueeze(-1)
        bias = _additive(allowed, q) if bias is None else bias + _additive(allowed, q)
    if bias is not None:
        scores = scores + bias
    with torch.no_grad():
        local = (
            scores.amax(-1, keepdim=True)
            if rows
            else torch.full((*scores.shape[:-1], 1), -torch.inf, dtype=q.dtype, device=q.device)
        )
        top = t.all_reduce(local, "max")
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows all masked
    e = torch.exp(scores - top)
    kept = e
    if dropout_p:
        with band_stream(t.rank, q.device):
            kept = F.dropout(e, dropout_p)
    total = reduce_from(torch.cat([kept @ v, e.sum(-1, keepdim=True)], dim=-1), t)
    out = total[..., :-1] / total[..., -1:]
    if not weights:
        return out
    # a band of probabilities: what its columns give the normaliser is a share per rank, summed
    # (copy_to) before it reaches every rank's block through the sum
    return out, kept / copy_to(total[..., -1:], t)


def _additive(allowed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(allowed, zero, torch.full_like(zero, -torch.inf))


def _columns(
    mask: torch.Tensor | None, start: int, rows: int, total: int, like: torch.Tensor
) -> torch.Tensor | None:
    """``mask`` as an additive bias over this rank's key columns."""
    if mask is None:
        return None
    if mask.size(-1) == total and total != 1:
        mask = mask.narrow(-1, start, rows)
    elif mask.size(-1) != 1:
        raise ConfigError(
            f"attention over a band of keys: attn_mask has {mask.size(-1)} key columns, the "
            f"keys {total}; pass a mask of the global (..., L, {total}) shape (or 1 column)"
        )
    return _additive(mask, like) if mask.dtype == torch.bool else mask
