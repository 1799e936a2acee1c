"""The kept messages of a repeated halo call (:mod:`mpidp.ops.halo_band`'s fast paths): the
first exchange with the two neighbours, each message a header (the call's agreement) and the
rows the neighbour needs (:class:`_Near`), and the outputs of an exchange that only copies
rows, as one concatenation of the band's rows and kept receive buffers (:func:`_recipe`,
:func:`_assemble`). Local: the exchanges are posted by their callers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from mpidp.comm import PendingExchange, Transport
from mpidp.ops.halo_args import _Known

if TYPE_CHECKING:
    from mpidp.ops.halo_band import _Op

__all__: list[str] = []

#: boundaries whose rows beyond the field come from the band's own rows (or none), so that a
#: thick enough partition's halo is its two neighbours' rows
_LOCAL_KINDS = frozenset({"zeros", "replicate", "reflect", "symmetric", "none"})


class _Near:
    """The learned-partition path's first exchange, prepared once per call key: one message
    to each neighbour and one from each, whatever the call (so every message meets its
    receive, even between ranks that disagree), each a header and the rows the neighbour
    needs.

    The header (:data:`_HEADER` bytes: the call's agreement checksum, whether this rank found
    a problem, its local size) is the agreement where the neighbours are the whole group (two
    ranks): every rank reads its peer's header, or finds the message of another length (a
    peer that passed other widths, dtype or shape), and both decide alike. On more ranks the
    agreement is the all-reduce beside the messages (``values``; the headers travel unread:
    one message format on every group size)."""

    def __init__(self, t: Transport, k: _Known, x: torch.Tensor, problems: list[str]) -> None:
        p, me, d = t.size, t.rank, k.d
        n = x.size(d) if x.dim() and not problems else 0
        eligible = not problems and k.b.low in _LOCAL_KINDS and k.b.high in _LOCAL_KINDS
        self.eligible = eligible = eligible and min(k.bw + k.aw) >= 0
        table = [-1] * p
        table[me] = n
        self.values = [k.checksum, -k.checksum, 1 if problems else 0, *table]
        self.header = (k.checksum, 1 if problems else 0)
        shape = x.shape if x.dim() else torch.Size([0])
        # (peer, rows this rank gives from its low or high end, rows it takes from the peer)
        peers = []
        if me > 0:  # the rank above needs this band's first rows, and has its rows before it
            peers.append((me - 1, True, k.aw[me - 1], k.bw[me]))
        if me < p - 1:
            peers.append((me + 1, False, k.bw[me + 1], k.aw[me]))
        self.d, self.n, self.problems = d, n, bool(problems)
        # per send: its kept message, the part the band's rows go to, and which rows (first
        # row, count); None for a thin band (the agreement then sends every rank to the plan)
        out: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]] = []
        recvs, self.got, self.heads = [], {}, []
        for peer, low, give, take in peers:
            give, take = (give, take) if eligible else (0, 0)
            msg, rows = _headed(_rows(shape, d, give), x, [k.checksum, self.header[1], n])
            rows.zero_()  # a stand-in where the band is too thin to give its rows
            which = (0 if low else n - give, give) if give <= n and x.dim() else None
            out.append((msg, rows, which))
            msg_in, rows_in = _headed(_rows(shape, d, take), x, [0, 0, 0])
            recvs.append((peer, msg_in))
            self.got[peer] = rows_in
            self.heads.append(msg_in[:_HEADER].view(torch.int64))
        self.peers = [peer for peer, _, _, _ in peers]
        self.exchange = t.prepare_exchange(self.peers, recvs, [msg for msg, _, _ in out])
        #: (rows of a message, the band's rows it holds) for each message that holds any
        self.copies = [(rows, which) for _, rows, which in out if which is not None and which[1]]

    def start(self, x: torch.Tensor, number: int) -> PendingExchange:
        """Post this call's messages: the band's rows copied behind the kept headers."""
        for rows, (lo, n) in self.copies:
            rows.copy_(x.narrow(self.d, lo, n))
        return self.exchange.start(None, number)

    def run(self, x: torch.Tensor, number: int) -> None:
        """:meth:`start` and its wait in one call."""
        for rows, (lo, n) in self.copies:
            rows.copy_(x.narrow(self.d, lo, n))
        self.exchange.run(number)

    def agreed(self, p: int, me: int) -> tuple[int, ...] | None:
        """Every rank's size from the peers' headers when they agree with this rank's (the
        neighbours are the whole group), else None."""
        sizes = [self.n] * p
        for peer, head in zip(self.peers, self.heads, strict=True):
            checksum, problem, n, _ = head.tolist()
            if problem or checksum != self.header[0]:
                return None
            sizes[peer] = n
        return None if self.problems else tuple(sizes)


#: bytes of the header before a neighbour message's rows (4 int64: aligns any dtype's rows)
_HEADER = 32


def _headed(
    shape: tuple[int, ...], x: torch.Tensor, header: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A message of :data:`_HEADER` bytes of header (``header``'s ints) then rows of
    ``shape`` of ``x``'s dtype: (the message's bytes, the rows as a tensor)."""
    nbytes = math.prod(shape) * x.element_size()
    msg = torch.empty(_HEADER + nbytes, dtype=torch.uint8, device=x.device)
    msg[:_HEADER].view(torch.int64).copy_(torch.tensor([*header, 0][:4], dtype=torch.int64))
    return msg, msg[_HEADER:].view(x.dtype).view(shape)


