"""Prefetcher over DataLoaders of the band readers at 1-4 ranks: the same batches as the
loader alone (Zarr and netCDF-4), while the loop runs collectives on its own thread; a read
that fails after construction raises its DataError at its item; DataLoader worker processes
(num_workers=2) give the items of num_workers=0 (each worker reopens the store or file)."""

from __future__ import annotations

import gc
import multiprocessing
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch.utils.data import DataLoader

import mpidp
from mpidp.errors import DataError
from mpidp.io import ShardedH5Dataset, ShardedZarrDataset, make_sample_data
from mpidp.io.prefetch import Prefetcher

WORLD = MPI.COMM_WORLD
P, ME = WORLD.Get_size(), WORLD.Get_rank()
H, W, T = 19, 16, 6
READERS = {"zarr": ShardedZarrDataset, "hdf5": ShardedH5Dataset}
OPTIONS = dict(halo=1, boundary="polar", variables=["t2m", ("t", [1]), "msl"])


@pytest.fixture(scope="module")
def data() -> dict[str, Path]:
    path = Path(WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-prefetch-") if ME == 0 else None))
    files = {"zarr": path / "sample.zarr", "hdf5": path / "sample.nc"}
    if ME == 0:
        for fmt, file in files.items():
            make_sample_data(file, n_lat=H, n_lon=W, n_time=T, format=fmt)
    WORLD.Barrier()
    yield files
    WORLD.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=P) as m:
        yield m


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mpidp-prefetch" and t.is_alive()]


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for (a, b), (c, d) in zip(got, want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d), f"rank {ME}"


@pytest.mark.parametrize("fmt", ["zarr", "hdf5"])
def test_prefetched_batches_equal_the_loader_while_the_loop_communicates(manager, data, fmt):
    ds = READERS[fmt](data[fmt], manager=manager, **OPTIONS)
    loader = DataLoader(ds, batch_size=2)
    want = _batches(loader)
    prefetched = Prefetcher(loader, depth=2)
    assert len(prefetched) == len(loader) == len(want)
    got = []
    for x, y in prefetched:
        # a collective on the loop's thread while the next batch is read on the other
        total = WORLD.allreduce(float(y.double().sum()))
        assert total == WORLD.allreduce(float(want[len(got)][1].double().sum()))
        got.append((x.clone(), y.clone()))
    _assert_same(got, want)
    assert _threads() == []


def test_a_read_that_fails_raises_its_data_error_at_its_item(manager, data):
    """Every chunk of t2m at time 3 garbled after construction: item 2 (target time 3) raises
    the reader's DataError on every rank, through the Prefetcher, after items 0 and 1."""
    broken = data["zarr"].with_name(f"broken-{P}.zarr")
    if ME == 0:
        shutil.copytree(data["zarr"], broken)
    WORLD.Barrier()
    ds = ShardedZarrDataset(broken, manager=manager, **OPTIONS)
    WORLD.Barrier()
    if ME == 0:
        for chunk in (broken / "t2m" / "c" / "3").rglob("*"):
            if chunk.is_file():
                chunk.write_bytes(b"not a chunk")
    WORLD.Barrier()
    got = []
    with pytest.raises(DataError, match=rf"rank {ME}: reading 't2m' rows .* time index 3") as err:
        for item in Prefetcher(DataLoader(ds, batch_size=1)):
            got.append(item)
    assert len(got) == 2
    assert any("Prefetcher thread, reading item 2" in n for n in err.value.__notes__)
    assert _threads() == []


@pytest.mark.parametrize("fmt", ["zarr", "hdf5"])
def test_worker_processes_give_the_items_of_one_process(manager, data, fmt):
    """A path travels to the DataLoader's worker processes, each opens its own handles."""
    ds = READERS[fmt](data[fmt], manager=manager, **OPTIONS)
    want = _batches(DataLoader(ds, batch_size=2, num_workers=0))
    workers = DataLoader(ds, batch_size=2, num_workers=2)
    _assert_same(_batches(workers), want)
    _assert_same(_batches(Prefetcher(workers)), want)
    for i, _ in enumerate(Prefetcher(workers)):  # an early break shuts the workers down
        if i == 1:
            break
    assert _threads() == []
    gc.collect()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []


def test_items_read_ahead_follow_a_partition_change(manager, data):
    """Issue 48: ``set_partition`` between two steps moves every item the Prefetcher read
    ahead under the old cut to the new one (ranks read on until they hold the same items):
    each item equals the loader's read under the cut in force when it is used. A reader with
    halo rows is refused on every rank, the partition and the loop kept."""
    plain = {k: v for k, v in OPTIONS.items() if k != "halo" and k != "boundary"}
    ds = ShardedZarrDataset(data["zarr"], manager=manager, **plain)
    old = manager.spec(H)
    new_policy = mpidp.Weighted(tuple(range(1, P + 1)))
    new = new_policy.spec(H, P)
    cuts = {
        c: ShardedZarrDataset(data["zarr"], manager=manager, spec=c.sizes, **plain)
        for c in (old, new)
    }
    got = []
    try:
        for i, item in enumerate(
            Prefetcher(DataLoader(ds, batch_size=1), depth=2, manager=manager)
        ):
            got.append(item)
            if i == 1:
                time.sleep(0.2 * ME)  # the ranks hold different numbers of items read ahead
                manager.set_partition(new_policy, rows=H)
    finally:
        manager.partition = mpidp.Balanced()
    want = [tuple(t.unsqueeze(0) for t in cuts[old if i < 2 else new][i]) for i in range(len(ds))]
    _assert_same(got, want)
    halo = READERS["zarr"](data["zarr"], manager=manager, **OPTIONS)
    loop = iter(Prefetcher(DataLoader(halo, batch_size=1), manager=manager))
    first = next(loop)
    with pytest.raises(mpidp.ConfigError, match=r"cannot move the items read ahead.*halo"):
        manager.set_partition(new_policy, rows=H)
    assert manager.partition == mpidp.Balanced()
    assert len([first, *loop]) == len(halo)
    assert _threads() == []
