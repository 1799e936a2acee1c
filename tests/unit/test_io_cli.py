"""The sample-data command line and the one-process reader (no MPI launch)."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpidp.errors import DataError
from mpidp.io import ShardedH5Dataset, ensure_sample_data


def test_sample_data_cli_writes_a_readable_file(tmp_path):
    path = tmp_path / "era5-like.nc"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpidp",
            "sample-data",
            str(path),
            "--lat",
            "19",
            "--lon",
            "36",
            "--time",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "wrote" in out.stdout
    with h5py.File(path, "r") as f:
        assert f["t2m"].shape == (8, 19, 36) and f["z"].shape == (8, 2, 19, 36)
        np.testing.assert_allclose(f["latitude"][[0, -1]], [90.0, -90.0])
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    ds = ShardedH5Dataset(path)  # one process, no manager: the whole grid is one band
    x, y = ds[0]
    assert x.shape == (6, 19, 36) and y.shape == (6, 19, 36)
    assert abs(float(x.mean())) < 0.5 and 0.5 < float(x.std()) < 1.5  # normalised
    # Weather moves: the next step differs from this one, but stays correlated with it.
    corr = np.corrcoef(x.flatten(), y.flatten())[0, 1]
    assert 0.5 < corr < 0.9999
    ds.close()


def test_one_process_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        ShardedH5Dataset(tmp_path / "absent.h5")


def test_cached_sample_data_is_regenerated_when_stale(tmp_path, monkeypatch):
    """A cached sample file is kept only when this generator wrote it with these arguments."""
    import mpidp.io.sample as sample

    path = tmp_path / "cache.h5"
    args = dict(n_lat=7, n_lon=8, n_time=3)
    assert ensure_sample_data(path, **args)[1] == "missing"
    stamp = path.stat().st_mtime_ns
    assert ensure_sample_data(path, **args) == (path, "")  # current: kept as it is
    assert path.stat().st_mtime_ns == stamp
    # other arguments: the cached file is not what was asked for
    assert "other arguments" in ensure_sample_data(path, **{**args, "n_time": 4})[1]
    with h5py.File(path, "r") as f:
        assert f["t2m"].shape == (4, 7, 8)
    # the generator's code changed (its fingerprint hashes the module's source)
    real = sample.sample_fingerprint
    monkeypatch.setattr(sample, "sample_fingerprint", lambda **a: "x" + real(**a))
    assert "another version" in ensure_sample_data(path, n_lat=7, n_lon=8, n_time=4)[1]
    monkeypatch.undo()
    assert ensure_sample_data(path, n_lat=7, n_lon=8, n_time=4)[1]  # and back
    # a file from before fingerprints (or anyone else's) and a corrupt one are replaced
    with h5py.File(path, "a") as f:
        del f.attrs[sample.FINGERPRINT_ATTR]
    assert ensure_sample_data(path, n_lat=7, n_lon=8, n_time=4)[1]
    path.write_bytes(b"not hdf5")
    assert "unreadable" in ensure_sample_data(path, n_lat=7, n_lon=8, n_time=4)[1]
    assert ensure_sample_data(path, n_lat=7, n_lon=8, n_time=4)[1] == ""
