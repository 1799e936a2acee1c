"""The 1-D halo exchange engine: a range fetch along one dim over one group.

Rank r owns global rows ``[s, e)`` of a field of ``H`` rows (a :class:`~mpidp.ShardSpec`).
The exchange returns global rows ``[s - before, e + after)``, taken from whichever ranks own
them, several ranks away when shards are thinner than the halo. Negative widths trim. Rows
outside ``[0, H)`` are filled by the boundary rule of the serial layer (:class:`Boundary`).
Widths are one int for every rank, or one entry per rank.

Data moves point to point only: every rank computes the same plan from global facts (sizes,
widths, boundary; :mod:`mpidp.ops.halo_plan`), so each message has a sender and a receiver that
agree on it without any negotiation. The backward is the exact adjoint, *halo accumulate*:
every halo row's gradient goes back to the rank that owns the row and is added there (through
the boundary's mirror and roll, and summed over replicated rows). Fetch and accumulate are
each other's backward, so double backward works.

Nothing here names an axis: ``dim`` is the sharded dimension and, for the polar boundary,
``roll_dim`` the one rolled by half its size. The block exchange
(:mod:`mpidp.ops.block_halo`) is this engine once along each axis group of the grid, and
:mod:`mpidp.ops.halo` is the public entry over both; imports run that way only (halo ->
block_halo -> halo_band). The default group is the manager's domain group, on bands only: on a
grid with blocks (``P_lon > 1``) a group must be passed (an axis transport).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from mpidp.comm import PendingExchange, Transport
from mpidp.errors import CommError, ConfigError
from mpidp.ops.functions import _call, band_transport
from mpidp.ops.halo_args import _FACTS, Widths, _agree, _Known, _known_of, _raise
from mpidp.ops.halo_near import Joined, _assemble, _Near, _recipe
from mpidp.ops.halo_plan import Layout, Piece, Plan, neighbours_only
from mpidp.ops.halo_plan import layout as layout_for
from mpidp.ops.halo_plan import plan as plan_for
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec, known_for, learned

__all__ = [
    "PendingHalo",
    "band_halo_exchange",
    "halo_strips",
    "place_piece",
    "start_halo_exchange",
]

#: what the band-only refusal names (the default group is the domain group: bands)
_WHAT = "halo_exchange with one dim"


def place_piece(
    out: torch.Tensor, src: torch.Tensor, p: Piece, dim: int, roll_dim: int, half: int
) -> None:
    """Copy ``src`` (the piece's source rows) to rows ``[p.at, p.at + p.span)`` of ``out``
    along ``dim``: flipped, rolled by ``half`` along ``roll_dim``, or one row repeated, as the
    piece says. Local."""
    v = src.flip(dim) if p.flip else src
    dst = out.narrow(dim, p.at, p.span)
    if p.roll:  # the roll as two copies into place (torch.roll would copy once more)
        w = v.size(roll_dim)
        dst.narrow(roll_dim, half, w - half).copy_(v.narrow(roll_dim, 0, w - half))
        dst.narrow(roll_dim, 0, half).copy_(v.narrow(roll_dim, w - half, half))
        return
    dst.copy_(
        v.expand(tuple(p.repeat if i == dim % v.dim() else s for i, s in enumerate(v.shape)))
        if p.repeat
        else v
    )


@dataclasses.dataclass(frozen=True)
class _Op:
    """A resolved exchange: transport, plan, output layout, dims."""

    t: Transport
    plan: Plan
    layout: Layout
    dim: int
    roll_dim: int
    half: int  # roll by this many entries along roll_dim (polar)
    #: :func:`_planned`'s prepared exchange and recipe, by the input's shape, dtype, device
    fast: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def rows(self, shape: torch.Size, n: int) -> tuple[int, ...]:
        return tuple(n if i == self.dim else s for i, s in enumerate(shape))

    def place(self, out: torch.Tensor, src: torch.Tensor, p: Piece) -> None:
        place_piece(out, src, p, self.dim, self.roll_dim, self.half)

    def unplace(self, g: torch.Tensor, p: Piece) -> torch.Tensor:
        """Adjoint of :meth:`place`: the gradient of the piece's source rows."""
        v = g.narrow(self.dim, p.at, p.span)
        if p.repeat:
            v = v.sum(self.dim, keepdim=True)
        if p.roll:
            v = v.roll(-self.half, self.roll_dim)
        return v.flip(self.dim) if p.flip else v


_Started = tuple[PendingExchange, list[torch.Tensor], list[torch.Tensor], int]


def _start_fetch(op: _Op, x: torch.Tensor) -> _Started:
    """Allocate the outputs, post the messages (each received in place where it can be).

    Every rank of the group starts the same fetches in the same order, so the count of them
    names each one alike on every rank: its messages carry 2 x that count in their tags, the
    backward's (:func:`_accumulate`) one more. A rank that skipped a backward its peer runs
    never feeds the peer another exchange's rows, and the two waits are told apart (and the
    job ended at once) by :mod:`mpidp.comm.alarm`."""
    op.t.fetches += 1
    number = 2 * op.t.fetches
    plan, lay = op.plan, op.layout
    outs = [op.t.scratch(op.rows(x.shape, n), x.dtype, x.device) for n in lay.rows]
    bufs = [
        outs[d[0]].narrow(op.dim, d[1], hi - lo)
        if d is not None
        else op.t.scratch(op.rows(x.shape, hi - lo), x.dtype, x.device)
        for (_, lo, hi), d in zip(plan.recv, lay.direct, strict=True)
    ]
    sends = [(peer, x.narrow(op.dim, lo, hi - lo)) for peer, lo, hi in plan.send]
    recvs = [(peer, buf) for (peer, _, _), buf in zip(plan.recv, bufs, strict=True)]
    return op.t.start_exchange(sends, recvs, number), bufs, outs, number


def _finish_fetch(op: _Op, x: torch.Tensor, started: _Started) -> list[torch.Tensor]:
    pending, bufs, outs, _ = started
    lay = op.layout
    for i, at, n in lay.zeros:
        outs[i].narrow(op.dim, at, n).zero_()
    for i, p in lay.local:  # the band itself: copied while the messages travel
        op.place(outs[i], x.narrow(op.dim, p.lo, p.rows), p)
    pending.wait()
    for m, i, p in lay.arrive:
        op.place(outs[i], bufs[m].narrow(op.dim, p.lo - op.plan.recv[m][1], p.rows), p)
    return outs


def _accumulate(
    op: _Op, gs: Sequence[torch.Tensor], x_shape: torch.Size, number: int = 0
) -> torch.Tensor:
    """The halo's backward whole: :func:`start_accumulate`, then the band's gradient (the
    piece that is the band itself copied once instead of zeros + add) and the rest of
    :func:`finish_accumulate`."""
    pending, bufs, _ = start_accumulate(op, gs, number)
    n, g0 = x_shape[op.dim], gs[0]
    local = list(op.layout.local)
    band = next((k for k, (_, p) in enumerate(local) if _is_band(p, n)), None)
    if band is not None:
        i, p = local.pop(band)
        out = op.unplace(gs[i], p).clone(memory_format=torch.contiguous_format)
    else:
        out = g0.new_zeros(op.rows(g0.shape, n))
    _add_arrived(op, local, (pending, bufs, gs), out)
    return out


#: an accumulate in flight (:func:`start_accumulate`): the exchange, its receive buffers, the
#: gradients of the fetch's outputs
Accumulating = tuple[PendingExchange, list[torch.Tensor], Sequence[torch.Tensor]]


def start_accumulate(op: _Op, gs: Sequence[torch.Tensor], number: int = 0) -> Accumulating:
    """The first half of the halo's backward, split around the caller's compute: post the
    messages that send every halo row's gradient (``gs``: the gradients of the fetch's
    outputs) to the rank that owns the row. ``number``: the fetch's (its messages carry one
    more). :func:`finish_accumulate` completes it."""
    plan, lay, g0 = op.plan, op.layout, gs[0]
    back = [
        gs[d[0]].narrow(op.dim, d[1], hi - lo)  # a plain piece: its gradient as it is
        if d is not None
        else g0.new_zeros(op.rows(g0.shape, hi - lo))
        for (_, lo, hi), d in zip(plan.recv, lay.direct, strict=True)
    ]
    for m, i, p in lay.arrive:
        back[m].narrow(op.dim, p.lo - plan.recv[m][1], p.rows).add_(op.unplace(gs[i], p))
    bufs = [g0.new_empty(op.rows(g0.shape, hi - lo)) for _, lo, hi in plan.send]
    pending = op.t.start_exchange(
        [(peer, b) for (peer, _, _), b in zip(plan.recv, back, strict=True)],
        [(peer, b) for (peer, _, _), b in zip(plan.send, bufs, strict=True)],
        number + 1 if number else 0,
    )
    return pending, bufs, gs


def finish_accumulate(op: _Op, started: Accumulating, out: torch.Tensor) -> None:
    """The second half: add to ``out`` (the gradient of this rank's band, owned by the
    caller) the halo rows taken from the band itself (a boundary's mirror), wait for the
    peers' rows and add them where they live."""
    _add_arrived(op, op.layout.local, started, out)


def _add_arrived(
    op: _Op, local: Sequence[tuple[int, Piece]], started: Accumulating, out: torch.Tensor
) -> None:
    """Add the ``local`` pieces' gradients to ``out``, wait, add the peers' rows."""
    pending, bufs, gs = started
    for i, p in local:
        out.narrow(op.dim, p.lo, p.rows).add_(op.unplace(gs[i], p))
    pending.wait()
    for (_, lo, hi), buf in zip(op.plan.send, bufs, strict=True):
        out.narrow(op.dim, lo, hi - lo).add_(buf)


def _is_band(p: Piece, n: int) -> bool:
    """A piece that is this rank's whole band, as it is."""
    return p.lo == 0 and p.hi == n and not (p.flip or p.roll or p.repeat)


def _one_or_tuple(outs: list[torch.Tensor]) -> Any:
    return outs[0] if len(outs) == 1 else tuple(outs)


class _HaloFetch(torch.autograd.Function):
    """The extended band (or its strips); backward is halo accumulate (gradients added where
    the rows live)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: _Op, started: _Started | None) -> Any:
        started = started if started is not None else _start_fetch(op, x)
        ctx.op, ctx.x_shape, ctx.number = op, x.shape, started[3]
        return _one_or_tuple(_finish_fetch(op, x, started))

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> Any:
        return _call(_HaloAccumulate, ctx.op, ctx.x_shape, ctx.number, *gs), None, None


class _HaloAccumulate(torch.autograd.Function):
    """Adjoint of the fetch: every fetched row's value added to the row it came from."""

    @staticmethod
    def forward(ctx: Any, op: _Op, x_shape: torch.Size, number: int, *gs: torch.Tensor) -> Any:
        ctx.op = op
        return _accumulate(op, gs, x_shape, number)

    @staticmethod
    def backward(ctx: Any, gg: torch.Tensor) -> Any:
        outs = _HaloFetch.apply(gg, ctx.op, None)
        return None, None, None, *(outs if isinstance(outs, tuple) else (outs,))


# -- arguments: checked on every rank, agreed in one small all-gather -----------------------


def _op_for(k: _Known, sizes: tuple[int, ...], t: Transport, x: torch.Tensor, strips: bool) -> _Op:
    plan = plan_for(sizes, k.bw, k.aw, k.b, t.rank)
    if not strips:
        windows: tuple[tuple[int, int], ...] = ((0, plan.length),)
    elif min(k.bw + k.aw) < 0:
        raise ConfigError(
            f"halo strips need widths >= 0 on every rank, got before={k.bw}, after={k.aw}; use "
            f"halo_exchange for widths that trim"
        )
    else:
        me = t.rank
        windows = ((0, k.bw[me]), (plan.length - k.aw[me], k.aw[me]))
    layout = layout_for(plan, windows)
    return _Op(t, plan, layout, k.d, k.rd, x.size(k.rd) // 2 if k.b.polar else 0)


def _op_of(k: _Known, sizes: tuple[int, ...], t: Transport, x: torch.Tensor, strips: bool) -> _Op:
    op = k.ops.get(sizes)
    if op is None:
        op = _op_for(k, sizes, t, x, strips)
        if len(k.ops) > 64:
            k.ops.clear()
        k.ops[sizes] = op
    return op


def _resolve(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int,
    spec: ShardSpec | Sequence[int] | None,
    manager: DistributedManager | None,
    boundary: Any,
    group: Any,
    roll_dim: int,
    strips: bool = False,
    t: Transport | None = None,
) -> _Op:
    """The exchange a call makes, its arguments checked on every rank and agreed.

    The agreement is the same every call (one all-gather of 3 ints, or none once a spec that
    travels with the tensor was agreed): what is kept by the call's key is only what this rank
    would derive again (checks, facts, checksum, plan, layout), so whether a call repeats or
    not never changes what is sent, and a rank that passes something else with a key it has
    seen before still meets the others in the same all-gather and fails with them."""
    if t is None:
        t = band_transport(group if group is not None else manager, x.device, _WHAT)
    k, problems = _known_of(t, x, before, after, dim, spec, boundary, roll_dim, strips)
    d, known = k.d, k.spec
    if known is not None and not problems and known_for(x, d) == known:
        # the spec travels with the tensor (a ShardedTensor): agree once per distinct call
        # (kept on the real transport: a counting wrapper around it shares what was agreed)
        agreed = _agreed(t)
        if k.facts not in agreed:
            _agree(t, x.size(d), problems, k.facts)
            if len(agreed) > 4096:  # a new set: the layers' plans kept with the old one lapse
                agreed = getattr(t, "inner", t).__dict__["_halo_agreed"] = set()
            agreed.add(k.facts)
        sizes = known.sizes
    elif problems or t.size == 1:
        sizes = tuple(_agree(t, x.size(d) if x.dim() else 0, problems, k.facts))
    else:  # the agreement's all-gather, with the checksum kept
        table = t.all_gather_ints([x.size(d), 0, k.checksum])
        if any(row[1] or row[2] != k.checksum for row in table):
            _raise(t, t.disagreeing(problems, dict(zip(_FACTS, k.facts, strict=True))))
        sizes = tuple(row[0] for row in table)
    return _op_of(k, known.sizes if known is not None else sizes, t, x, strips)


def _fetch_now(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int,
    spec: ShardSpec | Sequence[int] | None,
    manager: DistributedManager | None,
    boundary: Any,
    group: Any,
    roll_dim: int,
    strips: bool = False,
) -> Any:
    """The exchange in one go (:func:`band_halo_exchange`, :func:`halo_strips`).

    Without a spec, over MPI, the partition is learned and the arguments agreed while a first
    exchange with the two neighbours is made: every rank sends one message to each neighbour
    and receives one from each, whatever it was passed (so every message meets its receive,
    even between ranks that disagree), holding the rows a neighbour needs when every rank's
    halo comes from its neighbours alone, behind a header (:mod:`~mpidp.ops.halo_near`). On
    two ranks the headers are the agreement; on more, one small all-reduce made while the
    messages travel.
    Every rank decides from what the agreement gives (the same everywhere) whether that
    exchange was the halo; if not (thin shards, a circular or polar boundary) the planned
    exchange follows, and when the arguments disagree every rank raises. Otherwise: checks and
    agreement, then the planned exchange (:func:`_resolve`)."""
    t = band_transport(group if group is not None else manager, x.device, _WHAT)
    check = getattr(t, "max_ints", None)
    if spec is not None or check is None or t.size == 1:
        op = _resolve(x, before, after, dim, spec, manager, boundary, group, roll_dim, strips, t)
        return _planned(x, op)
    k, problems = _known_of(t, x, before, after, dim, None, boundary, roll_dim, strips)
    near = k.near
    if near is None or problems:
        near = _Near(t, k, x, problems)
        if not problems:
            k.near = near
    t.fetches += 1
    number = 2 * t.fetches
    sizes: tuple[int, ...] | None = None
    if t.size == 2:  # the peer's header is the agreement: the exchange in one call
        try:
            near.run(x, number)
        except CommError:  # a message of another length: the peer passed other widths or rows
            pass
        else:
            sizes = near.agreed(2, t.rank)
    else:  # the neighbours are not the whole group: an all-reduce beside the messages agrees
        pending = near.start(x, number)
        agreed = check(near.values, _CHECK)
        if not agreed[2] and agreed[0] == -agreed[1]:
            sizes = tuple(agreed[3:])
        try:
            pending.wait()
        except CommError:  # as above
            sizes = None
    if sizes is None:
        _raise(t, t.disagreeing(problems, dict(zip(_FACTS, k.facts, strict=True))))
    last = k.last
    if last is None or last[0] != sizes:  # another partition than the last call's
        op = _op_of(k, sizes, t, x, strips)
        last = (sizes, ShardSpec(sizes), op, False, None, None)
        if near.eligible and neighbours_only(sizes, k.bw, k.aw, k.b):
            bufs = [near.got[peer] for peer, _, _ in op.plan.recv]
            recipe = _recipe(op, bufs, x)
            last = (sizes, last[1], op, True, recipe, Joined.of(recipe, x.size(k.d)))
        k.last = last
    _, learnt, op, done, recipe, joined = last
    learned(x, k.d, learnt)  # the partition the agreement learned: a layer reads it next
    if not done:  # the plan's exchange, numbered anew
        return _planned(x, op)
    if recipe is not None and not (torch.is_grad_enabled() and x.requires_grad):
        if joined is not None:  # one output: received rows around the whole band
            parts = joined.parts.copy()
            parts[joined.at] = x
            return torch.cat(parts, k.d)
        return _one_or_tuple([_assemble(parts, x, k.d) for parts in recipe])
    bufs = [near.got[peer] for peer, _, _ in op.plan.recv]
    outs = [t.scratch(op.rows(x.shape, rows), x.dtype, x.device) for rows in op.layout.rows]
    for buf, direct in zip(bufs, op.layout.direct, strict=True):
        if direct is not None:  # received in place by the planned exchange: placed here
            outs[direct[0]].narrow(k.d, direct[1], buf.size(k.d)).copy_(buf)
    return _call(_HaloFetch, x, op, (PendingExchange(None), bufs, outs, number))


def _agreed(t: Transport) -> set[Any]:
    """The facts of the calls with a known partition agreed over ``t`` (kept on the real
    transport: a counting wrapper around it shares what was agreed). Replaced, never cleared,
    when it grows too large: a plan kept with it (:func:`kept_fetch`) holds the set it was
    agreed in and serves while that is the transport's."""
    box = getattr(t, "inner", t).__dict__
    agreed = box.get("_halo_agreed")
    if agreed is None:
        agreed = box["_halo_agreed"] = set()
    return agreed


class _Fast:
    """:func:`_planned`'s exchange of one op for one input shape: an exchange prepared once
    with kept send and receive buffers, and the outputs' concatenation recipe. A call copies
    the rows to send, runs the exchange (numbered as every fetch is) and concatenates."""

    __slots__ = ("back", "d", "exchange", "joined", "op", "recipe", "sends")

    def __init__(self, op: _Op, x: torch.Tensor, recvs: list[tuple[int, torch.Tensor]]) -> None:
        pl, d = op.plan, op.dim
        recipe = _recipe(op, [buf for _, buf in recvs], x)
        assert recipe is not None
        n = x.size(d)
        # the band itself, whole, is a piece as it is (no narrow a call)
        self.recipe = recipe
        self.joined = Joined.of(recipe, n)
        self.sends = [(x.new_empty(op.rows(x.shape, b - a)), a, b - a) for _, a, b in pl.send]
        sends = [buf for buf, _, _ in self.sends]
        self.exchange = op.t.prepare_exchange([peer for peer, _, _ in pl.send], recvs, sends)
        self.op, self.d = op, d
        self.back: _Back | bool | None = False  # made at the first backward (_KeptFetch)

    def __call__(self, x: torch.Tensor) -> Any:
        t, d = self.op.t, self.d
        for buf, lo, n in self.sends:
            buf.copy_(x.narrow(d, lo, n))
        t.fetches += 1
        self.exchange.run(2 * t.fetches)
        joined = self.joined
        if joined is not None:  # one output: received rows around the whole band
            parts = joined.parts.copy()
            parts[joined.at] = x
            return torch.cat(parts, d)
        if len(self.recipe) == 1:
            return _assemble(self.recipe[0], x, d)
        return tuple(_assemble(parts, x, d) for parts in self.recipe)


class _Back:
    """The backward of a :class:`_Fast` exchange of one output around the whole band (its
    ``joined`` recipe): halo accumulate through an exchange prepared once, the reverse of the
    forward's (each received row's gradient sent back to its owner, into kept buffers). The
    same messages, sums and order as :func:`_accumulate` on this layout: the band's own
    gradient copied, then the peers' rows added where they live, in the plan's order."""

    __slots__ = ("at", "bufs", "d", "exchange", "n", "offsets", "sends")

    def __init__(self, fast: _Fast, x_shape: torch.Size, g: torch.Tensor) -> None:
        op = fast.op
        pl, lay, d = op.plan, op.layout, op.dim
        self.d, self.n = d, x_shape[d]
        self.at = next(p.at for _, p in lay.local if _is_band(p, self.n))
        #: (kept send buffer, its rows' start in the extended band) per peer sent back to
        self.sends = [
            (g.new_empty(op.rows(g.shape, hi - lo)), direct[1])
            for (_, lo, hi), direct in zip(pl.recv, lay.direct, strict=True)
            if direct is not None
        ]
        #: (kept receive buffer, where its rows start in the band) per peer that sends back
        self.bufs = [(g.new_empty(op.rows(g.shape, hi - lo)), lo) for _, lo, hi in pl.send]
        self.exchange = op.t.prepare_exchange(
            [peer for peer, _, _ in pl.recv],
            [(peer, buf) for (peer, _, _), (buf, _) in zip(pl.send, self.bufs, strict=True)],
            [buf for buf, _ in self.sends],
        )

    @staticmethod
    def of(fast: _Fast, x_shape: torch.Size, g: torch.Tensor) -> _Back | None:
        """``fast``'s backward, made at its first call; None when it takes the general one
        (several outputs, a received piece placed otherwise than whole)."""
        back = fast.back
        if back is False:
            lay = fast.op.layout
            lean = fast.joined is not None and all(d is not None for d in lay.direct)
            back = fast.back = _Back(fast, x_shape, g) if lean else None
        return back  # type: ignore[return-value]

    def __call__(self, g: torch.Tensor, number: int) -> torch.Tensor:
        d = self.d
        for buf, at in self.sends:
            buf.copy_(g.narrow(d, at, buf.size(d)))
        out = g.narrow(d, self.at, self.n).clone(memory_format=torch.contiguous_format)
        self.exchange.run(number + 1 if number else 0)
        for buf, lo in self.bufs:
            out.narrow(d, lo, buf.size(d)).add_(buf)
        return out


class _KeptFetch(torch.autograd.Function):
    """:class:`_HaloFetch` through an op's :class:`_Fast` exchange (a gradient's calls): the
    prepared messages and the concatenation forward (new tensors, never views of the kept
    buffers); the same backward, halo accumulate (through a prepared exchange too, :class:`_Back`,
    unless a graph is being made), numbered as the forward's exchange (``2 x`` the
    transport's count, which :meth:`_Fast.__call__` advanced) plus one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fast: _Fast) -> Any:
        out = fast(x)
        ctx.fast, ctx.x_shape, ctx.number = fast, x.shape, 2 * fast.op.t.fetches
        return out

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> Any:
        fast = ctx.fast
        graph = torch.is_grad_enabled() and any(g.requires_grad for g in gs)
        back = None if graph else _Back.of(fast, ctx.x_shape, gs[0])
        if back is None:  # (making a graph: the accumulate as a Function, double backward)
            return _call(_HaloAccumulate, fast.op, ctx.x_shape, ctx.number, *gs), None
        return back(gs[0], ctx.number), None


def _fast_of(op: _Op, x: torch.Tensor) -> _Fast | None:
    """The op's :class:`_Fast` exchange for ``x``'s shape, dtype and device, made at the first
    call; None when an output is not a concatenation (:func:`_recipe`)."""
    kept = op.fast
    key = (x.shape, x.dtype, x.device)
    fast = kept.get(key, False)
    if fast is False:
        recvs = [(peer, x.new_empty(op.rows(x.shape, hi - lo))) for peer, lo, hi in op.plan.recv]
        fast = _Fast(op, x, recvs) if _recipe(op, [b for _, b in recvs], x) is not None else None
        if len(kept) > 16:
            kept.clear()
        kept[key] = fast
    return fast


def _planned(x: torch.Tensor, op: _Op) -> Any:
    """The plan's exchange, made in one go: when its outputs are concatenations
    (:func:`_recipe`), through its :class:`_Fast` exchange (with a gradient, as
    :class:`_KeptFetch`); otherwise :class:`_HaloFetch`."""
    fast = _fast_of(op, x)
    if fast is None:
        return _call(_HaloFetch, x, op, None)
    if torch.is_grad_enabled() and x.requires_grad:
        return _KeptFetch.apply(x, fast)
    return fast(x)


class Kept(NamedTuple):
    """A layer's halo exchange kept for its repeated calls (:func:`kept_fetch`): ``fetch``
    makes the exchange the call made, with no agreement, while ``agreed`` is the transport's
    set of agreed facts (``box["_halo_agreed"]``)."""

    fetch: Callable[[torch.Tensor], Any]
    box: dict[str, Any]
    agreed: set[Any]


def kept_fetch(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int,
    spec: ShardSpec,
    boundary: Any,
    t: Transport,
    roll_dim: int = -1,
) -> Kept | None:
    """The exchange :func:`band_halo_exchange` makes for these arguments (``spec`` the band's
    known partition, :func:`~mpidp.runtime.partition.known_for`), for a layer to repeat
    without its resolution, or None when a call of these arguments is not one a repeat can
    skip to: one whose facts are not yet agreed (its first), or whose spec does not travel
    with the tensor (those agree on every call). Call it after such a call returned; the
    repeat makes the same messages, numbered alike, and with a gradient the same backward."""
    k, problems = _known_of(t, x, before, after, dim, spec, boundary, roll_dim, False)
    if problems or k.spec is None or known_for(x, k.d) != k.spec:
        return None
    agreed = _agreed(t)
    if k.facts not in agreed:
        return None
    op = _op_of(k, k.spec.sizes, t, x, False)
    box = getattr(t, "inner", t).__dict__
    fast = _fast_of(op, x)
    if fast is None:  # (as _planned: outputs that are not concatenations)
        return Kept(lambda band: _call(_HaloFetch, band, op, None), box, agreed)
    if torch.is_grad_enabled() and x.requires_grad:  # (a kept call's key holds the grad flag)
        return Kept(lambda band: _call(_KeptFetch, band, fast), box, agreed)
    return Kept(fast, box, agreed)


_CHECK = "a halo exchange's agreement (an all-reduce beside the neighbours' rows)"


# -- the 1-D exchange -----------------------------------------------------------------------------


class PendingHalo:
    """A halo exchange in flight (:func:`start_halo_exchange`): compute, then :meth:`wait`.

    The messages are posted when this object is made. Until :meth:`wait` the input tensor must
    not be modified in place. Every rank must start its exchanges in the same order (messages
    between two ranks match in posting order) and call :meth:`wait` on each, in any order.
    """

    def __init__(self, x: torch.Tensor, op: _Op) -> None:
        self._x, self._op = x, op
        self._started: _Started | None = _start_fetch(op, x)

    @property
    def length(self) -> int:
        """Rows of the extended band along the sharded dim."""
        return self._op.plan.length

    def wait(self) -> Any:
        """The extended band, or the ``(low, high)`` strips when started with ``strips=True``
        (differentiable, as :func:`mpidp.halo_exchange`). Call once."""
        if self._started is None:
            raise CommError("PendingHalo.wait() was already called; it returns the band once")
        started, self._started = self._started, None
        return _call(_HaloFetch, self._x, self._op, started)


def start_halo_exchange(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int = -2,
    spec: ShardSpec | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    boundary: Any = "zeros",
    *,
    group: Any = None,
    roll_dim: int = -1,
    strips: bool = False,
) -> PendingHalo:
    """:func:`mpidp.halo_exchange` (or with ``strips=True`` :func:`halo_strips`) in two halves: post
    the messages now, ``.wait()`` for the result.

    Between the two the caller computes what needs no halo (a convolution's interior rows).
    The checks and the agreement all-gather happen here, before anything is posted.
    """
    op = _resolve(x, before, after, dim, spec, manager, boundary, group, roll_dim, strips)
    return PendingHalo(x, op)


def band_halo_exchange(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int = -2,
    spec: ShardSpec | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    boundary: Any = "zeros",
    *,
    group: Any = None,
    roll_dim: int = -1,
) -> torch.Tensor:
    """:func:`mpidp.halo_exchange` along one dim ``dim`` over ``group`` (default: the domain
    group of ``manager``): same arguments, result, adjoint and errors. Collective over the
    group."""
    return _fetch_now(x, before, after, dim, spec, manager, boundary, group, roll_dim)


def halo_strips(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int = -2,
    spec: ShardSpec | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    boundary: Any = "zeros",
    *,
    group: Any = None,
    roll_dim: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the rows :func:`mpidp.halo_exchange` would add: ``(low, high)``, global rows
    ``[start - before, start)`` and ``[stop, stop + after)``, without copying the band itself.

    For layers that compute their interior from the band directly and only the edge rows from
    the strips (the band copy costs far more than the exchange on large fields). Widths must be
    >= 0. Same arguments, errors and adjoint as :func:`mpidp.halo_exchange`; collective likewise.
    """
    low, high = _fetch_now(x, before, after, dim, spec, manager, boundary, group, roll_dim, True)
    return low, high
