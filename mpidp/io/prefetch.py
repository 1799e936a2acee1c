"""Reading the next items while the current step computes: :class:`Prefetcher` iterates over
any iterable (a DataLoader over a sharded dataset, typically) on a background thread.

The band readers' reads are local (each rank opens its own files or stores, no MPI), so they
may run on a thread of their own; collectives stay on the training loop's thread, in the
same order on every rank. Reading overlaps computing where both let go of the GIL: torch's
kernels do, and so do the copies and decompression of the readers.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

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
    iterator: Iterator[Any], q: queue.Queue[tuple[str, Any]], stop: threading.Event
) -> None:
    """The background thread: the items of ``iterator`` in order, then the end (or the
    exception that ended it). Holds no reference to the Prefetcher, so that one can be
    collected while this runs."""
    try:
        while not stop.is_set():
            try:
                item = next(iterator)
            except StopIteration:
                _put(q, stop, (_END, None))
                return
            if not _put(q, stop, (_ITEM, item)):
                return
    except BaseException as exc:  # handed to the consumer, raised there
        # the traceback keeps this frame: without the iterator, which a DataLoader needs
        # collected to shut its worker processes down
        del iterator
        _put(q, stop, (_ERROR, exc))


class _Pass:
    """One pass over the iterable: its queue, its thread and the flag that stops it."""

    def __init__(self, iterator: Iterator[Any], depth: int) -> None:
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=_produce,
            args=(iterator, self.queue, self.stopping),
            name="mpidp-prefetch",
            daemon=True,
        )
        self.thread.start()

    def stop(self) -> None:
        """Tell the thread to stop, drop what it read ahead, and wait for it: at most the
        read under way when it was told."""
        self.stopping.set()
        while self.thread.is_alive():
            self._drain()
            self.thread.join(_POLL)
        self._drain()

    def _drain(self) -> None:
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass


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

    Example
    -------
    >>> loader = DataLoader(ShardedZarrDataset("era5.zarr", manager=m), batch_size=4)
    >>> with Prefetcher(loader, depth=2) as batches:
    ...     for x, y in batches:
    ...         step(x, y)
    """

    def __init__(self, iterable: Iterable[T], depth: int = 2) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r}: keep at least 1 item ready (an int >= 1)")
        self.iterable = iterable
        self.depth = depth
        self._passes: weakref.WeakSet[_Pass] = weakref.WeakSet()
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[T]:
        run = _Pass(iter(self.iterable), self.depth)
        with self._lock:
            self._passes.add(run)
        index = 0
        try:
            while True:
                try:
                    kind, value = run.queue.get(timeout=_POLL)
                except queue.Empty:
                    if run.stopping.is_set():  # closed while this loop ran
                        return
                    continue
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
        with self._lock:
            runs = list(self._passes)
        for run in runs:
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
