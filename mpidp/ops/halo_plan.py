"""Which rows go where in a halo exchange: boundaries, plans and output layouts (pure).

Rank r owns global rows ``[s, e)`` of a field of ``H`` rows and asks for ``[s - before,
e + after)``. :func:`plan` splits that range into *pieces*: rows of one owner, placed at an
offset of the extended band, mirrored and/or rolled for rows beyond an edge, or one row
repeated (replicate); zero runs where the boundary is zeros. Every rank computes every rank's
pieces from the same global facts, so it knows what to send to whom without asking. Plans are
cached on those global facts only, so every rank hits or misses the cache alike.

:func:`layout` assigns the pieces to outputs: the whole band, or the strips beyond it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any

from mpidp.errors import ConfigError
from mpidp.runtime.partition import ShardSpec

__all__ = ["BOUNDARY_KINDS", "Boundary", "Layout", "Piece", "Plan", "layout", "plan"]

#: Rows beyond the edge each boundary kind can supply (None: any number).
_REACH = {
    "none": lambda h: 0,
    "zeros": lambda h: None,
    "replicate": lambda h: None,
    "reflect": lambda h: h - 1,
    "symmetric": lambda h: h,
    "circular": lambda h: h,
    "polar": lambda h: h - 1,
    "polar_half": lambda h: h,
}
BOUNDARY_KINDS = tuple(_REACH)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """What fills the rows beyond the global edges, at the low end and at the high end.

    Kinds (global row ``i`` outside ``[0, H)``):

    * ``"none"``: no rows may be asked for beyond the edge (an error if a halo reaches there).
    * ``"zeros"``: zeros (``F.pad`` constant 0, a convolution's zero padding).
    * ``"replicate"``: the edge row repeated (``F.pad`` replicate).
    * ``"reflect"``: mirror without repeating the edge row: row -k is row k (``F.pad`` reflect).
    * ``"symmetric"``: mirror repeating the edge row: row -k is row k - 1 (numpy symmetric).
    * ``"circular"``: periodic, row -k is row H - k (``F.pad`` circular); both ends.
    * ``"polar"``: across the pole of a global latitude-longitude grid whose **poles lie on the
      first and last rows** (e.g. 721 rows, 90 to -90 degrees): row -k is row k rolled by half
      the circle along ``roll_dim`` (``reflect`` plus the roll).
    * ``"polar_half"``: the same for grids whose **poles lie half a row beyond the first and last
      rows** (cell centres, e.g. 720 rows, 89.875 to -89.875, and Gaussian grids): row -k is row
      k - 1 rolled by half the circle (``symmetric`` plus the roll).

    The polar kinds need an even extent along ``roll_dim`` (the longitude), unsharded on the
    group of the exchange. Build one with :meth:`of`: a kind, a ``(low, high)`` pair of kinds,
    None (``"none"``) or a Boundary.
    """

    low: str
    high: str
    roll_dim: int = -1

    def __post_init__(self) -> None:
        for kind in (self.low, self.high):
            if kind not in _REACH:
                raise ConfigError(
                    f"unknown halo boundary {kind!r}; use one of {', '.join(BOUNDARY_KINDS)}"
                )
        if (self.low == "circular") != (self.high == "circular"):
            raise ConfigError(
                f"boundary ({self.low!r}, {self.high!r}): circular must be used at both ends"
            )

    @classmethod
    def of(cls, boundary: Any, roll_dim: int = -1) -> Boundary:
        """Parse what users pass as ``boundary=`` (see the class docstring)."""
        if isinstance(boundary, Boundary):
            return boundary
        if boundary is None or isinstance(boundary, str):
            kind = "none" if boundary is None else boundary
            return cls(kind, kind, roll_dim)
        if isinstance(boundary, Sequence) and len(boundary) == 2:
            low, high = ("none" if b is None else b for b in boundary)
            return cls(str(low), str(high), roll_dim)
        raise ConfigError(
            f"boundary {boundary!r}: pass a kind ({', '.join(BOUNDARY_KINDS)}), a (low, high) "
            f"pair of kinds, or a mpidp.Boundary"
        )

    @property
    def polar(self) -> bool:
        return self.low.startswith("polar") or self.high.startswith("polar")

    def __repr__(self) -> str:
        kinds = repr(self.low) if self.low == self.high else f"{self.low!r}, {self.high!r}"
        return f"Boundary({kinds}" + (f", roll_dim={self.roll_dim})" if self.polar else ")")


# -- the plan: which rows go where (pure, the same on every rank) -----------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of ``owner``'s band placed at output row ``at`` of the receiver,
    flipped along dim and/or rolled along roll_dim, a single row possibly ``repeat``-ed."""

    owner: int
    lo: int
    hi: int
    at: int
    flip: bool = False
    roll: bool = False
    repeat: int = 0  # 0: hi - lo rows as they are

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    @property
    def span(self) -> int:
        return self.repeat or self.rows


@dataclasses.dataclass(frozen=True)
class Plan:
    """One rank's part of a halo exchange.

    Rows a peer must send are merged into one message where pieces overlap or touch (a thin
    shard's row that is both a neighbour row and a mirrored row travels once).
    """

    length: int  # rows of the extended band
    local: tuple[Piece, ...]  # from this rank's own rows
    recv: tuple[tuple[int, int, int], ...]  # (peer, lo, hi) of the peer's rows, message order
    remote: tuple[tuple[int, Piece], ...]  # (message index, piece) from other ranks
    send: tuple[tuple[int, int, int], ...]  # (peer, lo, hi) of own rows, message order
    zeros: tuple[tuple[int, int], ...]  # (at, rows) filled with zeros


def _messages(pieces: list[Piece]) -> list[tuple[int, int, int]]:
    """``(owner, lo, hi)`` messages covering the remote pieces: overlapping or touching row
    ranges of one owner merged, sorted by owner then rows (the same on sender and receiver)."""
    out: list[tuple[int, int, int]] = []
    for owner, lo, hi in sorted((p.owner, p.lo, p.hi) for p in pieces):
        if out and out[-1][0] == owner and lo <= out[-1][2]:
            out[-1] = (owner, out[-1][1], max(hi, out[-1][2]))
        else:
            out.append((owner, lo, hi))
    return out


def _owners(spec: ShardSpec, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(rank, lo, hi)`` of the non-empty shards covering global rows ``[lo, hi)``."""
    ends = list(itertools.accumulate(spec.sizes))
    out = []
    rank = bisect.bisect_right(ends, lo)
    while lo < hi:
        stop = min(hi, ends[rank])
        if stop > lo:
            out.append((rank, lo, stop))
        lo = max(lo, stop)
        rank += 1
    return out


def _edge_source(kind: str, a: int, b: int, h: int, low: bool) -> tuple[int, int, bool] | None:
    """Global source rows ``[lo, hi)`` and whether they are mirrored, for output rows ``[a, b)``
    beyond one edge; None for zeros. ``replicate`` is handled by the caller."""
    if kind == "zeros":
        return None
    if kind == "circular":
        shift = h if low else -h
        return a + shift, b + shift, False
    if kind in ("reflect", "polar"):
        return (1 - b, 1 - a, True) if low else (2 * h - 1 - b, 2 * h - 1 - a, True)
    return (-b, -a, True) if low else (2 * h - b, 2 * h - a, True)  # symmetric, polar_half


def _pieces(
    spec: ShardSpec, lo_g: int, hi_g: int, boundary: Boundary
) -> tuple[list[Piece], list[tuple[int, int]]]:
    """Pieces and zero runs that make up global rows ``[lo_g, hi_g)`` (rows may lie outside)."""
    h, offs = spec.total, spec.offsets
    pieces: list[Piece] = []
    zeros: list[tuple[int, int]] = []

    def emit(src_lo: int, src_hi: int, a: int, flip: bool, roll: bool) -> None:
        for q, glo, ghi in _owners(spec, src_lo, src_hi):
            first = a + (src_hi - ghi if flip else glo - src_lo)
            pieces.append(Piece(q, glo - offs[q], ghi - offs[q], first - lo_g, flip, roll))

    regions = (
        (lo_g, min(hi_g, 0), boundary.low, True),
        (max(lo_g, 0), min(hi_g, h), None, False),
        (max(lo_g, h), hi_g, boundary.high, False),
    )
    for a, b, kind, low in regions:
        if a >= b:
            continue
        if kind is None:
            emit(a, b, a, False, False)
        elif kind == "replicate":
            ((q, glo, _),) = _owners(spec, 0, 1) if low else _owners(spec, h - 1, h)
            local = glo - offs[q]
            pieces.append(Piece(q, local, local + 1, a - lo_g, repeat=b - a))
        else:
            source = _edge_source(kind, a, b, h, low)
            if source is None:
                zeros.append((a - lo_g, b - a))
            else:
                src_lo, src_hi, flip = source
                emit(src_lo, src_hi, a, flip, kind.startswith("polar"))
    return pieces, zeros


def _check_widths(spec: ShardSpec, before: tuple[int, ...], after: tuple[int, ...], b: Boundary):
    """Raise the same ConfigError on every rank when the widths cannot be served."""
    h = spec.total
    for r, (s, n) in enumerate(zip(spec.offsets, spec.sizes, strict=True)):
        lo, hi = s - before[r], s + n + after[r]
        # wider than the field is fine where the boundary supplies the rows (zeros, replicate:
        # FNO pads a small dim past its size); the reach check below bounds the others
        if hi < lo:
            raise ConfigError(
                f"rank {r}: widths (before={before[r]}, after={after[r]}) trim more than its "
                f"{n} rows (would return rows [{lo}, {hi})); trim at most {n} rows in total"
            )
        for kind, beyond, edge in ((b.low, -lo, "low"), (b.high, hi - h, "high")):
            limit = _REACH[kind](h)
            if beyond > 0 and limit is not None and beyond > limit:
                fix = (
                    "pass a boundary (zeros, replicate, reflect, circular, polar) or widths "
                    "that stay inside the field"
                    if kind == "none"
                    else f"use widths that reach at most {limit} rows beyond the edge"
                )
                raise ConfigError(
                    f"rank {r}: halo (before={before[r]}, after={after[r]}) reaches {beyond} "
                    f"rows beyond the {edge} edge of {h} rows but boundary {kind!r} supplies "
                    f"{limit}; {fix}"
                )


@functools.lru_cache(maxsize=512)
def plan(
    sizes: tuple[int, ...],
    before: tuple[int, ...],
    after: tuple[int, ...],
    boundary: Boundary,
    rank: int,
) -> Plan:
    """This rank's plan. Cached on global facts only, so every rank hits or misses alike."""
    spec = ShardSpec(sizes)
    _check_widths(spec, before, after, boundary)

    def needs(r: int) -> tuple[list[Piece], list[tuple[int, int]]]:
        s = spec.offsets[r]
        return _pieces(spec, s - before[r], s + sizes[r] + after[r], boundary)

    mine, zeros = needs(rank)
    remote = [p for p in mine if p.owner != rank]
    recv = _messages(remote)
    send = []
    for r in range(len(sizes)):
        if r != rank:
            send += [(r, lo, hi) for q, lo, hi in _messages(needs(r)[0]) if q == rank]

    def message_of(p: Piece) -> int:
        return next(i for i, (q, lo, hi) in enumerate(recv) if q == p.owner and lo <= p.lo < hi)

    return Plan(
        length=sizes[rank] + before[rank] + after[rank],
        local=tuple(p for p in mine if p.owner == rank),
        recv=tuple(recv),
        remote=tuple((message_of(p), p) for p in remote),
        send=tuple(send),
        zeros=tuple(zeros),
    )


def neighbour_messages(
    sizes: tuple[int, ...], before: tuple[int, ...], after: tuple[int, ...], rank: int
) -> tuple[tuple[int, int, int], ...]:
    """The messages ``rank`` receives when rows come from its two neighbours only: the last
    ``before`` rows of the rank above, the first ``after`` rows of the rank below (in the
    order of :attr:`Plan.recv`)."""
    out = []
    if rank > 0 and before[rank] > 0:
        out.append((rank - 1, sizes[rank - 1] - before[rank], sizes[rank - 1]))
    if rank < len(sizes) - 1 and after[rank] > 0:
        out.append((rank + 1, 0, after[rank]))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def neighbours_only(
    sizes: tuple[int, ...], before: tuple[int, ...], after: tuple[int, ...], boundary: Boundary
) -> bool:
    """Whether every rank's plan receives exactly :func:`neighbour_messages` (then every
    rank's sends are the matching ones too): the same answer on every rank, from global
    facts. Raises the plan's ConfigError for widths the partition cannot serve."""
    spec = ShardSpec(sizes)
    _check_widths(spec, before, after, boundary)
    for r, s in enumerate(spec.offsets):
        pieces, _ = _pieces(spec, s - before[r], s + sizes[r] + after[r], boundary)
        remote = [p for p in pieces if p.owner != r]
        if tuple(_messages(remote)) != neighbour_messages(sizes, before, after, r):
            return False
    return True


# -- where the rows land: the whole band, or only the strips beyond it -----------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """The pieces of a plan assigned to output tensors, one per window ``(start, rows)`` of the
    extended band; pieces outside every window (the band itself, for strips) are not copied."""

    rows: tuple[int, ...]  # rows of every output
    zeros: tuple[tuple[int, int, int], ...]  # (output, at, rows)
    local: tuple[tuple[int, Piece], ...]  # (output, piece placed in that output)
    remote: tuple[tuple[int, int, Piece], ...]  # (message, output, piece), every one
    direct: tuple[tuple[int, int] | None, ...]  # per message: (output, at) received in place
    arrive: tuple[tuple[int, int, Piece], ...]  # the remote pieces placed on arrival


@functools.lru_cache(maxsize=512)
def layout(pl: Plan, windows: tuple[tuple[int, int], ...]) -> Layout:
    def where(at: int, span: int) -> tuple[int, int] | None:
        for i, (start, rows) in enumerate(windows):
            if start <= at and at + span <= start + rows:
                return i, at - start
        return None

    def moved(p: Piece) -> tuple[int, Piece] | None:
        found = where(p.at, p.span)
        return None if found is None else (found[0], dataclasses.replace(p, at=found[1]))

    zeros = [(w[0], w[1], n) for at, n in pl.zeros if (w := where(at, n)) is not None]
    local = [m for p in pl.local if (m := moved(p)) is not None]
    remote = [(i, *m) for i, p in pl.remote if (m := moved(p)) is not None]
    # A message that is one plain piece lands straight in its output rows (no copy on arrival).
    direct: list[tuple[int, int] | None] = []
    for i, (_, lo, hi) in enumerate(pl.recv):
        mine = [(w, p) for m, w, p in remote if m == i]
        plain = len(mine) == 1 and mine[0][1].rows == hi - lo
        plain = plain and not (mine[0][1].flip or mine[0][1].roll or mine[0][1].repeat)
        direct.append((mine[0][0], mine[0][1].at) if plain else None)
    return Layout(
        rows=tuple(r for _, r in windows),
        zeros=tuple(zeros),
        local=tuple(local),
        remote=tuple(remote),
        direct=tuple(direct),
        arrive=tuple((i, w, p) for i, w, p in remote if direct[i] is None),
    )
