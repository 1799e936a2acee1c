"""The readers follow the partition (issue 48): a ShardedH5Dataset or ShardedZarrDataset cut by
the manager reads the next item with the new bands after ``manager.set_partition``, from a
real netCDF-4 file and a real Zarr store at 1-3 ranks; an explicit spec stays as given."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpidp.errors import ConfigError
from mpidp.io import ShardedH5Dataset, ShardedZarrDataset, make_sample_data
from mpidp.runtime.partition import Balanced, Weighted

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P, ME = WORLD.Get_size(), WORLD.Get_rank()
H, W, T = 13, 8, 4
NAMES = ("msl", "t", "t2m", "z")


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    """The sample data as netCDF-4 and as a Zarr store (the same values), by rank 0."""
    folder = Path(WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-follow-") if ME == 0 else None))
    out = {"hdf5": folder / "sample.nc", "zarr": folder / "sample.zarr"}
    if ME == 0:
        for fmt, path in out.items():
            make_sample_data(path, n_lat=H, n_lon=W, n_time=T, format=fmt)
    WORLD.Barrier()
    yield out
    WORLD.Barrier()
    if ME == 0:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def m(manager):
    yield manager
    manager.partition = Balanced()


def full_field(path: Path) -> np.ndarray:
    """(time, channel, lat, lon) of the whole netCDF-4 file, north first."""
    with h5py.File(path, "r") as f:
        blocks = [f[n][()] if f[n].ndim == 4 else f[n][()][:, None] for n in NAMES]
    return np.concatenate(blocks, axis=1).astype(np.float64)


READERS = {"hdf5": ShardedH5Dataset, "zarr": ShardedZarrDataset}


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_next_item_is_read_with_the_new_bands(m, files, fmt):
    full = torch.from_numpy(full_field(files["hdf5"]))
    common = dict(variables=list(NAMES), targets=list(NAMES), normalize=None, dtype=torch.float64)
    ds = READERS[fmt](files[fmt], manager=m, **common)
    fixed = READERS[fmt](files[fmt], manager=m, spec=list(m.spec(H).sizes), **common)
    old = m.spec(H)
    x, y = ds[0]
    torch.testing.assert_close(x, full[0][:, old.slice(ME)], rtol=0, atol=0)

    m.set_partition(Weighted(tuple(1 + 2 * r for r in range(P))), rows=H)  # uneven
    new = m.spec(H)
    assert P == 1 or new.sizes != old.sizes
    x, y = ds[1]
    assert ds.spec == new and ds.rows == (new.start(ME), new.stop(ME))
    torch.testing.assert_close(x, full[1][:, new.slice(ME)], rtol=0, atol=0)
    torch.testing.assert_close(y, full[2][:, new.slice(ME)], rtol=0, atol=0)
    # a spec passed in is the caller's: it stays
    x, _ = fixed[1]
    assert fixed.spec == old
    torch.testing.assert_close(x, full[1][:, old.slice(ME)], rtol=0, atol=0)
    ds.close()
    fixed.close()


def test_halo_rows_follow_too(m, files):
    full = torch.from_numpy(full_field(files["hdf5"]))
    ds = ShardedH5Dataset(
        files["hdf5"], list(NAMES), manager=m, halo=1, normalize=None, dtype=torch.float64
    )
    ds[0]
    m.set_partition(Weighted(tuple(P - r for r in range(P))), rows=H)
    new = m.spec(H)
    x, _ = ds[1]
    padded = torch.nn.functional.pad(full[1], (0, 0, 1, 1))  # zeros beyond the poles
    want = padded[:, new.start(ME) : new.stop(ME) + 2]
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    ds.close()


def test_dataloader_workers_follow_between_epochs_and_a_switch_under_them_is_refused(m, files):
    """A DataLoader worker reads with a copy of the reader that set_partition cannot reach:
    while one lives (persistent workers, or mid-epoch) the switch is refused on every rank and
    the partition kept; once the loader's workers ended, the next epoch's workers read the new
    cut (bitwise the file's rows)."""
    full = torch.from_numpy(full_field(files["hdf5"]))
    ds = ShardedH5Dataset(
        files["hdf5"], list(NAMES), m, targets=list(NAMES), normalize=None, dtype=torch.float64
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=1, persistent_workers=True)
    x, _ = next(iter(loader))
    old, policy = m.partition, Weighted(tuple(1 + 2 * r for r in range(P)))
    with pytest.raises(ConfigError, match="live DataLoader worker process") as err:
        m.set_partition(policy, rows=H)
    assert m.partition is old and f"rank {P - 1}: ShardedH5Dataset" in str(err.value)
    torch.testing.assert_close(x[0], full[0][:, m.spec(H).slice(ME)], rtol=0, atol=0)
    del loader  # its workers end
    m.set_partition(policy, rows=H)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=1)
    x, y = next(iter(loader))
    new = m.spec(H)
    torch.testing.assert_close(x[0], full[0][:, new.slice(ME)], rtol=0, atol=0)
    torch.testing.assert_close(y[0], full[1][:, new.slice(ME)], rtol=0, atol=0)
    ds.close()
