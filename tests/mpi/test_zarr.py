"""The Zarr reader at 1-4 ranks (19 rows: uneven over 2, 3 and 4): every item equal bit for bit
to ShardedH5Dataset reading the same values from netCDF-4, for Zarr formats 2 and 3, both
latitude orders, from a path and from an opened group, with halo, polar rows and level
selection; only the chunks overlapping a rank's rows are fetched (a counting store); bad input
raises the same clear error on every rank."""

from __future__ import annotations

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
from zarr_stores import LoggingStore, chunk_key, expect_everywhere

import mpidp
from mpidp.io import ShardedH5Dataset, ShardedZarrDataset, make_sample_data
from mpidp.testing import serial_halo

WORLD = MPI.COMM_WORLD
P, ME = WORLD.Get_size(), WORLD.Get_rank()
H, W, T, LEVELS = 19, 16, 4, (500, 700, 850)
ORDERS = ["n2s", "s2n"]


@pytest.fixture(scope="module")
def shared() -> Path:
    path = WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-zarr-") if ME == 0 else None)
    yield Path(path)
    WORLD.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


def _xarray_store(h5: Path, dst: Path, fmt: int, order: str, rows: int) -> None:
    """The netCDF-4 file as xarray writes it to Zarr: ``rows`` latitude rows per chunk,
    stored north to south or (``s2n``) south to north."""
    with xr.open_dataset(h5, engine="h5netcdf", decode_times=False) as ds:
        if order == "s2n":
            ds = ds.isel(latitude=slice(None, None, -1))
        chunks = {"latitude": rows, "time": 1, "level": 1}
        encoding = {
            v: {"chunks": tuple(chunks.get(d, ds.sizes[d]) for d in ds[v].dims)}
            for v in ("t2m", "msl", "z", "t")
        }
        ds.to_zarr(dst, zarr_format=fmt, mode="w", encoding=encoding, consolidated=fmt == 2)


def _h5_south_to_north(h5: Path, dst: Path) -> None:
    with xr.open_dataset(h5, engine="h5netcdf", decode_times=False) as ds:
        ds.isel(latitude=slice(None, None, -1)).to_netcdf(dst, engine="h5netcdf")


@pytest.fixture(scope="module")
def data(shared) -> dict:
    """netCDF-4 files in both latitude orders and their Zarr copies (formats 2 and 3,
    latitude chunks of 5 and 7 rows), written by rank 0."""
    h5 = {"n2s": shared / "sample.nc", "s2n": shared / "sample-s2n.nc"}
    stores = {
        (fmt, order, rows): shared / f"sample-{order}-v{fmt}-c{rows}.zarr"
        for fmt in (2, 3)
        for order in ORDERS
        for rows in (5, 7)
    }
    if ME == 0:
        make_sample_data(h5["n2s"], n_lat=H, n_lon=W, n_time=T, levels=LEVELS)
        _h5_south_to_north(h5["n2s"], h5["s2n"])
        for (fmt, order, rows), path in stores.items():
            _xarray_store(h5["n2s"], path, fmt, order, rows)
    WORLD.Barrier()
    return {"h5": h5, "zarr": stores}


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=P) as m:
        yield m


