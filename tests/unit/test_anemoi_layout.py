"""anemoi-datasets' layout in one process: finding the regular grid in flattened coordinates,
recognising the layout, ``mpidp sample-data --format anemoi``, pickling (DataLoader workers)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from mpidp.io import ShardedH5Dataset, ShardedZarrDataset, make_sample_data
from mpidp.io.zarr_reader import AnemoiGrid, anemoi_layout, regular_rows

ARGS = dict(n_lat=11, n_lon=12, n_time=4)


def _grid(rows: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    lat = np.repeat(np.linspace(90, -90, rows), columns)
    return lat, np.tile(np.arange(columns) * 360.0 / columns, rows)


def test_regular_rows_from_the_coordinates():
    assert regular_rows(*_grid(5, 8)) == (5, 8)
    assert regular_rows(*_grid(5, 8), [5, 8]) == (5, 8)
    assert regular_rows(*_grid(1, 8)) == (1, 8)
    assert regular_rows(*_grid(5, 8), [4, 9]) == (5, 8)  # an attribute of another size
    lat, lon = _grid(5, 8)
    assert "not a whole number of rows of 8" in regular_rows(lat[:-3], lon[:-3])
    lon[17] += 1
    assert regular_rows(lat, lon) == "the longitudes of row 2 (points 16:24) are not row 0's"
    lat, lon = _grid(5, 8)
    assert "row 0 (points 0:10) spans latitudes 45 to 90" == regular_rows(lat, lon, [4, 10])


def test_layout_recognised_by_its_arrays(tmp_path):
    xarray_store = make_sample_data(tmp_path / "x.zarr", **ARGS, format="zarr")
    anemoi = make_sample_data(tmp_path / "a.zarr", **ARGS, format="anemoi")
    assert anemoi_layout("x", zarr.open_group(xarray_store, mode="r")) is None
    group = zarr.open_group(anemoi, mode="r+")
    names = ("t2m", "msl", "z_500", "z_850", "t_500", "t_850")
    assert anemoi_layout("a", group) == AnemoiGrid(names, 11, 12)
    del group.attrs["variables"], group.attrs["field_shape"]
    group.attrs["name_to_index"] = {n: i for i, n in enumerate(names)}  # the older attribute
    assert anemoi_layout("a", group) == AnemoiGrid(names, 11, 12)
    group.attrs["name_to_index"] = {"t2m": 0}
    assert "variables {'t2m': 0}" not in str(anemoi_layout("a", group))
    assert "variables ['t2m']" in str(anemoi_layout("a", group))


def test_sample_data_cli_writes_an_anemoi_store(tmp_path):
    store, h5 = tmp_path / "era5-like.zarr", tmp_path / "era5-like.nc"
    command = [sys.executable, "-m", "mpidp", "sample-data", str(store), "--format", "anemoi"]
    command += ["--lat", "11", "--lon", "12", "--time", "4"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert "anemoi-datasets' layout" in out.stdout
    make_sample_data(h5, **ARGS)
    options = dict(halo=1, boundary="polar", input_steps=2)
    got = ShardedZarrDataset(store, ["t2m", "t_850"], **options)
    want = ShardedH5Dataset(h5, ["t2m", ("t", [1])], **options)
    for i in range(len(want)):
        for u, v in zip(got[i], want[i], strict=True):
            assert torch.equal(u, v)
    ds = pickle.loads(pickle.dumps(got))  # what a DataLoader worker gets
    assert all(torch.equal(u, v) for u, v in zip(ds[1], got[1], strict=True))


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'hdf5', 'zarr', 'anemoi'"):
        make_sample_data(tmp_path / "s", **ARGS, format="grib")
