"""``nn.MultiheadAttention`` over a sequence of tokens cut into bands (a latitude-sharded token
grid flattened row by row: each rank's tokens are one contiguous run of the sequence).

Every rank gathers the keys and values whole (one ``all_gather_v`` each, one when they are one
tensor) and attends its own queries to all of them with torch's own code: every query row is
the serial one, for any number of heads (fewer than the ranks too), any masks, ``bias_k`` /
``add_zero_attn`` and ``need_weights``. The backward sums each key's gradient on its owner.
Cost: K and V whole on every rank (2 S E values) and 2 (P - 1)/P of them received; the
ShardedTensor route (``F.scaled_dot_product_attention``) uses the head all-to-all instead when
there are at least as many heads as ranks (docs/attention.md).

On latitude x longitude blocks the sequence is tokens of blocks (a rank's are not a run of
it): called with them as ShardedTensors, the layer runs torch's form, whose
``F.multi_head_attention_forward`` is the tokens' rule (:mod:`mpidp.sharded.tokens_attention`:
the same gather of the keys and values, in their global order). Plain tensors on blocks say
nothing of their tokens and are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.layers.base import (
    DomainParallel,
    LayoutMismatch,
    band_forward,
    in_band_call,
    learn_spec,
    not_a_band,
)
from mpidp.layers.registry import register_layer
from mpidp.ops.attention import mha_rows_mask
from mpidp.ops.collectives import all_gather_v
from mpidp.runtime.grid import blocks_refused

__all__ = ["DomainParallelMultiheadAttention"]


class DomainParallelMultiheadAttention(DomainParallel, nn.MultiheadAttention):
    """:class:`torch.nn.MultiheadAttention` on this rank's run of the sequence: the output
    (and the weights, ``(B, L_r, S)``) for this rank's queries. ``keys``: ``"sharded"`` (the
    keys and values are cut like the queries: self-attention over the field) or ``"whole"``
    (every rank passes the same whole key sequence, e.g. a memory or a condition). Left None,
    keys that are the query tensor itself are sharded, and other keys are refused: a whole
    memory and a band of the same length look alike, so it must be said which.
    Masks are the serial model's (global shapes). Collective over the domain group."""

    keys: str | None = None
    #: on blocks, tokens of blocks in a ShardedTensor call: torch's form, dispatched
    on_blocks = True

    def input_band_dim(self) -> int:
        return -2 if self.batch_first else -3  # the sequence of (B, L, E) or (L, B, E)

    def output_dims(self, args: tuple, kwargs: dict, n: int) -> list[int | None]:
        """The sharded dim of each output on ShardedTensor queries: the output's sequence dim,
        and the weights' query dim ((B, L, S), or (L, S) unbatched)."""
        query = args[0] if args else kwargs["query"]
        batched = query.dim() == 3
        seq = 1 if self.batch_first and batched else 0
        dims: list[int | None] = [seq, 1 if batched else 0]
        return dims[:n]

    @band_forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._alone():
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal,
            )  # fmt: skip
        if not_a_band(query):  # whole queries against a band of keys: dispatch's rule
            raise LayoutMismatch("the queries are not a band")
        m = self._manager()
        if m._blocks:  # tokens of blocks: the tokens' rule, through torch's form
            if in_band_call():
                raise LayoutMismatch("tokens of blocks")
            raise blocks_refused(m, f"the converted layer {type(self).__name__} on plain tensors")
        t = self._transport(query)
        keys = self.keys if self.keys is not None else "sharded" if key is query else None
        if keys not in ("sharded", "whole"):
            raise ConfigError(
                f"rank {t.rank}: {type(self).__name__}.keys={self.keys!r} with keys that are not "
                f"the queries: set module.keys = 'sharded' (cut like the queries) or 'whole' "
                f"(every rank passes the whole key sequence)"
            )
        seq = 1 if self.batch_first and query.dim() == 3 else 0
        rows = learn_spec(query, seq, t)
        if keys == "sharded":
            cut = rows if key is query else learn_spec(key, seq, t)
            k = all_gather_v(key, list(cut.sizes), seq, group=t)
            v = k if value is key else all_gather_v(value, list(cut.sizes), seq, group=t)
        else:
            k, v = key, value
        mask = mha_rows_mask(
            attn_mask, key_padding_mask, rows, t.rank, k.size(seq), type(self).__name__,
            is_causal=is_causal, need_weights=need_weights,
            extra_keys=self.bias_k is not None or self.add_zero_attn,
        )  # fmt: skip
        return super().forward(
            query, k, v, key_padding_mask, need_weights, mask, average_attn_weights, False
        )


register_layer(nn.MultiheadAttention, DomainParallelMultiheadAttention)
