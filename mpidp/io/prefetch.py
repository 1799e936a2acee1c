"""Reading the next items while the current step computes: :class:`Prefetcher` iterates over
any iterable (a DataLoader over a sharded dataset, typically) on a background thread.

The band readers' reads are local (each rank opens its own files or stores, no MPI), so they
may run on a thread of their own; collectives stay on the training loop's thread, in the
same order on every rank. Reading overlaps computing where both let go of the GIL: torch's
kernels do, and so do the copies and decompression of the readers.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpidp.errors import ConfigError, DataError
from mpidp.ops.collectives import repartition
from mpidp.runtime.rebalance import follow_partition

if TYPE_CHECKING:
    from mpidp.comm import Transport
    from mpidp.runtime.manager import DistributedManager
    from mpidp.runtime.partition import PartitionPolicy

__all__ = ["Prefetcher"]

T = TypeVar("T")

_ITEM, _END, _ERROR = "item", "end", "error"

#: How often a producer blocked on a full queue looks whether it was told to stop (s).
_POLL = 0.05


def _put(q: queue.Queue[tuple[str, Any]], stop: threading.Event, entry: tuple[str, Any]) -> bool:
    """Put ``entry`` once there is room; False (nothing put) when told to stop first."""
    while not stop.is_set():
        try:
            q.put(entry, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(
    iterator: Iterator[Any],
    q: queue.Queue[tuple[str, Any]],
    stop: threading.Event,
    leftover: list[tuple[str, Any]],
) -> None:
    """The background thread: the items of ``iterator`` in order, then the end (or the
    exception that ended it). An entry read but not queued when told to stop goes to
    ``leftover`` (a suspended pass hands it out later). Holds no reference to the
    Prefetcher, so that one can be collected while this runs."""
    try:
        while not stop.is_set():
            try:
                entry: tuple[str, Any] = (_ITEM, next(iterator))
            except StopIteration:
                entry = (_END, None)
            if not _put(q, stop, entry):
                leftover.append(entry)
                return
            if entry[0] == _END:
                return
    except BaseException as exc:  # handed to the consumer, raised there
        # the traceback keeps this frame: without the iterator, which a DataLoader needs
        # collected to shut its worker processes down
        del iterator
        if not _put(q, stop, (_ERROR, exc)):
            leftover.append((_ERROR, exc))


class _Pass:
    """One pass over the iterable: its queue, its thread, the flag that stops it, and the
    entries handed out before the queue's (those of a suspended thread, see :meth:`suspend`)."""

    def __init__(self, iterator: Iterator[Any], depth: int) -> None:
        self.iterator = iterator
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self.ready: collections.deque[tuple[str, Any]] = collections.deque()
        self.stopping = threading.Event()
        self._start()

    def _start(self) -> None:
        self.halt = threading.Event()
        self.leftover: list[tuple[str, Any]] = []
        self.thread = threading.Thread(
            target=_produce,
            args=(self.iterator, self.queue, self.halt, self.leftover),
            name="mpidp-prefetch",
            daemon=True,
        )
        self.thread.start()

    def next_entry(self) -> tuple[str, Any] | None:
        """The next entry, or None when none came within the polling interval."""
        if self.ready:
            return self.ready.popleft()
        try:
            return self.queue.get(timeout=_POLL)
        except queue.Empty:
            return None

    def stop(self) -> None:
        """Tell the thread to stop, drop what it read ahead, and wait for it: at most the
        read under way when it was told."""
        self.stopping.set()
        self.halt.set()
        while self.thread.is_alive():
            self._drain()
            self.thread.join(_POLL)
        self._drain()
        self.ready.clear()
        self.iterator = iter(())  # let a DataLoader's iterator go (its workers shut down)

    def _drain(self) -> list[tuple[str, Any]]:
        out = []
        try:
            while True:
                out.append(self.queue.get_nowait())
        except queue.Empty:
            return out

    def suspend(self) -> list[tuple[str, Any]]:
        """Stop the thread after the read under way and take every entry read ahead, in
        order; :meth:`resume` goes on from there."""
        self.halt.set()
        self.thread.join()
        entries = [*self.ready, *self._drain(), *self.leftover]
        self.ready.clear()
        return entries

    def resume(self, entries: list[tuple[str, Any]]) -> None:
        """Hand out ``entries`` first, then read on (unless they end the pass)."""
        self.ready.extend(entries)
        if not self.stopping.is_set() and not any(kind != _ITEM for kind, _ in entries):
            self._start()


