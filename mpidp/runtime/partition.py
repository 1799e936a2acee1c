"""Partitions of a length over ranks: the single source of truth for shard sizes.

:class:`ShardSpec` is one partition (sizes of every rank's band). A partition *policy* maps any
length to a ShardSpec, so every activation of a network (a U-Net's down path, up path and skip
connections) is cut by the same rule.

Balanced rule: the first ``n mod parts`` parts get one extra row (721 over 4 -> 181, 180, 180,
180). This is not ``torch.chunk``'s rule, which can give fewer chunks than ranks.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import itertools
import weakref
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

from mpidp.errors import ConfigError

__all__ = [
    "Aligned",
    "Balanced",
    "PartitionPolicy",
    "ShardSpec",
    "Weighted",
    "as_sizes",
    "balanced_sizes",
    "offsets",
]


def _too_few(n: int, parts: int) -> ConfigError:
    return ConfigError(
        f"cannot split {n} rows over {parts} ranks; use at most {max(n, 1)} ranks or a larger "
        f"grid (or pass allow_empty=True for zero-size shards)"
    )


def balanced_sizes(n: int, parts: int, allow_empty: bool = False) -> tuple[int, ...]:
    """Sizes of ``parts`` shards of ``n`` rows, as even as possible, larger ones first."""
    if parts < 1:
        raise ConfigError(f"cannot split {n} rows over {parts} parts; use at least 1 part")
    if n < 0 or (n < parts and not allow_empty):
        raise _too_few(n, parts)
    base, extra = divmod(n, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Start of every shard: ``(0, s0, s0 + s1, ...)`` without the total."""
    return (0, *itertools.accumulate(sizes))[: len(sizes)]


