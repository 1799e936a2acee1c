"""Writing Zarr at 1-4 ranks (19 rows: uneven over 2, 3 and 4): write_sharded and RolloutWriter
produce stores that xarray.open_zarr opens with CF coordinates and the serial values, Zarr
formats 2 and 3, for chunks aligned to the bands or not; no two ranks write one chunk (a
recording store); a failure on one rank leaves the previous store as it was. The killed-rank
case is tests/launch/test_faults.py."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from mpi4py import MPI
from zarr.storage import LocalStore
from zarr_stores import LoggingStore

import mpidp
import mpidp.io.zarr_writer as zw
from mpidp.errors import DataError
from mpidp.io import RolloutWriter, ShardedZarrDataset, write_sharded
from mpidp.runtime.partition import ShardSpec

WORLD = MPI.COMM_WORLD
P, ME = WORLD.Get_size(), WORLD.Get_rank()
H, W = 19, 8
F64 = torch.float64
LAT, LON = np.linspace(90, -90, H), np.arange(W) * 360.0 / W


@pytest.fixture(scope="module")
def shared() -> Path:
    path = WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-zarr-write-") if ME == 0 else None)
    yield Path(path)
    WORLD.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=P) as m:
        yield m


def _sizes(kind: str) -> list[int]:
    """Balanced bands, or a lopsided cut (an empty band at 4 ranks)."""
    if kind == "balanced" or P == 1:
        return list(ShardSpec.balanced(H, P).sizes)
    return {2: [4, 15], 3: [9, 1, 9], 4: [6, 0, 8, 5]}[P]


def _temporaries(folder: Path) -> list[str]:
    WORLD.Barrier()
    found = [p for p in os.listdir(folder) if ".tmp-" in p or ".old-" in p]
    WORLD.Barrier()
    return found


@pytest.mark.parametrize("rows", [None, 5, 7])
@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("kind", ["balanced", "lopsided"])
def test_write_sharded_round_trip(manager, shared, kind, fmt, rows):
    sizes = _sizes(kind)
    spec = ShardSpec.from_sizes(sizes)
    full = torch.randn(2, 3, H, W, generator=torch.Generator().manual_seed(7), dtype=F64)
    path = shared / f"field-{kind}-{fmt}-{rows}.zarr"
    dims = ("time", "level", "latitude", "longitude")
    coords = {"latitude": LAT, "longitude": LON, "level": np.array([500, 700, 850])}
    local = full[:, :, spec.slice(ME)]
    write_sharded(
        path, "x", local, manager=manager, dims=dims, coords=coords, attrs={"units": "K"},
        zarr_format=fmt, chunk_rows=rows,
    )  # fmt: skip
    if ME == 0:
        with xr.open_zarr(path) as ds:
            assert ds["x"].dims == dims and ds["x"].attrs["units"] == "K"
            np.testing.assert_array_equal(ds["x"].values, full.numpy())
            np.testing.assert_array_equal(ds["latitude"].values, LAT)
            np.testing.assert_array_equal(ds["level"].values, [500, 700, 850])
            assert ds["latitude"].attrs["units"] == "degrees_north"
            want = rows or max(sizes)
            assert ds["x"].encoding["chunks"] == (1, 1, want, W)
    # A second variable added to the store keeps the first; the reader reads both back.
    write_sharded(path, "y", full[0, 0, spec.slice(ME)], manager=manager, mode="a")
    if ME == 0:
        with xr.open_zarr(path) as ds:
            assert set(ds.data_vars) == {"x", "y"} and ds["y"].dims == ("latitude", "longitude")
            np.testing.assert_array_equal(ds["x"].values, full.numpy())
            np.testing.assert_array_equal(ds["y"].values, full[0, 0].numpy())
    back = ShardedZarrDataset(
        path, "x", manager=manager, spec=sizes, normalize=None, dtype=F64, lead_time=0
    )
    torch.testing.assert_close(back[1][0], full[1][:, spec.slice(ME)], rtol=0, atol=0)
    assert not _temporaries(shared)


@pytest.mark.parametrize("fmt", [2, 3])
def test_integers_and_zeros_survive_xarray(manager, shared, fmt):
    """Whole numbers, zeros among them, in a field and a coordinate: xarray reads them back
    as they were (a format-2 fill value of 0 would turn every 0 into NaN)."""
    spec = manager.spec(H)
    full = torch.arange(3 * H * W, dtype=torch.int32).reshape(3, H, W) % 5
    path = shared / f"ints-{fmt}.zarr"
    dims = ("step", "latitude", "longitude")
    write_sharded(
        path, "n", full[:, spec.slice(ME)], manager=manager, dims=dims,
        coords={"step": np.array([0, 1, 2])}, zarr_format=fmt,
    )  # fmt: skip
    if ME == 0:
        with xr.open_zarr(path) as ds:
            assert ds["n"].dtype == np.int32 and ds["step"].values.tolist() == [0, 1, 2]
            np.testing.assert_array_equal(ds["n"].values, full.numpy())


def test_aligned_sizes_give_every_chunk_one_owner():
    """Every chunk of the chunk-aligned partition lies in one band, and bands that are a
    chunk each do not move."""
    for sizes in ([19], [10, 9], [4, 15], [7, 6, 6], [9, 1, 9], [6, 0, 8, 5], [181, 180, 180, 180]):
        total = sum(sizes)
        for rows in (1, 2, 5, 7, max(sizes), total):
            new = zw.aligned_sizes(sizes, rows)
            assert sum(new) == total
            bounds = np.cumsum([0, *new])
            for start in range(0, total, rows):
                stop = min(start + rows, total)
                owner = np.searchsorted(bounds, start, side="right") - 1
                assert bounds[owner] <= start and stop <= bounds[owner + 1], (sizes, rows)
    assert zw.aligned_sizes([5, 5, 5, 4], 5) == [5, 5, 5, 4]
    assert zw.aligned_sizes([181, 180, 180, 180], 181) == [181, 181, 181, 178]


@pytest.mark.parametrize("rows", [None, 5, 7])
@pytest.mark.parametrize("kind", ["balanced", "lopsided"])
def test_no_two_ranks_write_one_chunk(manager, shared, monkeypatch, kind, rows):
    sizes = _sizes(kind)
    spec = ShardSpec.from_sizes(sizes)
    written: list[str] = []

    def recording(store: Path, name: str):
        wrapped = LoggingStore(LocalStore(store), written, writes=True)
        return zarr.open_array(wrapped, path=name, mode="r+")

    monkeypatch.setattr(zw, "open_rows", recording)
    full = torch.randn(2, H, W, generator=torch.Generator().manual_seed(3), dtype=F64)
    path = shared / f"owners-{kind}-{rows}.zarr"
    with RolloutWriter(path, ["a", "b"], LAT, LON, manager, chunk_rows=rows) as out:
        for step in range(2):
            out.write(full[:, spec.slice(ME)] + step)
        out.write(full[:, spec.slice(ME)] * 0 + 5)
    chunks = [k for k in written if "/c/" in k]
    everyone = WORLD.allgather(chunks)
    flat = [k for keys in everyone for k in keys]
    assert len(flat) == len(set(flat)), f"a chunk written twice: {everyone}"
    per_step = -(-H // (rows or max(sizes)))
    assert len(flat) == 3 * 2 * per_step  # steps x channels x chunks: every chunk once
    if ME == 0:
        with xr.open_zarr(path) as ds:
            np.testing.assert_array_equal(ds["b"].values[1], (full[1] + 1).float().numpy())
            np.testing.assert_array_equal(ds["a"].values[2], np.full((H, W), 5, np.float32))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv2d(4, 2, 3, padding=1),
    ).double()


@pytest.mark.parametrize("fmt", [2, 3])
def test_rollout_equals_the_serial_rollout(manager, shared, fmt):
    """A domain-parallel rollout of a convolutional model written step by step, opened by
    xarray.open_zarr with decoded CF times, equals the serial rollout of the same model."""
    serial = _model()
    parallel = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    spec = manager.spec(H)
    x0 = torch.randn(1, 2, H, W, generator=torch.Generator().manual_seed(1), dtype=F64)
    steps, x = [], x0
    with torch.no_grad():
        for _ in range(4):
            x = serial(x)
            steps.append(x[0])
    path = shared / f"rollout-{fmt}.zarr"
    attrs = {"t2m": {"units": "K", "long_name": "2 metre temperature"}}
    with RolloutWriter(
        path, ["t2m", "z500"], LAT, LON, manager, time_units="hours since 2000-01-01",
        variable_attrs=attrs, dtype=np.float64, zarr_format=fmt,
    ) as out:  # fmt: skip
        x = x0[..., spec.slice(ME), :]
        with torch.no_grad():
            for k in range(4):
                x = parallel(x)
                out.write(x, time=6.0 * (k + 1))
                assert not path.exists()  # published only at close
    if ME == 0:
        with xr.open_zarr(path) as ds:
            assert ds["t2m"].dims == ("time", "latitude", "longitude")
            assert ds["t2m"].attrs == {"units": "K", "long_name": "2 metre temperature"}
            assert [str(t)[:13] for t in ds["time"].values][-1] == "2000-01-02T00"
            np.testing.assert_array_equal(ds["longitude"].values, LON)
            want = torch.stack(steps).numpy()
            for v, name in enumerate(["t2m", "z500"]):
                np.testing.assert_allclose(ds[name].values, want[:, v], rtol=1e-12, atol=1e-12)
    # A rollout that fails leaves the published store as it was, and no temporary behind.
    before = xr.open_zarr(path).load() if ME == 0 else None
    with pytest.raises(RuntimeError, match="model blew up"):
        with RolloutWriter(path, ["t2m", "z500"], LAT, LON, manager) as out:
            out.write(steps[0][:, spec.slice(ME)])
            raise RuntimeError("model blew up")
    assert not _temporaries(shared)
    if ME == 0:
        with xr.open_zarr(path) as ds:
            xr.testing.assert_identical(ds.load(), before)


def test_failed_write_on_one_rank_leaves_the_store_untouched(manager, shared, monkeypatch):
    path = shared / "keep.zarr"
    spec = manager.spec(H)
    x = torch.ones(H, W, dtype=F64)[spec.slice(ME)]
    write_sharded(path, "x", x, manager=manager)
    if ME == P - 1:

        def broken(*args):
            raise OSError("disk full (injected)")

        monkeypatch.setattr(zw, "write_rows", broken)
    with pytest.raises(DataError, match=f"rank {P - 1}: OSError: disk full"):
        write_sharded(path, "x", 2 * x, manager=manager)
    assert not _temporaries(shared)
    if ME == 0:
        with xr.open_zarr(path) as ds:
            np.testing.assert_array_equal(ds["x"].values, np.ones((H, W)))


def test_bad_arguments_fail_everywhere(manager, shared):
    spec = manager.spec(H)
    x = torch.ones(H, W)[spec.slice(ME)]
    with pytest.raises(DataError, match="every rank writes a Zarr store at once"):
        write_sharded(shared / "m.zarr", "x", x, manager=manager, method="ordered")
    with pytest.raises(DataError, match="chunk_rows=0"):
        RolloutWriter(shared / "r.zarr", ["a"], manager=manager, chunk_rows=0)
    with pytest.raises(DataError, match="format='grib'"):
        write_sharded(shared / "g.zarr", "x", x, manager=manager, format="grib")
    nc = shared / "plain.nc"
    write_sharded(nc, "x", x, manager=manager)
    with pytest.raises(DataError, match="is not a Zarr store"):
        write_sharded(nc, "y", x, manager=manager, mode="a", format="zarr")
    assert not _temporaries(shared)