def _assert_same_items(a, b) -> None:
    assert len(a) == len(b) and a.channels == b.channels and a.rows == b.rows
    assert a.target_channels == b.target_channels and a.attributes == b.attributes
    np.testing.assert_array_equal(a.latitudes, b.latitudes)
    for i in range(len(a)):
        for u, v in zip(a[i], b[i], strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert torch.equal(u, v), f"item {i} differs on rank {ME}"


POLAR = dict(
    variables=["t2m", ("t", [0, 2]), "z"],
    targets=["msl", ("z", [1])],
    halo=(2, 1),
    boundary="polar",
    input_steps=2,
    lead_time=1,
)
PLAIN = dict(normalize=None, dtype=torch.float64)


@pytest.mark.parametrize("opened", ["path", "group"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("case", ["polar", "plain"])
def test_items_equal_hdf5_bit_for_bit(manager, data, case, fmt, order, opened):
    options = POLAR if case == "polar" else PLAIN
    path = data["zarr"][fmt, order, 5 if fmt == 2 else 7]
    store = path if opened == "path" else zarr.open_group(path, mode="r")
    got = ShardedZarrDataset(store, manager=manager, **options)
    want = ShardedH5Dataset(data["h5"][order], manager=manager, **options)
    _assert_same_items(got, want)
    if case == "polar":
        assert got.halo == (2, 1)
        assert got.channels == ["t2m", "t500", "t850", "z500", "z700", "z850"]


def _packed(h5: Path, folder: Path) -> dict[str, Path]:
    """The sample data with t2m and z CF-packed (int16, scale_factor, add_offset, _FillValue,
    and a few missing points), as netCDF-4 and Zarr (formats 3 and 2, which keeps _FillValue
    in its metadata); and xarray's decoding of it as float64 netCDF-4, the reference."""
    paths = {k: folder / f"packed.{k}" for k in ("nc", "zarr", "v2.zarr", "decoded.nc")}
    with xr.open_dataset(h5, engine="h5netcdf", decode_times=False) as ds:
        ds = ds.load()
    ds["t2m"][0, 3, 2:5] = np.nan
    ds["msl"][1, 2, 0:3] = np.nan
    pack = {"dtype": "int16", "_FillValue": -32767}
    encoding = {
        "t2m": {**pack, "scale_factor": 0.002, "add_offset": 270.0},
        "z": {**pack, "scale_factor": 2.5, "add_offset": 50000.0},
        "msl": {"_FillValue": -9999.0},  # floats with a missing number of their own
    }
    ds.to_netcdf(paths["nc"], engine="h5netcdf", encoding=encoding)
    ds.to_zarr(paths["zarr"], zarr_format=3, mode="w", encoding=encoding, consolidated=False)
    ds.to_zarr(paths["v2.zarr"], zarr_format=2, mode="w", encoding=encoding)
    with xr.open_dataset(paths["nc"], engine="h5netcdf", decode_times=False) as packed:
        assert packed["t2m"].encoding["dtype"] == np.int16
        packed.load().to_netcdf(paths["decoded.nc"], engine="h5netcdf")
    return paths


def test_cf_packed_values_are_unpacked(manager, data, shared):
    """A CF-packed variable (int16 with scale_factor, add_offset and _FillValue), and floats
    with a missing number of their own, read as xarray decodes them, missing points NaN, from
    HDF5 and from Zarr: never the stored numbers."""
    folder = shared / "packed"
    if ME == 0:
        folder.mkdir()
        _packed(data["h5"]["n2s"], folder)
    WORLD.Barrier()
    options = dict(variables=["t2m", "msl", "z"], normalize=None, dtype=torch.float64, halo=1)
    want = ShardedH5Dataset(folder / "packed.decoded.nc", manager=manager, **options)
    for got in (
        ShardedH5Dataset(folder / "packed.nc", manager=manager, **options),
        ShardedZarrDataset(folder / "packed.zarr", manager=manager, **options),
        ShardedZarrDataset(folder / "packed.v2.zarr", manager=manager, **options),
    ):
        for i in range(len(want)):
            for u, v in zip(got[i], want[i], strict=True):
                torch.testing.assert_close(u, v, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(want[0][0][0]).any() == (want.rows[0] <= 3 < want.rows[1])


def test_computed_statistics_and_uneven_spec(manager, data):
    """normalize='compute' reads the same band values: the same float64 statistics; a
    partition of one thin band and one wide one."""
    spec = [1] * (P - 1) + [H - (P - 1)]
    options = dict(manager=manager, spec=spec, normalize="compute", halo=1, boundary="polar")
    got = ShardedZarrDataset(data["zarr"][3, "s2n", 5], **options)
    want = ShardedH5Dataset(data["h5"]["s2n"], **options)
    assert torch.equal(got.mean, want.mean) and torch.equal(got.std, want.std)
    _assert_same_items(got, want)


def test_sample_data_as_zarr_equals_hdf5(manager, shared):
    """``make_sample_data(format="zarr")``: the same values, in a store xarray opens."""
    h5, store = shared / "gen.nc", shared / "gen.zarr"
    if ME == 0:
        make_sample_data(h5, n_lat=H, n_lon=W, n_time=3)
        make_sample_data(store, n_lat=H, n_lon=W, n_time=3, format="zarr")
    WORLD.Barrier()
    options = dict(manager=manager, halo=1, boundary="polar", input_steps=2)
    _assert_same_items(ShardedZarrDataset(store, **options), ShardedH5Dataset(h5, **options))
    with xr.open_zarr(store) as ds, xr.open_dataset(h5, engine="h5netcdf") as ref:
        assert ds["z"].dims == ("time", "level", "latitude", "longitude")
        xr.testing.assert_equal(ds[["t2m", "z"]].load(), ref[["t2m", "z"]].load())


# -- what a rank fetches -----------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("rows", [5, 7])
@pytest.mark.parametrize("fmt", [2, 3])
def test_fetches_only_the_chunks_overlapping_its_rows(manager, data, fmt, rows, order):
    counting = LoggingStore(LocalStore(data["zarr"][fmt, order, rows], read_only=True))
    ds = ShardedZarrDataset(
        zarr.open_group(counting, mode="r"),
        ["t2m", ("t", [0, 2])],
        manager=manager,
        halo=(2, 2),
        boundary="polar",
        normalize=None,
    )
    counting.log.clear()
    time = 2
    ds.read_band(time)
    fetched = [k for k in counting.log if not k.rsplit("/", 1)[-1].startswith((".z", "zarr."))]
    # The field rows the padded band needs: the serial halo of a field of row numbers.
    numbers = torch.arange(1.0, H + 1).view(1, H, 1).repeat(1, 1, W)
    needed = serial_halo(numbers, *ds.rows, -2, "polar", -1).unique()
    stored = [(H - int(r) if order == "s2n" else int(r) - 1) for r in needed]
    blocks = sorted({r // rows for r in stored})
    want = {chunk_key(fmt, "t2m", (time, b, 0)) for b in blocks}
    want |= {chunk_key(fmt, "t", (time, lev, b, 0)) for lev in (0, 2) for b in blocks}
    assert sorted(fetched) == sorted(want), (ME, fetched, want)  # each once, no other
    table = WORLD.gather((ME, ds.rows, len(fetched), len(want), -(-H // rows) * 3), root=0)
    if ME == 0:
        print(f"\nformat {fmt}, {rows}-row chunks, {order}: (rank, rows, fetched, needed, all)")
        for line in table:
            print("  ", line)


# -- bad input: the same clear error on every rank ---------------------------------------------


def test_missing_variable(manager, data):
    path = data["zarr"][3, "n2s", 5]
    text = expect_everywhere(r"no variable \['q'\]", path, ["t2m", "q"], manager=manager)
    assert str(path) in text and "'t2m'" in text  # the store and what it has


def test_missing_variable_on_one_rank_only(manager, data, shared):
    """One rank's copy lacks a variable: every rank raises, naming that rank."""
    thin = shared / "thin.zarr"
    if ME == 0:
        with xr.open_zarr(data["zarr"][3, "n2s", 5], decode_times=False, consolidated=False) as ds:
            ds.drop_vars("msl").to_zarr(thin, mode="w", zarr_format=3, consolidated=False)
    WORLD.Barrier()
    path = thin if ME == P - 1 else data["zarr"][3, "n2s", 5]
    match = rf"rank {P - 1}: .*thin.zarr: no variable \['msl'\]"
    expect_everywhere(match, path, ["t2m", "msl"], manager=manager)


def test_no_stored_statistics(manager, data, shared):
    """A store without mean/std attributes (as ERA5's): normalize='stored' says what to pass;
    'compute' works."""
    bare = shared / "bare.zarr"
    if ME == 0:
        with xr.open_zarr(data["zarr"][3, "n2s", 5], decode_times=False, consolidated=False) as ds:
            for v in ds.data_vars.values():
                v.attrs.clear()
            ds.to_zarr(bare, mode="w", zarr_format=3, consolidated=False)
    WORLD.Barrier()
    text = expect_everywhere("no 'mean'/'std' attributes", bare, ["t2m"], manager=manager)
    assert str(bare) in text and "normalize='compute'" in text
    computed = ShardedZarrDataset(bare, ["t2m"], manager=manager, normalize="compute")
    assert computed.mean.shape == (1,)


def test_latitude_not_monotonic(manager, data, shared):
    bad = shared / "shuffled.zarr"
    if ME == 0:
        shutil.copytree(data["zarr"][2, "n2s", 5], bad)
        lat = zarr.open_array(bad / "latitude", mode="r+")
        lat[:] = np.roll(lat[:], 3)
    WORLD.Barrier()
    text = expect_everywhere("not monotonic", bad, ["t2m"], manager=manager)
    assert str(bad) in text and "'t2m'" in text and "sortby('latitude')" in text


def test_group_that_is_not_a_dataset(manager, data, shared):
    plain, empty = shared / "plain.zarr", shared / "empty.zarr"
    swapped = shared / "swapped.zarr"
    if ME == 0:
        with xr.open_zarr(data["zarr"][3, "n2s", 5], decode_times=False, consolidated=False) as ds:
            ds[["t2m"]].transpose("time", "longitude", "latitude").to_zarr(
                swapped, mode="w", zarr_format=3, consolidated=False
            )
        zarr.create_array(plain, shape=(T, H, W), dtype="f4", zarr_format=3, fill_value=0)
        zarr.open_group(plain.with_name("grouped.zarr"), mode="w").create_array(
            "t2m", shape=(T, H, W), dtype="f4", fill_value=0
        )
        zarr.open_group(empty, mode="w")
    WORLD.Barrier()
    grouped = plain.with_name("grouped.zarr")
    text = expect_everywhere("no dimension names", grouped, manager=manager)
    assert str(grouped) in text and "'t2m'" in text and "Dataset.to_zarr" in text
    array = zarr.open_array(plain, mode="r")
    expect_everywhere("Array, not a group holding a dataset", array, manager=manager)
    expect_everywhere(r"no \(time, \[level,\] lat, lon\) variables", empty, manager=manager)
    not_a_group = r"plain.zarr: not a readable Zarr store .*Array, not a group"
    expect_everywhere(not_a_group, plain, manager=manager)
    expect_everywhere("no such store", shared / "absent.zarr", manager=manager)
    swap = r"'t2m' has dimensions \('time', 'longitude', 'latitude'\)"
    text = expect_everywhere(swap, swapped, manager=manager)
    assert "transpose" in text
