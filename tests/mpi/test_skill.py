"""Forecast skill on bands (mpidp.ops.skill) equals the serial numpy computation of the same
numbers on uneven bands, pooled over one replica or over every replica; the climatology equals
the serial time mean of the file; a rollout written from a dataset carries the source data's CF
attributes (checked with xarray)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import xarray as xr
from mpi4py import MPI

import mpidp
from mpidp.errors import DataError
from mpidp.io import RolloutWriter, ShardedH5Dataset, make_sample_data
from mpidp.ops.skill import SCORES, SkillMeter, climatology, physical_band

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, ME = COMM.Get_size(), COMM.Get_rank()
DOMAIN = 2 if P % 2 == 0 else P  # dp 2 x domain 2 at four ranks
F64 = torch.float64
H, W, T = 13, 16, 6


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=DOMAIN) as m:
        yield m


@pytest.fixture(scope="module")
def shared() -> Path:
    path = COMM.bcast(tempfile.mkdtemp(prefix="mpidp-skill-") if ME == 0 else None)
    yield Path(path)
    COMM.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


def _named(path: Path) -> None:
    """The sample data with CF names of its own on two variables (as ERA5 files carry them),
    none on the others."""
    make_sample_data(path, n_lat=H, n_lon=W, n_time=T)
    with h5py.File(path, "r+") as f:
        for name in ("t2m", "msl", "z", "t"):
            for key in ("long_name", "standard_name"):
                f[name].attrs.pop(key, None)
        f["t2m"].attrs["long_name"] = "2 metre temperature"
        f["t"].attrs.update({"long_name": "Temperature", "standard_name": "air_temperature"})


@pytest.fixture(scope="module")
def sample(shared) -> Path:
    path = shared / "sample.h5"
    if ME == 0:
        _named(path)
    COMM.Barrier()
    return path


def rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def band(manager, full):
    spec = manager.spec(full.size(-2))
    return full.narrow(-2, spec.start(manager.domain_rank), spec.sizes[manager.domain_rank])


def serial_scores(forecast, truth, initial, clim, lat):
    """Per channel (numpy, float64): the five scores of SCORES over batch, rows and lon."""
    w = np.cos(np.deg2rad(lat))[:, None]
    w = np.broadcast_to(w / w.mean(), truth.shape)

    def rmse(p):
        return np.sqrt(((p - truth) ** 2 * w).sum((0, 2, 3)) / w.sum((0, 2, 3)))

    def acc(p):
        a, b = p - clim, truth - clim
        return (a * b * w).sum((0, 2, 3)) / np.sqrt(
            (a * a * w).sum((0, 2, 3)) * (b * b * w).sum((0, 2, 3))
        )

    clim_b = np.broadcast_to(clim, truth.shape)
    return np.stack([rmse(forecast), rmse(initial), rmse(clim_b), acc(forecast), acc(initial)])


def fields(h, batch, channels, seed):
    """A truth that persists partly, forecasts nearer the truth, a climatology: (batch, C, h, W)."""
    clim = 10 + rand((channels, h, W), seed)
    initial = clim + rand((batch, channels, h, W), seed + 1)
    truths = [initial + 0.3 * k * rand((batch, channels, h, W), seed + 10 + k) for k in (1, 2, 3)]
    forecasts = [y + 0.2 * rand(y.shape, seed + 20 + k) for k, y in enumerate(truths)]
    return clim, initial, truths, forecasts


@pytest.mark.parametrize("h", [H, 37])
def test_meter_equals_serial_over_one_replica(manager, h):
    """Default group (the domain group): every replica scores its own forecasts."""
    lat = np.linspace(90, -90, h)
    clim, initial, truths, forecasts = fields(h, 3, 2, seed=100 * manager.dp_rank + h)
    weights = mpidp.latitude_weights(h, manager=manager)
    meter = SkillMeter(["a", "b"], band(manager, initial), band(manager, clim), weights, manager)
    for k, (f, y) in enumerate(zip(forecasts, truths, strict=True), 1):
        meter.add(k, band(manager, f), band(manager, y))
    skill = meter.result()
    assert skill.steps == (1, 2, 3) and skill.forecasts == 3
    for i, (f, y) in enumerate(zip(forecasts, truths, strict=True)):
        want = serial_scores(f.numpy(), y.numpy(), initial.numpy(), clim.numpy(), lat)
        got = np.array([[getattr(s, k) for s in skill.scores[i]] for k in SCORES])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_meter_pools_every_replica_over_the_world(manager):
    """group = the world: each replica passes its share of the batch (the last one may be
    empty at four ranks); the scores are those of the whole batch."""
    lat = np.linspace(90, -90, H)
    dp, r = manager.dp_world_size, manager.dp_rank
    n = 2 * dp - 1  # uneven shares
    clim, initial, truths, forecasts = fields(H, n, 3, seed=7)
    mine = slice(2 * r, min(2 * r + 2, n))
    world = manager.transport("world", "cpu")
    weights = mpidp.latitude_weights(H, manager=manager)
    meter = SkillMeter(
        ["a", "b", "c"],
        band(manager, initial[mine]),
        band(manager, clim),
        weights,
        manager,
        units=["K", "Pa", ""],
        forecasts=n,
        group=world,
    )
    for k, (f, y) in enumerate(zip(forecasts, truths, strict=True), 1):
        meter.add(k, band(manager, f[mine]), band(manager, y[mine]))
    skill = meter.result()
    assert skill.forecasts == n and skill.units == ("K", "Pa", "")
    for i, (f, y) in enumerate(zip(forecasts, truths, strict=True)):
        want = serial_scores(f.numpy(), y.numpy(), initial.numpy(), clim.numpy(), lat)
        got = np.array([[getattr(s, k) for s in skill.scores[i]] for k in SCORES])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    # every rank holds the same result: one table
    assert len(set(world.all_gather_object(skill.table()))) == 1


def test_climatology_and_physical_band_equal_the_file(manager, sample):
    ds = ShardedH5Dataset(sample, manager=manager, dtype=F64, halo=1)
    with h5py.File(sample, "r") as f:
        full = np.concatenate(
            [f[n][()] if f[n].ndim == 4 else f[n][()][:, None] for n in ("msl", "t", "t2m", "z")],
            axis=1,
        ).astype(np.float64)
    assert ds.channels == ["msl", "t500", "t850", "t2m", "z500", "z850"]
    spec = manager.spec(H)
    rows = slice(spec.start(manager.domain_rank), spec.stop(manager.domain_rank))
    times = [0, 1, 2, 4]
    got = climatology(ds, times, manager)
    want = torch.from_numpy(full[times].mean(0)[:, rows])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(physical_band(ds, 3), torch.from_numpy(full[3][:, rows]))
    raw = ShardedH5Dataset(sample, manager=manager, dtype=F64, normalize=None)
    torch.testing.assert_close(climatology(raw, times, manager), want, rtol=1e-12, atol=0)
    ds.close()
    raw.close()


def test_rollout_from_a_dataset_carries_its_cf_attributes(manager, sample, shared):
    """units and long_name of the source on every variable (a level's channel names its
    level), standard_name where the source has one; coordinates with their CF units."""
    ds = ShardedH5Dataset(sample, manager=manager)
    assert ds.attributes["t500"] == {
        "units": "K",
        "long_name": "Temperature at 500 hPa",
        "standard_name": "air_temperature",
    }
    assert ds.attributes["t2m"] == {"units": "K", "long_name": "2 metre temperature"}
    assert ds.attributes["msl"] == {"units": "Pa", "long_name": "msl"}  # the name, when none
    path = shared / f"rollout-{manager.dp_rank}.nc"
    with RolloutWriter(
        path,
        ds.channels,
        ds.latitudes,
        ds.longitudes,
        manager,
        time_units="hours since 2000-01-01",
        attrs={"source": "test"},
        variable_attrs=ds.attributes,
    ) as out:
        for k in range(2):
            out.write(ds.read_band(k), time=6.0 * k)
    COMM.Barrier()
    with xr.open_dataset(path, engine="h5netcdf") as xds:
        for c in ds.channels:
            assert xds[c].attrs["units"] == ds.attributes[c]["units"]
            assert xds[c].attrs["long_name"] == ds.attributes[c]["long_name"]
            assert xds[c].attrs["source"] == "test"
        assert xds["z850"].attrs["units"] == "m2 s-2"
        assert xds["z850"].attrs["long_name"] == "z at 850 hPa"
        assert xds["t850"].attrs["standard_name"] == "air_temperature"
        assert xds["latitude"].attrs["units"] == "degrees_north"
        assert xds["longitude"].attrs["units"] == "degrees_east"
        assert xds["time"].attrs["standard_name"] == "time"
        assert str(xds["time"].values[1])[:13] == "2000-01-01T06"
    ds.close()


def test_inconsistent_variable_attrs_fail_everywhere(manager, shared):
    if manager.domain_world_size == 1:
        pytest.skip("needs two domain ranks")
    attrs = {"a": {"units": "K" if manager.domain_rank == 0 else "degC"}}
    with pytest.raises(DataError, match="variable_attrs"):
        RolloutWriter(shared / "bad.nc", ["a"], manager=manager, variable_attrs=attrs)