#: one output's pieces in row order: the band's rows (first row, count; None: the whole band),
#: or a tensor (rows received into a kept buffer, or zeros)
_Parts = list[tuple[int, int] | torch.Tensor | None]


def _recipe(op: _Op, bufs: list[torch.Tensor], x: torch.Tensor) -> list[_Parts] | None:
    """The outputs of a neighbours-only exchange as concatenations (one copy of each row),
    or None when a piece is not a plain copy (flipped, rolled, repeated: placed by
    :func:`_finish_fetch`)."""
    lay, d = op.layout, op.dim
    if lay.arrive or any(p.flip or p.roll or p.repeat for _, p in lay.local):
        return None
    segs: list[list[tuple[int, int, tuple[int, int] | torch.Tensor]]] = [[] for _ in lay.rows]
    for i, at, n in lay.zeros:
        segs[i].append((at, n, x.new_zeros(op.rows(x.shape, n))))
    for i, p in lay.local:
        segs[i].append((p.at, p.rows, (p.lo, p.rows)))
    for buf, direct in zip(bufs, lay.direct, strict=True):
        if direct is not None:
            segs[direct[0]].append((direct[1], buf.size(d), buf))
    out: list[_Parts] = []
    for rows, parts in zip(lay.rows, segs, strict=True):
        parts.sort(key=lambda s: s[0])
        at = 0
        for start, n, _ in parts:
            if start != at:  # rows no piece fills (cannot happen): the general placement
                return None
            at += n
        if at != rows:
            return None
        out.append([part for _, n, part in parts if n])
    return out


class Joined:
    """A recipe (:func:`_recipe`) of one output made of the band whole and kept tensors,
    ready to join: its pieces with the band's slot to fill (no narrow, no frame a call)."""

    __slots__ = ("at", "parts")

    def __init__(self, parts: list[Any], at: int) -> None:
        self.parts, self.at = parts, at

    @staticmethod
    def of(recipe: list[_Parts] | None, n: int) -> Joined | None:
        """The recipe's :class:`Joined` form for a band of ``n`` rows, or None when it has
        several outputs or takes part of the band."""
        if recipe is None or len(recipe) != 1:
            return None
        whole = (0, n)
        parts = [None if type(p) is tuple and p == whole else p for p in recipe[0]]
        if parts.count(None) != 1 or not all(p is None or type(p) is torch.Tensor for p in parts):
            return None
        return Joined(parts, parts.index(None))


def _assemble(parts: _Parts, x: torch.Tensor, d: int) -> torch.Tensor:
    """One output of a :func:`_recipe`: a new tensor (never a view of the kept buffers)."""
    if not parts:
        return x.new_empty(_rows(x.shape, d, 0))
    return torch.cat(
        [x if p is None else p if isinstance(p, torch.Tensor) else x.narrow(d, *p) for p in parts],
        d,
    )


def _rows(shape: torch.Size, d: int, n: int) -> tuple[int, ...]:
    return tuple(n if i == d else s for i, s in enumerate(shape))
