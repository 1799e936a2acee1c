"""Partitions of a length over ranks (the single source of truth for shard sizes).

Balanced rule: the first ``n mod parts`` parts get one extra row (721 over 4 -> 181, 180, 180,
180). This is not ``torch.chunk``'s rule, which can give fewer chunks than ranks.
"""

from __future__ import annotations

from mpidp.errors import ConfigError

__all__ = ["balanced_sizes", "offsets"]


def balanced_sizes(n: int, parts: int, allow_empty: bool = False) -> tuple[int, ...]:
    """Sizes of ``parts`` shards of ``n`` rows, as even as possible, larger ones first."""
    if parts < 1:
        raise ConfigError(f"cannot split {n} rows over {parts} parts; use at least 1 part")
    if n < 0 or (n < parts and not allow_empty):
        raise ConfigError(
            f"cannot split {n} rows over {parts} ranks; use at most {max(n, 1)} ranks or a "
            f"larger grid (or allow empty shards)"
        )
    base, extra = divmod(n, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def offsets(sizes: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Start of every shard: ``(0, s0, s0 + s1, ...)`` without the total."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)