def _weighted_bounds(weights: Sequence[float], n: int, allow_empty: bool) -> list[int]:
    """Shard boundaries at the rounded cumulative weight fractions of ``n``.

    Exact rational arithmetic, so every rank computes the same boundaries. Without
    ``allow_empty`` every shard keeps at least one row (boundaries nudged by the fewest rows).
    """
    ws = [Fraction(w) for w in weights]
    if not ws or any(w < 0 for w in ws) or sum(ws) <= 0:
        raise ConfigError(
            f"partition weights {list(weights)} must be non-negative with a positive sum"
        )
    total, parts = sum(ws), len(ws)
    if n < parts and not allow_empty:
        raise _too_few(n, parts)
    if any(w == 0 for w in ws) and not allow_empty:
        raise ConfigError(
            f"partition weights {list(weights)} give a rank no rows; pass allow_empty=True "
            f"or give every rank a positive weight"
        )
    cum = list(itertools.accumulate(ws))
    bounds = [0] + [int(n * c / total + Fraction(1, 2)) for c in cum[:-1]] + [n]
    if not allow_empty:
        for i in range(1, parts):  # at least one row each, room left for the rest
            bounds[i] = min(max(bounds[i], bounds[i - 1] + 1), n - (parts - i))
    return bounds


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one dimension of ``total`` entries is cut into ``parts`` consecutive shards.

    Shard ``r`` (rank ``r`` of the group) owns the global rows ``[offsets[r], offsets[r] +
    sizes[r])``. Build one with :meth:`balanced`, :meth:`from_sizes` or :meth:`from_weights`.
    """

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.sizes)
        if not sizes:
            raise ConfigError("a ShardSpec needs at least one shard; got sizes ()")
        if any(s < 0 for s in sizes):
            raise ConfigError(f"shard sizes {list(sizes)} contain a negative size")
        object.__setattr__(self, "sizes", sizes)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def balanced(cls, n: int, parts: int, allow_empty: bool = False) -> ShardSpec:
        """``n`` rows over ``parts`` shards; the first ``n mod parts`` get one extra row."""
        return cls(balanced_sizes(n, parts, allow_empty))

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> ShardSpec:
        """Explicit sizes (zero sizes allowed: the caller chose them)."""
        return cls(tuple(sizes))

    @classmethod
    def from_weights(cls, weights: Sequence[float], n: int, allow_empty: bool = False) -> ShardSpec:
        """Sizes proportional to ``weights`` (one per shard), integers summing to ``n``.

        Boundaries are the rounded cumulative fractions ``round(n * (w0 + ... + wi) / sum(w))``,
        so the same weights scale consistently to every length.
        """
        bounds = _weighted_bounds(weights, n, allow_empty)
        return cls(tuple(b - a for a, b in itertools.pairwise(bounds)))

    # -- facts ----------------------------------------------------------------------------

    @property
    def parts(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        return offsets(self.sizes)

    def __repr__(self) -> str:
        return f"ShardSpec(total={self.total}, parts={self.parts}, sizes={self.sizes})"

    def __len__(self) -> int:
        return self.parts

    def __iter__(self) -> Iterator[int]:
        return iter(self.sizes)

    def __getitem__(self, rank: int) -> int:
        return self.sizes[rank]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.parts:
            raise ConfigError(f"rank {rank} is not a shard of {self!r}; use 0..{self.parts - 1}")

    def start(self, rank: int) -> int:
        """First global row of ``rank``'s shard."""
        self._check_rank(rank)
        return self.offsets[rank]

    def stop(self, rank: int) -> int:
        """One past the last global row of ``rank``'s shard."""
        self._check_rank(rank)
        return self.offsets[rank] + self.sizes[rank]

    def slice(self, rank: int) -> slice:
        """The global rows ``rank`` owns, as a slice."""
        return slice(self.start(rank), self.stop(rank))

    def owner(self, row: int) -> int:
        """The rank owning global ``row`` (negative rows count from the end, like indexing)."""
        if not -self.total <= row < self.total:
            raise ConfigError(f"row {row} is outside {self!r}; use 0..{self.total - 1}")
        row %= self.total
        # The last shard starting at or before the row; empty shards start where the next does.
        return bisect.bisect_right(self.offsets, row) - 1

    def overlaps(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(rank, lo, hi)`` for every shard holding rows of the global range ``[start, stop)``
        (clipped to ``[0, total)``), in rank order; ``[lo, hi)`` are global rows, non-empty."""
        out = []
        for rank, (off, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            lo, hi = max(start, off), min(stop, off + size)
            if lo < hi:
                out.append((rank, lo, hi))
        return out


def as_sizes(sizes: ShardSpec | Sequence[int]) -> list[int]:
    """Plain list of shard sizes from a ShardSpec or any sequence of ints."""
    return list(sizes.sizes) if isinstance(sizes, ShardSpec) else [int(s) for s in sizes]


class PartitionPolicy:
    """Maps a length to the ShardSpec of that length over ``parts`` ranks.

    Every activation of a network is cut by the same policy, so shapes that a model produces on
    several paths (a skip connection and an upsampled tensor) get the same shard boundaries.
    """

    allow_empty: bool = False

    def spec(self, n: int, parts: int) -> ShardSpec:
        raise NotImplementedError

    def __call__(self, n: int, parts: int) -> ShardSpec:
        return self.spec(n, parts)

    def derived(self, n: int, parts: int) -> ShardSpec:
        """The partition of a length the model derived from its input (a layer's output, a
        reshape, rows picked by an index): the policy's, except that a length the policy
        would refuse for having too few rows (or whole blocks, for :class:`Aligned`) for the
        ranks is cut by the same rule with empty parts allowed (an empty part takes part in
        every exchange, so this is exact). At scale a deep level with fewer rows than ranks
        is normal; the model's input is cut by :meth:`spec` itself, which still refuses."""
        try:
            return self.spec(n, parts)
        except ConfigError:
            if self.allow_empty:
                raise
            if isinstance(self, (Balanced, Weighted, Aligned)):  # the rule, with empty parts
                return dataclasses.replace(self, allow_empty=True).spec(n, parts)
            if n >= parts:  # a policy of the user's own refused for another reason
                raise
            return ShardSpec.balanced(n, parts, allow_empty=True)


@dataclasses.dataclass(frozen=True)
class Balanced(PartitionPolicy):
    """The balanced rule (the default): the first ``n mod parts`` ranks get one extra row."""

    allow_empty: bool = False

    def spec(self, n: int, parts: int) -> ShardSpec:
        return ShardSpec.balanced(n, parts, self.allow_empty)


@dataclasses.dataclass(frozen=True)
class Weighted(PartitionPolicy):
    """Shards proportional to ``weights`` (one per rank) at every length: boundaries are the
    weight fractions scaled to the length and rounded (see :meth:`ShardSpec.from_weights`)."""

    weights: tuple[float, ...]
    allow_empty: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(self.weights))
        _weighted_bounds(self.weights, len(self.weights), True)  # validates the weights

    def spec(self, n: int, parts: int) -> ShardSpec:
        if parts != len(self.weights):
            raise ConfigError(
                f"weighted partition has {len(self.weights)} weights {self.weights} but the "
                f"group has {parts} ranks; give one weight per rank"
            )
        return ShardSpec.from_weights(self.weights, n, self.allow_empty)


