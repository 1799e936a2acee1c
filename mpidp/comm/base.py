"""The transport interface: the data movement every later layer is written against.

A transport is bound to one group of ranks (a domain group, a data-parallel group, the world)
and speaks in ranks of that group. Tensors are split along any ``dim``; ``sizes`` give the
extent of every rank's part along it, uneven and zero sizes included. Validation, dimension
handling and the one-rank shortcut live here, once; a backend implements the primitives on
contiguous tensors whose split dimension is dimension 0.

Every method is collective over the transport's group unless its docstring says otherwise.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

# the agreement's helpers, re-exported where their callers have always imported them
from mpidp.comm.agreement import disagreement as disagreement
from mpidp.comm.agreement import facts_checksum as facts_checksum
from mpidp.comm.agreement import fingerprint as fingerprint
from mpidp.comm.agreement import pair_weight as pair_weight
from mpidp.errors import CommError

__all__ = ["PendingExchange", "PreparedExchange", "Transport", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")

# Reductions of these types accumulate in float32 and are cast back.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _to_front(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Contiguous view or copy whose dimension 0 is ``dim`` (no copy when already so laid out)."""
    if dim == 0 and tensor.is_contiguous():
        return tensor.detach()
    return tensor.detach().movedim(dim, 0).contiguous()