class Prefetcher(Generic[T]):
    """Iterate over ``iterable`` with up to ``depth`` items read ahead on a background
    thread, so that reading the next item overlaps the current training step.

    Items come in the iterable's order. An exception raised while reading is raised in the
    loop at the item where it happened (the items before it are yielded first), the same
    exception object with the background thread's traceback in it and a note saying it was
    raised there. Each ``for`` loop is a new pass (a new ``iter(iterable)``, so a DataLoader
    starts a new epoch); ``iter(iterable)`` runs on the calling thread (a DataLoader starts
    its worker processes there), only ``next`` runs on the background one. Leaving a loop
    early (``break``, an exception), :meth:`close`, leaving a ``with`` block or collecting
    the Prefetcher stops its thread; stopping waits for the read under way, if any.

    No MPI call happens on the background thread: mpidp's readers,
    :class:`~mpidp.io.ShardedH5Dataset` and :class:`~mpidp.io.ShardedZarrDataset`, read
    locally, each rank its own rows, so their items may be prefetched. Do not wrap an
    iterable whose ``next`` communicates (a collective would run on a second thread, out
    of order with the loop's).

    Parameters
    ----------
    iterable:
        What to iterate over: a DataLoader, a dataset, a generator (a one-pass iterator can
        be looped over once).
    depth:
        Items kept ready at most (memory: ``depth`` items besides the one in use); 1 or more.
    manager:
        With a manager, the items read ahead follow its partition: inside
        ``manager.set_partition`` (between steps) every rank reads on until it holds as many
        items as the rank furthest ahead, and each item's bands (its tensors of 3 dims or
        more, cut along ``dim`` by the old policy: a reader's bands without halo rows, read
        with the manager's cut) move to the new cut, only the rows that change owner
        (:func:`mpidp.repartition`); later items are read with the new bands by the readers
        themselves. Bands of another cut (halo rows, an explicit ``spec=``) are refused there
        with a ConfigError on every rank and the partition kept. Without one, items are
        handed out as read.
    dim:
        The dim along which the bands are cut (default -2, the latitude).
    rows:
        The length the bands cut (default: the ``grid`` of mpidp's reader, itself or a
        DataLoader's dataset; else the sum of the bands).

    Example
    -------
    >>> loader = DataLoader(ShardedZarrDataset("era5.zarr", manager=m), batch_size=4)
    >>> with Prefetcher(loader, depth=2) as batches:
    ...     for x, y in batches:
    ...         step(x, y)
    """

    def __init__(
        self,
        iterable: Iterable[T],
        depth: int = 2,
        *,
        manager: DistributedManager | None = None,
        dim: int = -2,
        rows: int | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r}: keep at least 1 item ready (an int >= 1)")
        self.iterable = iterable
        self.depth = depth
        self.manager, self.dim = manager, dim
        grid = getattr(getattr(iterable, "dataset", iterable), "grid", None)  # mpidp's readers
        self.rows = rows if rows is not None or grid is None else int(grid[0])
        self._passes: list[weakref.ref[_Pass]] = []  # in the order they began
        self._lock = threading.Lock()
        if manager is not None:
            follow_partition(manager, self._follow)

    def _live(self) -> list[_Pass]:
        with self._lock:
            runs = [r() for r in self._passes]
            self._passes = [weakref.ref(r) for r in runs if r is not None]
        return [r for r in runs if r is not None and not r.stopping.is_set()]

    def following(self) -> bool:
        """Whether a loop over this Prefetcher holds items read ahead now (or may)."""
        return bool(self._live())

    def _follow(self, old: PartitionPolicy, new: PartitionPolicy) -> None:
        """Inside ``manager.set_partition`` (see :func:`mpidp.runtime.rebalance.
        follow_partition`): every item read ahead under ``old`` is moved to ``new``'s cut.
        Collective over the domain group."""
        assert self.manager is not None
        t = self.manager.transport()
        runs = self._live()
        counts = t.all_gather_object(len(runs))
        if len(set(counts)) > 1:
            raise ConfigError(
                f"rank {self.manager.rank}: set_partition: {self!r} has {counts} loops under "
                f"way on the domain ranks; fix: run the same loops on every rank"
            )
        for run in runs:
            entries = _even_out(run, run.suspend(), t, self.manager.rank)
            try:
                moved = [
                    (k, _moved(v, old, new, self.dim, self.rows, t) if k == _ITEM else v)
                    for k, v in entries
                ]
            except BaseException:
                run.resume(entries)  # refused on every rank alike: the loop goes on as it was
                raise
            run.resume(moved)

    def __iter__(self) -> Iterator[T]:
        run = _Pass(iter(self.iterable), self.depth)
        with self._lock:
            self._passes.append(weakref.ref(run))
        index = 0
        try:
            while True:
                entry = run.next_entry()
                if entry is None:
                    if run.stopping.is_set():  # closed while this loop ran
                        return
                    continue
                kind, value = entry
                if kind == _END:
                    return
                if kind == _ERROR:
                    value.add_note(
                        f"(raised on mpidp's Prefetcher thread, reading item {index} of "
                        f"{type(self.iterable).__name__})"
                    )
                    raise value
                index += 1
                yield value
        finally:
            run.stop()

    def __len__(self) -> int:
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"Prefetcher over a {type(self.iterable).__name__}, which has no len()"
            ) from None

    def close(self) -> None:
        """Stop the background thread of every pass under way (the loops over this
        Prefetcher end; a new loop starts a new pass)."""
        for run in self._live():
            run.stop()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Prefetcher({type(self.iterable).__name__}, depth={self.depth})"


