"""The Zarr reader in one process: `mpidp sample-data --format zarr`, a .zip store, pickling
(DataLoader workers), and mpidp without zarr installed (no MPI launch)."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import textwrap

import torch
import xarray as xr

from mpidp.io import ShardedH5Dataset, ShardedZarrDataset, make_sample_data

ARGS = dict(n_lat=11, n_lon=12, n_time=4)
OPTIONS = dict(halo=1, boundary="polar", input_steps=2, variables=["t2m", ("t", [1])])


def _same(a, b) -> None:
    assert len(a) == len(b) and a.channels == b.channels
    for i in range(len(a)):
        for u, v in zip(a[i], b[i], strict=True):
            assert torch.equal(u, v)


def test_sample_data_cli_writes_a_zarr_store(tmp_path):
    store, h5 = tmp_path / "era5-like.zarr", tmp_path / "era5-like.nc"
    command = [sys.executable, "-m", "mpidp", "sample-data", str(store), "--format", "zarr"]
    command += ["--lat", "11", "--lon", "12", "--time", "4"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert "(a Zarr store)" in out.stdout
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    make_sample_data(h5, **ARGS)
    _same(ShardedZarrDataset(store, **OPTIONS), ShardedH5Dataset(h5, **OPTIONS))
    with xr.open_zarr(store) as ds:
        assert ds["t"].dims == ("time", "level", "latitude", "longitude")
        assert ds["t2m"].attrs["units"] == "K" and float(ds["latitude"][0]) == 90.0


def test_zip_store_and_format_2(tmp_path):
    h5 = make_sample_data(tmp_path / "s.nc", **ARGS)
    store = make_sample_data(tmp_path / "s.zarr", **ARGS, format="zarr", zarr_format=2)
    zipped = shutil.make_archive(str(tmp_path / "s.zarr"), "zip", root_dir=store)
    want = ShardedH5Dataset(h5, **OPTIONS)
    _same(ShardedZarrDataset(store, **OPTIONS), want)
    _same(ShardedZarrDataset(zipped, **OPTIONS), want)


def test_rewriting_a_store_replaces_it(tmp_path):
    store = make_sample_data(tmp_path / "s.zarr", **ARGS, format="zarr")
    make_sample_data(store, **ARGS, format="zarr", seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    fresh = make_sample_data(tmp_path / "fresh.zarr", **ARGS, format="zarr", seed=1)
    _same(ShardedZarrDataset(store), ShardedZarrDataset(fresh))


def test_a_pickled_dataset_reads_the_same(tmp_path):
    """What a DataLoader worker gets: the store reopened (a path) or the group itself."""
    import zarr

    store = make_sample_data(tmp_path / "s.zarr", **ARGS, format="zarr")
    for given in (store, zarr.open_group(store, mode="r")):
        ds = ShardedZarrDataset(given, **OPTIONS)
        ds[0]  # arrays opened in this process are not pickled
        _same(pickle.loads(pickle.dumps(ds)), ds)


def test_without_zarr_hdf5_works_and_zarr_says_what_to_install(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["zarr"] = None  # import zarr raises ImportError
        from mpidp.cli import main
        from mpidp.errors import DataError
        from mpidp.io import ShardedH5Dataset, ShardedZarrDataset, make_sample_data
        from mpidp.io import zarr_available
        assert not zarr_available()
        path = make_sample_data({str(tmp_path / "s.nc")!r}, n_lat=5, n_lon=4, n_time=3)
        assert ShardedH5Dataset(path)[0][0].shape == (6, 5, 4)
        try:
            ShardedZarrDataset({str(tmp_path / "s.zarr")!r})
        except DataError as err:
            print(err)
        assert main(["sample-data", {str(tmp_path / "s.zarr")!r}, "--format", "zarr"]) == 2
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "zarr is not installed" in out.stdout and "pip install 'mpidp[zarr]'" in out.stdout
    assert "pip install 'mpidp[zarr]'" in out.stderr  # the command line's message