def _from_front(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Undo :func:`_to_front`'s move (a view)."""
    return tensor if dim == 0 else tensor.movedim(0, dim)


class PendingExchange:
    """Messages posted by :meth:`Transport.start_exchange`; ``wait()`` completes them (once)."""

    def __init__(self, waiter: Callable[[], None] | None) -> None:
        self._waiter = waiter

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has completed (or there was nothing to wait for)."""
        return self._waiter is None

    def wait(self) -> None:
        """Block until every posted message is complete; later calls return at once."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter()


class PreparedExchange:
    """An exchange made again and again with the same peers and the same receive buffers
    (:meth:`Transport.prepare_exchange`): what :meth:`Transport.start_exchange` checks and
    derives on every call is done once here, and :meth:`start` posts the messages.

    This generic form is :meth:`Transport.start_exchange` itself (a wrapping transport, such
    as the counting one, sees every message); a backend may keep more (the MPI one keeps its
    buffers' addresses, tags and byte counts)."""

    def __init__(
        self,
        t: Transport,
        send_peers: Sequence[int],
        recvs: Sequence[tuple[int, torch.Tensor]],
        sends: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.t, self.peers, self.recvs = t, tuple(send_peers), list(recvs)
        self.sends = None if sends is None else list(sends)

    def start(self, sends: Sequence[torch.Tensor] | None, number: int = 0) -> PendingExchange:
        """Post ``sends`` (one tensor per send peer, in order; None: the kept send buffers
        given to :meth:`Transport.prepare_exchange`) and the receives into the prepared
        buffers; ``wait()`` on the result, as for :meth:`Transport.start_exchange`. The
        buffers are reused by the next call: read them before it, and write the kept send
        buffers only after the last call's ``wait()``."""
        sends = self.sends if sends is None else sends
        assert sends is not None, "no send buffers were kept: pass them"
        return self.t.start_exchange(list(zip(self.peers, sends, strict=True)), self.recvs, number)

    def run(self, number: int = 0) -> None:
        """:meth:`start` with the kept send buffers, and its wait: the exchange in one call."""
        self.start(None, number).wait()


class Transport(abc.ABC):
    """Collectives over one group of ranks.

    Attributes
    ----------
    name: ``"mpi"`` or ``"torch"``.
    rank: this process's rank in the group.
    size: number of ranks in the group.
    """

    name: str = "abstract"
    #: whether a check that fails on one rank can be reported on every rank of the call
    #: (the MPI transport folds it into the call's fingerprint); otherwise it raises there
    reports_everywhere: bool = False
    #: every rank holds the whole gradient of a plain tensor used on this group's bands
    #: (PhysicsNeMo's and DTensor's convention, mpidp.runtime.adopt); else this rank's share
    whole: bool = False

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        #: halo fetches started over this transport (mpidp.ops.halo_band numbers exchanges by it)
        self.fetches = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    # -- checks -------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"rank {self.rank} of {self.size}"

    def _dim(self, tensor: torch.Tensor, dim: int) -> int:
        if not -tensor.dim() <= dim < max(tensor.dim(), 1):
            raise CommError(
                f"{self._where()}: dim {dim} is out of range for a {tensor.dim()}-d tensor of "
                f"shape {tuple(tensor.shape)}; pass a dim in [{-tensor.dim()}, {tensor.dim()})"
            )
        return dim % tensor.dim()

    def _sizes(self, sizes: Sequence[int], what: str = "sizes") -> list[int]:
        out = [int(s) for s in sizes]
        if len(out) != self.size:
            raise CommError(
                f"{self._where()}: expecting {self.size} {what}, one per rank, got {len(out)} "
                f"({out}); pass one entry per rank of this group"
            )
        if any(s < 0 for s in out):
            raise CommError(f"{self._where()}: negative entry in {what} {out}")
        return out

    def _local(self, tensor: torch.Tensor, dim: int, expected: int, what: str) -> None:
        if tensor.size(dim) != expected:
            raise CommError(
                f"{self._where()}: tensor of shape {tuple(tensor.shape)} has {tensor.size(dim)} "
                f"entries along dim {dim} but {what} = {expected}; pass the sizes of the "
                f"partition this tensor belongs to"
            )

    def _stand_in(
        self, tensor: torch.Tensor, dim: int, expected: int, what: str
    ) -> tuple[torch.Tensor, str | None]:
        """``tensor`` and None when it has ``expected`` entries along ``dim``. Otherwise, when
        the transport reports problems everywhere, zeros of the expected shape (so this rank
        still takes part) and the problem, which the call raises on every rank; else raises."""
        try:
            self._local(tensor, dim, expected, what)
        except CommError as err:
            if self.size == 1 or not self.reports_everywhere:
                raise
            shape = list(tensor.shape)
            shape[dim] = expected
            return tensor.new_zeros(shape), str(err)
        return tensor, None

    @staticmethod
    def _op(op: str) -> str:
        if op not in REDUCE_OPS:
            raise CommError(f"unknown reduction {op!r}; use one of {', '.join(REDUCE_OPS)}")
        return op

    # -- public collectives -------------------------------------------------------------------

    def all_gather_v(
        self, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0
    ) -> torch.Tensor:
        """Concatenate every rank's part along ``dim``; every rank gets the whole tensor."""
        dim = self._dim(tensor, dim)
        sizes = self._sizes(sizes)
        tensor, problem = self._stand_in(tensor, dim, sizes[self.rank], f"sizes[{self.rank}]")
        if self.size == 1:
            return tensor.detach()
        return _from_front(self._all_gather_v(_to_front(tensor, dim), sizes, problem), dim)

    def kept_all_gather_v(
        self, tensor: torch.Tensor, sizes: Sequence[int], dim: int
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """After :meth:`all_gather_v` ran with these arguments and returned: a function that
        does the same for a tensor of ``tensor``'s shape, dtype, device and layout, from what
        the transport kept of that call (its checks passed, its plan made), or None when it
        keeps nothing (then call :meth:`all_gather_v`). Its call is collective, as
        :meth:`all_gather_v`'s, and keeps its agreement of every rank's arguments. Local."""
        return None

    def gather_v(
        self, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0, dst: int = 0
    ) -> torch.Tensor | None:
        """Concatenate every rank's part along ``dim`` on rank ``dst``; others get None."""
        dim = self._dim(tensor, dim)
        sizes = self._sizes(sizes)
        self._root(dst, "dst")
        tensor, problem = self._stand_in(tensor, dim, sizes[self.rank], f"sizes[{self.rank}]")
        if self.size == 1:
            return tensor.detach()
        out = self._gather_v(_to_front(tensor, dim), sizes, dst, problem)
        return _from_front(out, dim) if out is not None else None

    def scatter_v(
        self,
        tensor: torch.Tensor | None,
        sizes: Sequence[int],
        dim: int = 0,
        src: int = 0,
        *,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Split ``src``'s tensor along ``dim`` by ``sizes``; rank i gets part i.

        Ranks other than ``src`` may pass None. Their result's shape and dtype come from
        ``src`` by one small broadcast, unless every rank passes the full ``shape`` and
        ``dtype`` (then ``dim`` must be the same on every rank, negative or not).
        """
        sizes = self._sizes(sizes)
        self._root(src, "src")
        if self.size == 1:
            if tensor is None:
                raise CommError(f"{self._where()}: scatter_v from src {src} got None")
            dim = self._dim(tensor, dim)
            self._local(tensor, dim, sizes[0], "sum(sizes)")
            return tensor.detach()
        if shape is None or dtype is None:
            # the source's own checks travel in the broadcast every rank takes part in, so a
            # bad tensor on the source raises on every rank instead of leaving them waiting
            meta: Any = None
            if self.rank == src:
                try:
                    if tensor is None:
                        raise CommError(
                            f"{self._where()}: scatter_v src {src} passed None; pass the tensor"
                        )
                    dim = self._dim(tensor, dim)
                    self._local(tensor, dim, sum(sizes), "sum(sizes)")
                    meta = (tuple(tensor.shape), tensor.dtype, dim)
                except CommError as err:
                    meta = str(err)
            meta = self.broadcast_object(meta, src)
            if isinstance(meta, str):
                raise CommError(meta if self.rank == src else f"{self._where()}: from {meta}")
            shape, dtype, dim = meta
        elif self.rank == src:
            if tensor is None:
                raise CommError(
                    f"{self._where()}: scatter_v src {src} passed None; pass the tensor"
                )
            dim = self._dim(tensor, dim)
            self._local(tensor, dim, sum(sizes), "sum(sizes)")
        else:
            dim %= len(shape)
        assert shape is not None and dtype is not None
        front = _to_front(tensor, dim) if self.rank == src and tensor is not None else None
        rest = (*shape[:dim], *shape[dim + 1 :])
        device = tensor.device if tensor is not None else self.default_device
        out = self._scatter_v(front, sizes, src, tuple(rest), dtype, device)
        return _from_front(out, dim)

    def reduce_scatter_v(
        self, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0, op: str = "sum"
    ) -> torch.Tensor:
        """Reduce every rank's whole tensor element-wise, then split along ``dim`` by ``sizes``:
        rank i gets part i of the reduction. float16/bfloat16 accumulate in float32."""
        op = self._op(op)
        dim = self._dim(tensor, dim)
        sizes = self._sizes(sizes)
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise CommError(f"{self._where()}: avg of a {tensor.dtype} tensor; use sum")
        tensor, problem = self._stand_in(tensor, dim, sum(sizes), "sum(sizes)")
        if self.size == 1:
            return tensor.detach()
        low = tensor.dtype in _LOW_PRECISION
        work = _to_front(tensor.to(torch.float32) if low else tensor, dim)
        out = self._reduce_scatter_v(work, sizes, "sum" if op == "avg" else op, problem)
        if op == "avg":
            out /= self.size
        return _from_front(out.to(tensor.dtype) if low else out, dim)

    def all_to_all_v(
        self,
        tensor: torch.Tensor,
        send_sizes: Sequence[int],
        recv_sizes: Sequence[int],
        dim: int = 0,
    ) -> torch.Tensor:
        """Send part j of ``tensor`` (split along ``dim`` by ``send_sizes``) to rank j; receive
        ``recv_sizes[i]`` entries from rank i, concatenated along ``dim`` in rank order."""
        dim = self._dim(tensor, dim)
        send = self._sizes(send_sizes, "send_sizes")
        recv = self._sizes(recv_sizes, "recv_sizes")
        tensor, problem = self._stand_in(tensor, dim, sum(send), "sum(send_sizes)")
        if self.size == 1:
            self._local(tensor, dim, recv[0], "recv_sizes[0]")
            return tensor.detach()
        out = self._all_to_all_v(_to_front(tensor, dim), send, recv, problem)
        return _from_front(out, dim)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Element-wise reduction over the group; returns a new tensor (the input is untouched).

        float16/bfloat16 accumulate in float32. ``avg`` of an integer tensor is refused.
        """
        op = self._op(op)
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise CommError(f"{self._where()}: avg of a {tensor.dtype} tensor; use sum")
        work = tensor.detach()
        low = work.dtype in _LOW_PRECISION
        if low:
            work = work.to(torch.float32)
            if self.size > 1:
                self._all_reduce(work.contiguous(), "sum" if op == "avg" else op)
        elif self.size > 1:  # reduced out of place into a scratch buffer: no clone pass
            src = work.contiguous()
            work = self.scratch(tuple(work.shape), work.dtype, work.device)
            self._all_reduce(work, "sum" if op == "avg" else op, src)
        else:
            work = work.clone(memory_format=torch.contiguous_format)
        if op == "avg":
            work /= self.size
        return work.to(tensor.dtype) if low else work

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> PendingExchange:
        """:meth:`all_reduce` of ``tensor`` in place, without the wait: once ``wait()`` on the
        result returns, ``tensor`` holds the reduction; until then it must not be read or
        written. Every rank starts its reductions over the group in the same order. This
        generic form reduces at once (a backend with a nonblocking reduction overrides it).
        Collective."""
        tensor.copy_(self.all_reduce(tensor, op))
        return PendingExchange(None)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s tensor on every rank; every rank passes a tensor of that shape and dtype."""
        self._root(src, "src")
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        if self.size > 1:
            self._broadcast(out, src)
        return out

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
    ) -> None:
        """Point-to-point: post every receive and send, then wait for all.

        ``sends`` are ``(peer, tensor)`` pairs, ``recvs`` are ``(peer, buffer)`` pairs whose
        buffers are filled in place. The k-th send to a peer matches that peer's k-th receive
        from this rank, so several messages between one pair of ranks are fine. Only the ranks
        named take part: this is not a collective over the whole group.
        """
        self.start_exchange(sends, recvs).wait()

    def start_exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        number: int = 0,
    ) -> PendingExchange:
        """:meth:`exchange` without the wait: the messages are posted, the caller computes,
        then calls ``wait()`` on the result. Until then the send tensors must not change and
        the receive buffers must not be read. ``number`` (positive, the same on both sides of
        each message; 0: none) names the exchange in its messages' tags, so that a rank that
        skipped an exchange its peer makes never feeds the peer another exchange's rows, and
        the two waits are told apart (:mod:`mpidp.comm.alarm`)."""
        for peer, _ in list(sends) + list(recvs):
            self._root(peer, "peer")
        own_sends = [t for peer, t in sends if peer == self.rank]
        own_recvs = [t for peer, t in recvs if peer == self.rank]
        if len(own_sends) != len(own_recvs):
            raise CommError(
                f"{self._where()}: {len(own_sends)} sends to itself but {len(own_recvs)} "
                f"receives from itself; they must pair up"
            )
        for src_t, dst_t in zip(own_sends, own_recvs, strict=False):
            dst_t.copy_(src_t)
        out = [(p, t.detach().contiguous()) for p, t in sends if p != self.rank]
        inn = [(p, t) for p, t in recvs if p != self.rank]
        if not (out or inn):
            return PendingExchange(None)
        return PendingExchange(self._start_exchange(_tagged(out, number), _tagged(inn, number)))

    def prepare_exchange(
        self,
        send_peers: Sequence[int],
        recvs: Sequence[tuple[int, torch.Tensor]],
        sends: Sequence[torch.Tensor] | None = None,
    ) -> PreparedExchange:
        """An exchange to be made many times (:class:`PreparedExchange`): one message to each
        of ``send_peers`` (in that order) per :meth:`PreparedExchange.start`, and receives
        into ``recvs``' ``(peer, buffer)`` pairs, kept and reused; ``sends``: send buffers
        kept likewise (the caller writes the messages into them). Local."""
        return PreparedExchange(self, send_peers, recvs, sends)

    # -- objects and synchronisation ---------------------------------------------------------

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s picklable ``obj`` on every rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the group arrives."""

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's list of ``len(values)`` int64 values (the same length everywhere), in
        rank order: the small agreement step of checked operations. Collective."""
        mine = torch.tensor([list(values)], dtype=torch.int64, device=self.default_device)
        if self.size == 1:
            return mine.tolist()
        return self._all_gather_v(mine, [1] * self.size).cpu().tolist()

    def agree(
        self,
        problems: Sequence[str],
        facts: Mapping[str, Any] | None = None,
        values: Sequence[int] = (),
    ) -> tuple[list[list[int]], list[str]]:
        """The checked-operation handshake: every rank's ``values`` (ints, the same count
        everywhere) and the lines describing what is wrong anywhere -- each rank's local
        ``problems`` and every fact that differs from rank 0's -- empty when all is well.

        One all-gather of ``len(values) + 2`` int64 per rank (a count of problems and a
        checksum of ``facts``); the texts travel only when something is wrong, so every rank
        returns the same lines and can raise the same error. Collective."""
        facts = dict(facts or {})
        table = self.all_gather_ints([*values, len(problems), facts_checksum(facts)])
        k = len(values)
        if all(row[k] == 0 and row[k + 1] == table[0][k + 1] for row in table):
            return [row[:k] for row in table], []
        return [row[:k] for row in table], self.disagreeing(problems, facts)

    def disagreeing(self, problems: Sequence[str], facts: Mapping[str, Any]) -> list[str]:
        """The second half of :meth:`agree`, once its all-gather found something wrong: every
        rank's problems and facts travel, and every rank returns the same lines. Collective."""
        everyone = self.all_gather_object((list(problems), dict(facts)))
        first = everyone[0][1]
        # one line per problem, naming every rank that found it (ranks that read one damaged
        # file all find the same)
        found: dict[str, list[int]] = {}
        for r, (probs, _) in enumerate(everyone):
            for msg in probs:
                found.setdefault(msg, []).append(r)
        lines = [
            f"rank {ranks[0]}: {msg}" if len(ranks) == 1 else f"ranks {ranks}: {msg}"
            for msg, ranks in found.items()
        ]
        for r, (_, mine) in enumerate(everyone):
            lines += [
                f"rank {r}: {name}={value!r} but rank 0 passed {first.get(name)!r}"
                for name, value in mine.items()
                if value != first.get(name)
            ]
        return lines

    def scratch(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """An uninitialised contiguous tensor from the transport's allocator: the MPI transport
        hands out large CPU buffers from its cache (reused only once nothing references them)
        instead of faulting in fresh pages on every call. Local."""
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    @property
    def default_device(self) -> torch.device:
        """Device of tensors created for ranks that passed none (scatter_v receivers)."""
        return torch.device("cpu")

    # -- backend primitives: contiguous tensors, split along dimension 0, group size > 1 ----

    @abc.abstractmethod
    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def _gather_v(
        self, x: torch.Tensor, sizes: list[int], dst: int, problem: str | None = None
    ) -> torch.Tensor | None: ...

    @abc.abstractmethod
    def _scatter_v(
        self,
        x: torch.Tensor | None,
        sizes: list[int],
        src: int,
        rest: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_to_all_v(
        self, x: torch.Tensor, send: list[int], recv: list[int], problem: str | None = None
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def _reduce_scatter_v(
        self, x: torch.Tensor, sizes: list[int], op: str, problem: str | None = None
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_reduce(self, x: torch.Tensor, op: str, src: torch.Tensor | None = None) -> None:
        """Reduce ``x`` in place, or ``src`` (same shape) into ``x`` when given."""

    @abc.abstractmethod
    def _broadcast(self, x: torch.Tensor, src: int) -> None: ...

    @abc.abstractmethod
    def _start_exchange(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
    ) -> Callable[[], None]:
        """Post ``(peer, tag, tensor)`` messages; return the function that waits for them."""

    def _root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise CommError(
                f"{self._where()}: {what} {root} is not a rank of this group; "
                f"use 0..{self.size - 1}"
            )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer shaped like ``t`` (``empty_like`` would keep ``t``'s strides)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


#: Tags of one exchange: (its number (``start_exchange(number=)``) modulo
#: :data:`EXCHANGE_NUMBERS`, plus 1) times this, plus the index of the message to that peer;
#: an unnumbered exchange's tags are the indices alone. Every tag stays within the 32767 that
#: MPI guarantees.
TAGS_PER_EXCHANGE = 64
EXCHANGE_NUMBERS = 510


def _tagged(
    pairs: list[tuple[int, torch.Tensor]], number: int = 0
) -> list[tuple[int, int, torch.Tensor]]:
    """Number the messages to each peer 0, 1, ... so the k-th send meets the k-th receive;
    offset by the exchange's ``number`` (when every peer gets fewer than
    :data:`TAGS_PER_EXCHANGE` messages), so that messages of two different exchanges never
    meet."""
    count: dict[int, int] = {}
    out = []
    for peer, tensor in pairs:
        tag = count.get(peer, 0)
        count[peer] = tag + 1
        out.append((peer, tag, tensor))
    if number > 0 and max(count.values(), default=0) <= TAGS_PER_EXCHANGE:
        base = (number % EXCHANGE_NUMBERS + 1) * TAGS_PER_EXCHANGE
        out = [(peer, base + tag, tensor) for peer, tag, tensor in out]
    return out