def _even_out(
    run: _Pass, entries: list[tuple[str, Any]], t: Transport, rank: int
) -> list[tuple[str, Any]]:
    """``entries`` and, read here, as many more items as the rank that read furthest ahead
    holds: then every rank holds the same items, which move together. Collective."""
    items = sum(kind == _ITEM for kind, _ in entries)
    ended = len(entries) > items
    most = max(t.all_gather_object(items))
    while items < most and not ended:
        try:
            entries.append((_ITEM, next(run.iterator)))
            items += 1
        except StopIteration:
            entries.append((_END, None))
            ended = True
        except Exception as exc:  # raised in the loop at its item, as a read ahead would
            entries.append((_ERROR, exc))
            ended = True
    held = t.all_gather_object(items)
    if len(set(held)) > 1:
        raise DataError(
            f"rank {rank}: set_partition: the domain ranks' loops hold {held} items read "
            f"ahead after reading on; fix: iterate the same number of items on every rank"
        )
    return entries


def _moved(
    item: Any, old: PartitionPolicy, new: PartitionPolicy, dim: int, rows: int | None, t: Transport
) -> Any:
    """``item`` with each of its tensors of 3 dims or more (a band: channels, rows, columns)
    moved from ``old``'s cut of ``rows`` (default: its length) along ``dim`` to ``new``'s.
    Collective."""
    flat, layout = tree_flatten(item)
    bands = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.dim() >= 3]
    table = t.all_gather_object([flat[i].size(dim) for i in bands])
    problems = []
    if len({len(row) for row in table}) > 1:
        problems.append(f"items of {[len(row) for row in table]} bands on the ranks")
    else:
        for k, i in enumerate(bands):
            cut = [row[k] for row in table]
            try:
                was: list[Any] = list(old.spec(rows or sum(cut), t.size).sizes)
            except ConfigError as err:
                was = [str(err)]
            if was != cut:
                problems.append(
                    f"band {k} (shape {tuple(flat[i].shape)} here) has {cut} rows along dim "
                    f"{dim} on the ranks, not the old cut {was} of {rows or sum(cut)} rows"
                )
    if problems:
        raise ConfigError(
            f"rank {t.rank}: set_partition cannot move the items read ahead to the new cut: "
            + "; ".join(problems)
            + "; the Prefetcher moves bands read by the manager's cut without halo rows. fix: "
            "read with halo=0 and no spec=, or end the loop before set_partition"
        )
    for k, i in enumerate(bands):
        cut = [row[k] for row in table]
        flat[i] = repartition(flat[i], cut, new.spec(sum(cut), t.size), dim, group=t)
    return tree_unflatten(flat, layout)
