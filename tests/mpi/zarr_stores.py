"""Shared by the Zarr tests: a store that logs the keys read from it or written to it, chunk
key names, and the check that a dataset's construction fails the same way on every rank."""

from __future__ import annotations

import pytest
from mpi4py import MPI
from zarr.storage import WrapperStore

from mpidp.errors import DataError
from mpidp.io import ShardedZarrDataset


class LoggingStore(WrapperStore):
    """A store that appends to ``log`` every key read from it (``get``) or, with
    ``writes=True``, every key written to it (``set``)."""

    def __init__(self, store, log: list[str] | None = None, writes: bool = False) -> None:
        super().__init__(store)
        self.log = [] if log is None else log
        self.writes = writes

    def _with_store(self, store):
        return LoggingStore(store, self.log, self.writes)

    async def get(self, key, prototype, byte_range=None):
        if not self.writes:
            self.log.append(key)
        return await self._store.get(key, prototype, byte_range)

    async def set(self, key, value):
        if self.writes:
            self.log.append(key)
        await self._store.set(key, value)


def chunk_key(fmt: int, name: str, index: tuple[int, ...]) -> str:
    """The key of chunk ``index`` of array ``name`` in Zarr format ``fmt`` (default encoding)."""
    if fmt == 3:
        return f"{name}/c/" + "/".join(map(str, index))
    return f"{name}/" + ".".join(map(str, index))


def expect_everywhere(match: str, *args, **kwargs) -> str:
    """``ShardedZarrDataset(*args, **kwargs)`` raises a DataError matching ``match`` that
    names this rank and a fix; its text."""
    with pytest.raises(DataError, match=match) as err:
        ShardedZarrDataset(*args, **kwargs)
    text = str(err.value)
    assert text.startswith(f"rank {MPI.COMM_WORLD.Get_rank()}:") and "fix:" in text, text
    return text
