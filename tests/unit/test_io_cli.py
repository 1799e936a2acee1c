"""The sample-data command line and the one-process reader (no MPI launch)."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpidp.errors import DataError
from mpidp.io import ShardedH5Dataset


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
