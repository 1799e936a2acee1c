"""anemoi's ``anemoi.models.distributed.transformer``: attention's head/sequence exchange.

:func:`shard_heads` takes q, k or v ``(batch, ..., heads, seq_r, ch)`` from a cut of the
sequence to a cut of the heads ``(batch, ..., heads_r, seq, ch)``; :func:`shard_sequence`
takes the attention's result back. Each is :mod:`mpidp.ops.attention`'s exchange (one
differentiable ``all_to_all_v``, the reverse exchange as backward).

``shapes``: every rank's shard shape of the sequence-cut tensor anemoi passes (its first
entry is the rank's sequence length, as anemoi reads it) or plain lengths. ``mgroup`` None or
a group of one rank: the identity, reading no shapes (anemoi's shapes there count batch x grid
rows). Unlike anemoi's, both are right for uneven sequences and uneven heads (7 heads over 4
ranks: 2, 2, 2, 1, ``torch.tensor_split``'s cut), and :func:`shard_sequence` cuts the
sequence by ``shapes`` (anemoi's cuts it evenly, whatever ``shapes`` say).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.compat.anemoi._groups import extents, transport
from mpidp.errors import ConfigError
from mpidp.ops import attention

__all__ = ["shard_heads", "shard_sequence"]


def _exchange_group(mgroup: Any, input_: torch.Tensor) -> Transport | None:
    t = transport(mgroup, input_)
    return t if t is not None and t.size > 1 else None


def _lengths(shapes: Sequence[Any], what: str, rank: int) -> list[int]:
    return extents(shapes, 0, what, rank)


def shard_heads(input_: torch.Tensor, shapes: Sequence[Any], mgroup: Any) -> torch.Tensor:
    """``(batch, ..., heads, seq_r, ch)`` with this rank's part of the sequence ->
    ``(batch, ..., heads_r, seq, ch)``: the whole sequence for this rank's heads. Collective
    over ``mgroup``."""
    t = _exchange_group(mgroup, input_)
    if t is None:
        return input_
    return attention.shard_heads(input_, _lengths(shapes, "shard_heads", t.rank), t)


def shard_sequence(input_: torch.Tensor, shapes: Sequence[Any], mgroup: Any) -> torch.Tensor:
    """``(batch, ..., heads_r, seq, ch)`` -> ``(batch, ..., heads, seq_r, ch)``, the inverse of
    :func:`shard_heads`. The head count is every rank's ``heads_r`` summed (one small
    all-gather); a cut of the heads other than :func:`shard_heads`' raises on every rank.
    Collective over ``mgroup``."""
    t = _exchange_group(mgroup, input_)
    if t is None:
        return input_
    lengths = _lengths(shapes, "shard_sequence", t.rank)
    mine = input_.size(-3) if input_.dim() >= 3 else -1
    heads = [row[0] for row in t.all_gather_ints([mine])]
    total = sum(heads)
    if min(heads) < 0 or heads != list(attention.head_spec(total, t.size).sizes):
        raise ConfigError(
            f"rank {t.rank}: shard_sequence: the ranks hold {heads} heads (-1: not a "
            "(..., heads, seq, ch) tensor); expecting shard_heads' cut of the heads, "
            f"{list(attention.head_spec(max(total, 0), t.size).sizes)}: pass the output of "
            "the attention on shard_heads' q, k, v"
        )
    return attention.shard_sequence(input_, lengths, total, t)
