"""The MPI transport's receive-buffer cache: a buffer is reused only when no tensor uses it."""

from __future__ import annotations

import torch

from mpidp.comm.buffers import BufferCache

MB = 1 << 20


def tensor_on(buf):
    return torch.from_numpy(buf).view(torch.float64).view(-1, 4)


def test_reuses_only_idle_buffers():
    cache = BufferCache(limit_bytes=64 * MB, min_bytes=MB)
    first = cache.take(2 * MB)
    addr = first.ctypes.data
    view = tensor_on(first)[3:].transpose(0, 1)  # a view of a view still holds the memory
    del first
    second = cache.take(2 * MB)
    assert second.ctypes.data != addr  # the first is still in use: a new buffer
    del view
    third = cache.take(2 * MB)  # the first is idle now (the second is still held)
    assert third.ctypes.data == addr
    assert cache.take(3 * MB).nbytes == 3 * MB  # another size gets its own buffer
    assert second.ctypes.data != third.ctypes.data
    # held: the two 2 MB buffers and the 3 MB one; a reuse added nothing to the peak
    assert cache.held_bytes() == cache.peak_bytes == 7 * MB


def test_small_requests_bypass_the_cache():
    cache = BufferCache(limit_bytes=64 * MB, min_bytes=MB)
    cache.take(1000)
    assert "held=0" in repr(cache)


def test_idle_bytes_are_capped():
    cache = BufferCache(limit_bytes=4 * MB, min_bytes=MB)
    for k in range(1, 6):
        cache.take(k * MB)  # each dropped at once: idle
    assert cache.idle_bytes() <= 5 * MB  # the newest buffer alone may exceed the limit


def test_disabled(monkeypatch):
    monkeypatch.setenv("MPIDP_BUFFER_CACHE_MB", "0")
    cache = BufferCache()
    buf = cache.take(2 * MB)
    del buf
    assert cache.idle_bytes() == 0 and "held=0" in repr(cache)


def test_data_survives_while_in_use():
    cache = BufferCache(limit_bytes=64 * MB, min_bytes=MB)
    t = tensor_on(cache.take(2 * MB))
    t.fill_(7.0)
    for _ in range(3):
        other = tensor_on(cache.take(2 * MB))
        other.fill_(-1.0)
        del other
    assert bool((t == 7.0).all())
