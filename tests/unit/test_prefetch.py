"""Prefetcher in one process: order, depth, an exception raised at its item with the
background traceback, no thread left after a loop, a break, close() or collection, len()."""

from __future__ import annotations

import gc
import threading
import time
import traceback
from collections.abc import Iterator

import pytest

from mpidp.io.prefetch import Prefetcher


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mpidp-prefetch" and t.is_alive()]


def _counting(n: int | None, read: list[int], delay: float = 0.0) -> Iterator[int]:
    """0, 1, ... (without end when ``n`` is None), recording each item read."""
    i = 0
    while n is None or i < n:
        time.sleep(delay)
        read.append(i)
        yield i
        i += 1


def _failing(at: int) -> Iterator[int]:
    yield from range(at)
    raise KeyError(f"no item {at} here")


@pytest.mark.parametrize("depth", [1, 2, 7])
def test_order_preserved_and_every_pass_anew(depth):
    items = list(range(50))
    p = Prefetcher(items, depth=depth)
    assert list(p) == items and list(p) == items  # each loop: a new pass
    assert _threads() == []


def test_reads_at_most_depth_ahead():
    read: list[int] = []
    p = Prefetcher(_counting(None, read), depth=3)
    it = iter(p)
    assert next(it) == 0
    time.sleep(0.3)
    # the item in use, `depth` in the queue, and one read waiting for room
    assert len(read) <= 1 + 3 + 1, read
    it.close()
    assert _threads() == []


def test_exception_raised_at_its_item_with_the_background_traceback():
    got = []
    with pytest.raises(KeyError, match="no item 3 here") as err:
        for x in Prefetcher(_failing(3)):
            got.append(x)
    assert got == [0, 1, 2]  # the items before it first
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "_failing" in frames  # where it happened, on the background thread
    assert any("Prefetcher thread, reading item 3" in n for n in err.value.__notes__)
    assert _threads() == []


def test_early_break_leaves_no_thread():
    read: list[int] = []
    for x in Prefetcher(_counting(None, read, delay=0.01), depth=2):
        if x == 4:
            break
    assert _threads() == []
    settled = len(read)
    time.sleep(0.1)
    assert len(read) == settled  # nothing reads on


def test_close_context_manager_and_collection_stop_the_thread():
    with Prefetcher(_counting(None, [])) as p:
        it = iter(p)
        next(it)
        assert len(_threads()) == 1
    assert _threads() == []
    assert list(it) == []  # a loop over a closed Prefetcher ends

    p = Prefetcher(range(10**9))
    it = iter(p)
    next(it)
    del it, p
    gc.collect()
    assert _threads() == []


def test_close_inside_the_loop_ends_it():
    p = Prefetcher(range(100))
    seen = []
    for x in p:
        seen.append(x)
        if x == 2:
            p.close()
    assert seen == [0, 1, 2] and _threads() == []


def test_len_when_the_iterable_has_one():
    assert len(Prefetcher(range(17))) == 17
    with pytest.raises(TypeError, match="Prefetcher over a generator, which has no len"):
        len(Prefetcher(_counting(3, [])))


def test_reads_overlap_the_consumer():
    """Items that take 40 ms to read, consumed in 40 ms each: about half the serial time."""
    n, delay = 10, 0.04
    start = time.perf_counter()
    for _ in Prefetcher(_counting(n, [], delay=delay)):
        time.sleep(delay)
    overlapped = time.perf_counter() - start
    assert overlapped < 0.8 * 2 * n * delay, overlapped


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_bad_depth(depth):
    with pytest.raises(ValueError, match=rf"depth={depth!r}: keep at least 1 item ready"):
        Prefetcher([], depth=depth)
