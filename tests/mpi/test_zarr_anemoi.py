"""The Zarr reader on anemoi-datasets' layout at 1-4 ranks (19 rows: uneven over 2, 3 and 4):
one flattened ``data`` array (time, variable, ensemble, values) read as a regular grid. Every
item equals bit for bit ShardedH5Dataset's on the same values from netCDF-4 (``t_500`` against
level 0 of ``t``), for Zarr formats 2 and 3, both latitude orders, from a path and an opened
group, ensemble member 0 of two; only the chunks overlapping a rank's rows are fetched, for
chunks of values that do not align with rows (a counting store); a grid that is not regular,
missing variable names or coordinates and a missing variable raise the same clear error on
every rank."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
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
#: The store's variables in its order, and what each is in the netCDF-4 file.
NAMES = ["t2m", "msl", *(f"{v}_{lev}" for v in ("z", "t") for lev in LEVELS)]
CHUNKS = (24, 40)  # values per chunk: 1.5 and 2.5 rows of 16


def _h5_selection(names: list[str]) -> list:
    """The netCDF-4 selection of the anemoi variables ``names``: ``t_700`` is ``("t", [1])``."""
    out: list = []
    for n in names:
        var, _, lev = n.partition("_")
        out.append((var, [LEVELS.index(int(lev))]) if lev else var)
    return out


@pytest.fixture(scope="module")
def shared() -> Path:
    path = WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-anemoi-") if ME == 0 else None)
    yield Path(path)
    WORLD.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


def _anemoi_store(h5: Path, dst: Path, fmt: int, chunk: int) -> None:
    """The netCDF-4 file in anemoi-datasets' layout, its row order kept: two ensemble members
    (member 1 is member 0 plus 1000, never to be read), ``chunk`` values per chunk, the
    variable names on the root group (format 3, as anemoi-datasets) or on ``data`` (format 2),
    no ``field_shape`` (the grid is found from the coordinates)."""
    with xr.open_dataset(h5, engine="h5netcdf", decode_times=False) as ds:
        fields, means, stds = [], [], []
        for var in _h5_selection(NAMES):
            name, level = (var, None) if isinstance(var, str) else (var[0], var[1][0])
            a = ds[name] if level is None else ds[name].isel(level=level)
            fields.append(a.values.reshape(T, H * W))
            mean, std = (np.atleast_1d(ds[name].attrs[k]) for k in ("mean", "std"))
            means.append(mean[level or 0])
            stds.append(std[level or 0])
        lat, lon = ds["latitude"].values, ds["longitude"].values
    root = zarr.open_group(dst, mode="w", zarr_format=fmt)
    values = np.stack(fields, axis=1)[:, :, None]
    data = root.create_array(
        "data", shape=(T, len(NAMES), 2, H * W), dtype=np.float32, chunks=(1, 1, 1, chunk)
    )
    data[...] = np.concatenate([values, values + 1000], axis=2)
    (root if fmt == 3 else data).attrs["variables"] = NAMES
    dates = np.datetime64("2000-01-01", "s") + np.arange(T) * np.timedelta64(6, "h")
    arrays = dict(latitudes=np.repeat(lat, W), longitudes=np.tile(lon, H), mean=means, stdev=stds)
    for name, v in {**arrays, "dates": dates}.items():
        v = np.asarray(v)
        root.create_array(name, shape=v.shape, dtype=v.dtype)[...] = v


@pytest.fixture(scope="module")
def data(shared) -> dict:
    """netCDF-4 files in both latitude orders and their anemoi-datasets copies (formats 2 and
    3, chunks of 24 and 40 values), written by rank 0."""
    h5 = {"n2s": shared / "sample.nc", "s2n": shared / "sample-s2n.nc"}
    stores = {
        (fmt, order, chunk): shared / f"anemoi-{order}-v{fmt}-c{chunk}.zarr"
        for fmt in (2, 3)
        for order in ORDERS
        for chunk in CHUNKS
    }
    if ME == 0:
        make_sample_data(h5["n2s"], n_lat=H, n_lon=W, n_time=T, levels=LEVELS)
        with xr.open_dataset(h5["n2s"], engine="h5netcdf", decode_times=False) as ds:
            ds.isel(latitude=slice(None, None, -1)).to_netcdf(h5["s2n"], engine="h5netcdf")
        for (fmt, order, chunk), path in stores.items():
            _anemoi_store(h5[order], path, fmt, chunk)
    WORLD.Barrier()
    return {"h5": h5, "anemoi": stores}


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=P) as m:
        yield m


def _assert_same_items(a, b) -> None:
    """Equal items, rows and latitudes (channel names differ: ``t_500`` against ``t500``)."""
    assert len(a) == len(b) and len(a.channels) == len(b.channels) and a.rows == b.rows
    np.testing.assert_array_equal(a.latitudes, b.latitudes)
    np.testing.assert_array_equal(a.longitudes, b.longitudes)
    for i in range(len(a)):
        for u, v in zip(a[i], b[i], strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert torch.equal(u, v), f"item {i} differs on rank {ME}"


POLAR = dict(
    variables=["t2m", "t_500", "t_850", "z_500", "z_700", "z_850"],
    targets=["msl", "z_700"],
    halo=(2, 1),
    boundary="polar",
    input_steps=2,
    lead_time=1,
)
PLAIN = dict(normalize=None, dtype=torch.float64)


def _as_h5(options: dict) -> dict:
    out = dict(options)
    for key in ("variables", "targets"):
        out[key] = _h5_selection(options.get(key, NAMES))
    return out


@pytest.mark.parametrize("opened", ["path", "group"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("case", ["polar", "plain"])
def test_items_equal_hdf5_bit_for_bit(manager, data, case, fmt, order, opened):
    """Stored statistics (the store's mean and stdev arrays) under polar; every variable
    unnormalised in float64 otherwise."""
    options = POLAR if case == "polar" else PLAIN
    path = data["anemoi"][fmt, order, CHUNKS[fmt - 2]]
    store = path if opened == "path" else zarr.open_group(path, mode="r")
    got = ShardedZarrDataset(store, manager=manager, **options)
    want = ShardedH5Dataset(data["h5"][order], manager=manager, **_as_h5(options))
    _assert_same_items(got, want)
    assert got.channels == options.get("variables", NAMES)
    if case == "polar":
        assert got.halo == (2, 1) and torch.equal(got.std, want.std)
    assert got.times[1] - got.times[0] == np.timedelta64(6, "h")


def test_computed_statistics_and_uneven_spec(manager, data):
    """normalize='compute' reads the same band values: the same float64 statistics; a
    partition of one thin band and one wide one."""
    spec = [1] * (P - 1) + [H - (P - 1)]
    options = dict(manager=manager, spec=spec, normalize="compute", halo=1, boundary="polar")
    got = ShardedZarrDataset(data["anemoi"][3, "s2n", 40], **options)
    want = ShardedH5Dataset(data["h5"]["s2n"], **_as_h5(options))
    assert torch.equal(got.mean, want.mean) and torch.equal(got.std, want.std)
    _assert_same_items(got, want)


def test_sample_data_as_anemoi_equals_hdf5(manager, shared):
    """``make_sample_data(format="anemoi")``: the same values and statistics, one variable per
    level, the attributes anemoi-datasets reads."""
    h5, store = shared / "gen.nc", shared / "gen-anemoi.zarr"
    if ME == 0:
        make_sample_data(h5, n_lat=H, n_lon=W, n_time=3)
        make_sample_data(store, n_lat=H, n_lon=W, n_time=3, format="anemoi", zarr_format=2)
    WORLD.Barrier()
    options = dict(manager=manager, halo=1, boundary="polar", input_steps=2)
    got = ShardedZarrDataset(store, ["t2m", "z_850", "t_500", "msl"], **options)
    want = ShardedH5Dataset(h5, ["t2m", ("z", [1]), ("t", [0]), "msl"], **options)
    _assert_same_items(got, want)
    root = zarr.open_group(store, mode="r")
    assert root.attrs["variables"] == ["t2m", "msl", "z_500", "z_850", "t_500", "t_850"]
    assert root.attrs["field_shape"] == [H, W] and root["data"].shape == (3, 6, 1, H * W)
    assert [root[k].shape for k in ("mean", "stdev", "minimum", "maximum")] == [(6,)] * 4


# -- what a rank fetches -----------------------------------------------------------------------


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[lo, hi)`` of consecutive ``rows`` (sorted)."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and r == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([r, r + 1])
    return [(lo, hi) for lo, hi in runs]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("fmt", [2, 3])
def test_fetches_only_the_chunks_overlapping_its_rows(manager, data, fmt, chunk, order):
    """One read per run of rows and variable: the chunks of member 0 overlapping the run's
    values, each once per run (a chunk two runs share, twice), no other."""
    counting = LoggingStore(LocalStore(data["anemoi"][fmt, order, chunk], read_only=True))
    chosen = ["t2m", "t_500", "t_850"]
    ds = ShardedZarrDataset(
        zarr.open_group(counting, mode="r"),
        chosen,
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
    numbers = torch.arange(0.0, H).view(1, H, 1).repeat(1, 1, W)
    needed = sorted(int(r) for r in serial_halo(numbers, *ds.rows, -2, "polar", -1).unique())
    want: Counter[str] = Counter()
    for lo, hi in _runs(needed):
        a, b = (H - hi, H - lo) if order == "s2n" else (lo, hi)
        for k in range(a * W // chunk, (b * W - 1) // chunk + 1):
            want.update(chunk_key(fmt, "data", (time, NAMES.index(v), 0, k)) for v in chosen)
    assert Counter(fetched) == want, (ME, sorted(fetched), sorted(want.elements()))
    table = WORLD.gather((ME, ds.rows, len(fetched), -(-H * W // chunk) * len(chosen)), root=0)
    if ME == 0:
        print(f"\nformat {fmt}, {chunk}-value chunks, {order}: (rank, rows, fetched, all)")
        for line in table:
            print("  ", line)


# -- bad input: the same clear error on every rank ---------------------------------------------


def _edited_copy(data: dict, shared: Path, name: str, edit) -> Path:
    """A copy of a format-3 anemoi store, changed by ``edit(root group)`` on rank 0."""
    path = shared / name
    if ME == 0:
        shutil.copytree(data["anemoi"][3, "n2s", 40], path)
        edit(zarr.open_group(path, mode="a"))
    WORLD.Barrier()
    return path


def _points(lat: np.ndarray, lon: np.ndarray):
    """An edit that replaces the store's coordinates by these points."""

    def edit(group) -> None:
        for name, values in (("latitudes", lat), ("longitudes", lon)):
            del group[name]
            group.create_array(name, shape=values.shape, dtype=values.dtype)[...] = values
        group.attrs.pop("field_shape", None)

    return edit


def _reduced() -> tuple[np.ndarray, np.ndarray]:
    """A reduced grid of 304 points: rows of 8, 12, 16, ... points, fewer near the poles."""
    counts = [8, 12, 16, 20, 24, 28, 32, 32, 32, 28, 24, 20, 16, 8, 4]
    assert sum(counts) == H * W
    lats = np.linspace(80, -80, len(counts))
    lat = np.repeat(lats, counts)
    lon = np.concatenate([np.arange(c) * 360.0 / c for c in counts])
    return lat, lon


@pytest.mark.parametrize("grid", ["reduced", "scattered"])
def test_grid_that_is_not_regular(manager, data, shared, grid):
    if grid == "reduced":
        lat, lon = _reduced()
    else:
        gen = np.random.default_rng(0)
        lat, lon = gen.uniform(-90, 90, H * W), gen.uniform(0, 360, H * W)
    path = _edited_copy(data, shared, f"{grid}.zarr", _points(lat, lon))
    text = expect_everywhere("not a regular latitude-longitude grid", path, manager=manager)
    assert str(path) in text and "regrid" in text and "graph model" in text


def test_missing_variable_names(manager, data, shared):
    path = _edited_copy(data, shared, "unnamed.zarr", lambda g: g.attrs.__delitem__("variables"))
    text = expect_everywhere("no 'variables' attribute", path, ["t2m"], manager=manager)
    assert str(path) in text and "group.attrs['variables']" in text


def test_missing_variable(manager, data):
    path = data["anemoi"][2, "s2n", 40]
    text = expect_everywhere(r"no variable \['q'\]", path, ["t2m", "q"], manager=manager)
    assert str(path) in text and "'t_500'" in text  # the store and what it has


def test_bad_coordinates_and_data_shape(manager, data, shared):
    def short(group) -> None:
        lat = group["latitudes"][...]
        del group["latitudes"]
        group.create_array("latitudes", shape=(H * W - 1,), dtype=lat.dtype)[...] = lat[:-1]

    path = _edited_copy(data, shared, "short.zarr", short)
    text = expect_everywhere(
        r"'latitudes' has shape \(303,\), 'data' has 304", path, manager=manager
    )
    assert str(path) in text and "of length 304" in text

    def flat(group) -> None:
        del group["data"]
        group.create_array("data", shape=(T, len(NAMES), H * W), dtype="f4", fill_value=0)

    path = _edited_copy(data, shared, "three-d.zarr", flat)
    text = expect_everywhere(r"'data' has shape \(4, 8, 304\)", path, manager=manager)
    assert "(time, variable, ensemble, values)" in text