@dataclasses.dataclass(frozen=True)
class Aligned(PartitionPolicy):
    """Band boundaries on multiples of ``multiple``, as even as possible: the ``n // multiple``
    whole blocks are cut by the balanced rule and the last rank also takes the ``n % multiple``
    rows left over. Pixel shuffles by ``multiple`` (and windows of that height) then need no
    rows from other ranks. With ``weights`` (one per rank) the whole blocks are cut in
    proportion to them instead (as :class:`Weighted` cuts rows): aligned and uneven, what
    :func:`mpidp.rebalance` returns for an aligned policy."""

    multiple: int
    allow_empty: bool = False
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.multiple < 1:
            raise ConfigError(f"Aligned(multiple={self.multiple}): use a multiple of 1 or more")
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(self.weights))
            _weighted_bounds(self.weights, len(self.weights), True)  # validates the weights

    def _blocks(self, blocks: int, parts: int) -> tuple[int, ...]:
        if self.weights is None:
            return balanced_sizes(blocks, parts, self.allow_empty)
        return ShardSpec.from_weights(self.weights, blocks, self.allow_empty).sizes

    def spec(self, n: int, parts: int) -> ShardSpec:
        if self.weights is not None and parts != len(self.weights):
            raise ConfigError(
                f"aligned partition has {len(self.weights)} weights {self.weights} but the "
                f"group has {parts} ranks; give one weight per rank"
            )
        blocks, rest = divmod(n, self.multiple)
        try:
            sizes = [b * self.multiple for b in self._blocks(blocks, parts)]
        except ConfigError:
            raise ConfigError(
                f"cannot cut {n} rows into {parts} bands on multiples of {self.multiple} "
                f"({blocks} whole blocks); use at most {max(blocks, 1)} ranks, a smaller "
                f"multiple, or allow_empty=True"
            ) from None
        sizes[-1] += rest
        return ShardSpec.from_sizes(sizes)


# -- partitions that travel with a tensor -----------------------------------------------------

#: (the band, its dim, its spec) of each ShardedTensor a layer is running on
_KNOWN: contextvars.ContextVar[tuple[tuple[Any, int, ShardSpec], ...]] = contextvars.ContextVar(
    "mpidp_known_spec", default=()
)


@contextlib.contextmanager
def known_spec(band: Any, dim: int, spec: ShardSpec) -> Iterator[None]:
    """Inside this block, code given ``band`` takes its partition along ``dim`` from ``spec``
    instead of learning it in an all-gather (the ShardedTensor front end: the spec travels
    with the tensor): the layers' :func:`~mpidp.layers.base.learn_spec`, and the halo
    exchange, which then agrees on its arguments once per distinct call instead of per call."""
    token = _KNOWN.set(((band, dim % band.dim(), spec), *_KNOWN.get()))
    try:
        yield
    finally:
        _KNOWN.reset(token)


def known_for(x: Any, dim: int) -> ShardSpec | None:
    """The partition :func:`known_spec` declared for ``x`` along ``dim``, or the one just learned
    for this very tensor (:func:`learned`), else None."""
    d = dim % max(x.dim(), 1)
    for band, at, spec in _KNOWN.get():
        if band is x and at == d:
            return spec
    last = _LEARNED.get()
    if last is not None and last[0]() is x and last[1] == d:
        return last[2]
    return None


#: the last partition learned from every rank's extent: (a weak reference to the band, its
#: dim, the spec): the halo exchange a layer makes next on the same band then agrees on its
#: arguments once per distinct call, as on a ShardedTensor (one all-gather a call less)
_LEARNED: contextvars.ContextVar[tuple[Any, int, ShardSpec] | None] = contextvars.ContextVar(
    "mpidp_learned_spec", default=None
)


def learned(x: Any, dim: int, spec: ShardSpec) -> None:
    """Record that ``spec`` is the partition of this tensor ``x`` along ``dim``, learned from
    every rank's extent in one all-gather (the same on every rank). Only this tensor object
    (held weakly) is concerned: two tensors of one local size may belong to different ones."""
    _LEARNED.set((weakref.ref(x), dim % max(x.dim(), 1), spec))
