"""RolloutWriter on latitude x longitude blocks (issue 46, item 5), at every grid that fits the
world (bands are the grid (P, 1)): each rank writes its rows x columns of each step into the
one netCDF-4 file or Zarr store, uneven in both dims and with the cut changed between steps;
read back serially (xarray) the forecast equals the serial rollout bitwise. What cannot be
written raises the same DataError on every rank, naming the fix.

The field is 13 x 20; the Zarr chunks (4 rows by the widest block's columns) straddle the
cuts, so entries travel to their chunk's owner along both dims.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_io_blocks as io_test
import torch
import xarray as xr
from helpers import agreed
from mpi4py import MPI

import mpidp
from mpidp.io import RolloutWriter, zarr_available
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.partition import ShardSpec

pytestmark = pytest.mark.mpi

WORLD, ME = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
H, W, STEPS = 13, 20, 3
LAT, LON = np.linspace(90, -90, H), np.arange(W) * 360.0 / W
# a shared folder (fixture) and the refusal check of test_io_blocks.py; gm is conftest's
shared, _refused = io_test.shared, io_test._refused
FORMATS = ["nc", "zarr"] if zarr_available() else ["nc"]


def cut(n, parts, step):
    """Uneven sizes of ``n`` over ``parts`` that change with ``step`` (a new cut of the same
    grid): one more on the first part at even steps, on the last at odd ones."""
    sizes = list(ShardSpec.balanced(n, parts).sizes)
    if parts > 1:
        big, small = (0, -1) if step % 2 == 0 else (-1, 0)
        sizes[big], sizes[small] = sizes[big] + 1, sizes[small] - 1
    return sizes


def blocks(m, step):
    p_lat, p_lon = m.grid
    return BlockSpec(
        ShardSpec.from_sizes(cut(H, p_lat, step)), ShardSpec.from_sizes(cut(W, p_lon, step))
    )


def rollout():
    """The serial rollout: two channels, STEPS steps, float64."""
    x = torch.randn(2, H, W, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    steps = []
    for _ in range(STEPS):
        x = torch.tanh(x.roll(1, -1) + 0.5 * x.flip(-2))
        steps.append(x)
    return steps


@pytest.mark.parametrize("fmt", FORMATS)
def test_rollout_on_blocks_reads_back_as_the_serial_rollout(gm, shared, fmt):
    """Each rank writes its block of each step (the cut changing between steps; the last
    step a block ShardedTensor); the file opened by xarray holds the serial rollout bitwise,
    with its dims, coordinates and times."""
    steps = rollout()
    path = shared / f"rollout-{gm.grid[0]}x{gm.grid[1]}.{fmt}"
    with RolloutWriter(
        path,
        ["t2m", "z500"],
        LAT,
        LON,
        gm,
        dtype=np.float64,
        chunk_rows=4 if fmt == "zarr" else None,
        variable_attrs={"t2m": {"units": "K"}},
    ) as out:
        for k, field in enumerate(steps[:-1]):
            rows, cols = blocks(gm, k).block(gm.domain_rank)
            out.write(field[None, :, rows, cols], time=6.0 * (k + 1))
        # the last step as a converted model gives it: a block ShardedTensor (the manager's cut)
        out.write(mpidp.shard(steps[-1][None], (-2, -1), gm), time=6.0 * STEPS)
    failures = []
    if ME == 0:
        opened = xr.open_zarr(path) if fmt == "zarr" else xr.open_dataset(path, engine="h5netcdf")
        with opened as ds:
            want = torch.stack(steps).numpy()
            for v, name in enumerate(["t2m", "z500"]):
                got = ds[name].values
                if ds[name].dims != ("time", "latitude", "longitude"):
                    failures.append(f"{name} dims {ds[name].dims}")
                if got.shape != want[:, v].shape or not np.array_equal(got, want[:, v]):
                    failures.append(f"{name} differs from the serial rollout")
            if ds["t2m"].attrs.get("units") != "K":
                failures.append(f"t2m attrs {ds['t2m'].attrs}")
            if not np.array_equal(ds["longitude"].values, LON):
                failures.append("longitude coordinate")
            if not np.array_equal(ds["time"].values, [6.0, 12.0, 18.0]):
                failures.append(f"times {ds['time'].values}")
    assert not agreed(failures), agreed(failures)


def test_blocks_that_do_not_tile_are_refused(gm, shared):
    """The last rank one column short (blocks that do not tile the grid; on one grid row a
    grid narrower than the coordinates'), coordinates of another grid, and a step every rank
    holds whole (full_tensor(): each rank would write it as its block): the same
    DataError on every rank, naming the blocks and the fix; no file is left."""
    if gm.grid[1] == 1:
        pytest.skip("bands: tests/mpi/test_io.py tests the writer's refusals")
    rows, cols = blocks(gm, 0).block(gm.domain_rank)
    path = shared / "refused.nc"
    full = torch.zeros(1, H, W, dtype=torch.float64)
    short = cols.stop - (gm.domain_rank == WORLD - 1)

    def narrow():
        with RolloutWriter(path, ["a"], LAT, LON, gm) as out:
            out.write(full[:, rows, cols.start : short])

    def wrong_grid():
        with RolloutWriter(path, ["a"], LAT, np.arange(W + 1), gm) as out:
            out.write(full[:, rows, cols])

    def whole():
        with RolloutWriter(path, ["a"], LAT, LON, gm) as out:
            out.write(mpidp.shard(full, (-2, -1), gm).full_tensor())

    got = [_refused(narrow), _refused(wrong_grid), _refused(whole)]
    failures = []
    # one grid row: the narrow blocks still tile a grid, one column short of the coordinates'
    short_of = f"columns ({W - 1}), but the coordinates give a {H} x {W} grid; fix: pass"
    want = "do not tile the" if gm.grid[0] > 1 else short_of
    if got[0] is None or want not in got[0] or "pass each rank its own block" not in got[0]:
        failures.append(f"rank {ME}: narrow block: {got[0]!r}")
    want = f"give a {H} x {W + 1} grid; fix: pass each rank its own block of that grid"
    if got[1] is None or want not in got[1] or f"rank {ME}:" not in got[1]:
        failures.append(f"rank {ME}: coordinates of another grid: {got[1]!r}")
    if got[2] is None or "a value every rank holds (Replicated" not in got[2]:
        failures.append(f"rank {ME}: a Replicated step: {got[2]!r}")
    if path.exists() or any(".tmp-" in p.name for p in shared.iterdir()):
        failures.append(f"rank {ME}: a file was left: {sorted(shared.iterdir())}")
    assert not agreed(failures), agreed(failures)
