"""Sharded HDF5 I/O at 1-4 ranks: band reads against the serial slice, padded reads against the
halo exchange, bytes read, write round trips and xarray, rollouts, checkpoints across domain
and data-parallel sizes, and every bad input raising on every rank."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import xarray as xr
from mpi4py import MPI

import mpidp
from mpidp.errors import DataError
from mpidp.io import (
    DataParallelSampler,
    RolloutWriter,
    ShardedH5Dataset,
    load_checkpoint,
    make_sample_data,
    parallel_hdf5_available,
    save_checkpoint,
    write_sharded,
)
from mpidp.runtime.partition import ShardSpec
from mpidp.testing import counting_opener, serial_halo

WORLD = MPI.COMM_WORLD
P, ME = WORLD.Get_size(), WORLD.Get_rank()
F64 = torch.float64
H, W, T = 13, 16, 6
METHODS = ["ordered"] + (["mpio"] if parallel_hdf5_available() else [])
BOUNDARIES = ["zeros", "replicate", "reflect", "symmetric", "circular", "polar", "polar_half"]


@pytest.fixture(scope="module")
def shared() -> Path:
    """A folder every rank sees (made by rank 0), removed at the end of the module."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-io-") if ME == 0 else None)
    yield Path(path)
    WORLD.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


def _on_rank0(fn, *args, **kwargs):
    """Run ``fn`` on rank 0 only (file preparation); every rank waits for it."""
    if ME == 0:
        fn(*args, **kwargs)
    WORLD.Barrier()


def _flipped_copy(src: Path, dst: Path) -> None:
    """The same data stored south to north (rows and latitude reversed)."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        for name in ("latitude", "t2m", "msl", "z", "t"):
            f[name][...] = f[name][()][..., ::-1, :] if f[name].ndim > 1 else f[name][()][::-1]


@pytest.fixture(scope="module")
def sample(shared) -> Path:
    path = shared / "sample.h5"
    _on_rank0(make_sample_data, path, n_lat=H, n_lon=W, n_time=T)
    _on_rank0(_flipped_copy, path, shared / "sample-s2n.h5")
    return path


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=P) as m:
        yield m


def serial_fields(path: Path, names=("msl", "t", "t2m", "z")) -> np.ndarray:
    """(time, channel, lat, lon) of the whole file, north first: the serial reference."""
    with h5py.File(path, "r") as f:
        blocks = [f[n][()] if f[n].ndim == 4 else f[n][()][:, None] for n in names]
        lat = f["latitude"][()]
    out = np.concatenate(blocks, axis=1).astype(np.float64)
    return out[:, :, ::-1] if lat[0] < lat[-1] else out


# At one rank every cut is the whole field: each kind is collected once, not three times.
KINDS = ["balanced", "thin", "weighted"] if P > 1 else ["balanced"]


def specs():
    thin = [1] * (P - 1) + [H - (P - 1)]
    weighted = ShardSpec.from_weights([1 + r for r in range(P)], H).sizes
    return {"balanced": None, "thin": thin, "weighted": list(weighted)}


# -- reading --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("file", ["sample.h5", "sample-s2n.h5"])
def test_band_equals_serial_slice(manager, sample, kind, file):
    spec = specs()[kind]
    ds = ShardedH5Dataset(
        sample.parent / file,
        manager=manager,
        spec=spec,
        normalize=None,
        dtype=F64,
        lead_time=2,
        input_steps=2,
    )
    full = serial_fields(sample)
    s = ds.spec
    assert ds.rows == (s.start(ME), s.stop(ME)) and len(ds) == T - 1 - 2
    np.testing.assert_array_equal(ds.latitudes, np.linspace(90, -90, H))
    for i in range(len(ds)):
        x, y = ds[i]
        want_x = np.concatenate([full[i], full[i + 1]], 0)[:, s.slice(ME)]
        torch.testing.assert_close(x, torch.from_numpy(want_x), rtol=0, atol=0)
        torch.testing.assert_close(y, torch.from_numpy(full[i + 3][:, s.slice(ME)]), rtol=0, atol=0)
    ds.close()


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("widths", [(1, 1), (2, 0), (0, 3), (3, 2)])
@pytest.mark.parametrize("kind", KINDS[:2])
def test_padded_read_equals_halo_exchange(manager, sample, boundary, widths, kind):
    before, after = widths
    spec = specs()[kind]
    common = dict(manager=manager, spec=spec, dtype=F64, normalize="stored")
    padded = ShardedH5Dataset(sample, halo=widths, boundary=boundary, **common)
    plain = ShardedH5Dataset(sample, **common)
    for i in (0, len(plain) - 1):
        want = mpidp.halo_exchange(plain[i][0], before, after, -2, plain.spec, manager, boundary)
        torch.testing.assert_close(padded[i][0], want, rtol=0, atol=0)
        torch.testing.assert_close(padded[i][1], plain[i][1], rtol=0, atol=0)
    padded.close()
    plain.close()


def test_per_rank_halo_widths(manager, sample):
    spec = mpidp.ShardSpec.balanced(H, P)
    halo = mpidp.HaloSpec(tuple(r % 3 for r in range(P)), tuple((r + 1) % 2 for r in range(P)))
    padded = ShardedH5Dataset(sample, manager=manager, halo=halo, boundary="polar", dtype=F64)
    plain = ShardedH5Dataset(sample, manager=manager, dtype=F64)
    want = mpidp.halo_exchange(plain[1][0], halo.before, halo.after, -2, spec, manager, "polar")
    torch.testing.assert_close(padded[1][0], want, rtol=0, atol=0)


@pytest.mark.parametrize("boundary", ["zeros", "reflect", "circular", "polar_half"])
@pytest.mark.parametrize("kind", KINDS[:2])
def test_bytes_read_are_band_plus_halo(manager, sample, boundary, kind):
    """Counted at the file object: the data bytes HDF5 reads are exactly the field rows this
    rank's padded band comes from, for every channel; never the full field."""
    files = []
    halo = (2, 2)
    ds = ShardedH5Dataset(
        sample,
        manager=manager,
        spec=specs()[kind],
        halo=halo,
        boundary=boundary,
        normalize=None,
        opener=counting_opener(files),
        input_steps=1,
        lead_time=0,
    )
    opened_at_construction = len(files)
    ds.read_band(3)
    counted = files[opened_at_construction:]
    assert len(counted) == 1
    with h5py.File(sample, "r") as f:
        extents = [
            (f[n].id.get_offset(), f[n].id.get_storage_size()) for n in ("msl", "t", "t2m", "z")
        ]
    data = sum(n for at, n in counted[0].reads if any(o <= at < o + size for o, size in extents))
    # Which field rows the padded band needs: the serial halo of a field of row numbers.
    rows = torch.arange(1.0, H + 1).view(1, H, 1).repeat(1, 1, W)
    lo, hi = ds.rows
    needed = serial_halo(rows, lo, hi, -2, boundary, -1).unique()
    needed = needed[needed > 0]
    channels = len(ds.channels)
    assert data == len(needed) * W * 4 * channels
    assert data < H * W * 4 * channels or len(needed) == H
    ds.close()


def test_normalize_compute_matches_serial(manager, sample):
    ds = ShardedH5Dataset(sample, manager=manager, normalize="compute")
    full = serial_fields(sample)
    mean = full.mean(axis=(0, 2, 3))
    std = full.std(axis=(0, 2, 3))
    np.testing.assert_allclose(ds.mean.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(ds.std.numpy(), std, rtol=1e-9)
    stored = ShardedH5Dataset(sample, manager=manager, normalize="stored")
    np.testing.assert_allclose(stored.mean.numpy(), mean, rtol=1e-6)


def test_variables_levels_and_targets(manager, sample):
    ds = ShardedH5Dataset(
        sample, ["t2m", ("z", [1])], manager=manager, targets=["t2m"], normalize=None, dtype=F64
    )
    assert ds.channels == ["t2m", "z850"] and ds.target_channels == ["t2m"]
    full = serial_fields(sample)  # msl, t500, t850, t2m, z500, z850
    s = ds.spec.slice(ME)
    x, y = ds[0]
    torch.testing.assert_close(x, torch.from_numpy(full[0][[3, 5]][:, s]), rtol=0, atol=0)
    torch.testing.assert_close(y, torch.from_numpy(full[1][[3]][:, s]), rtol=0, atol=0)


def test_several_files_concatenate_along_time(manager, sample, shared):
    second = shared / "second.h5"
    _on_rank0(make_sample_data, second, n_lat=H, n_lon=W, n_time=4, seed=5)
    ds = ShardedH5Dataset([sample, second], manager=manager, normalize=None, dtype=F64)
    full = np.concatenate([serial_fields(sample), serial_fields(second)], 0)
    assert len(ds) == T + 4 - 1
    s = ds.spec.slice(ME)
    for i in (T - 2, T - 1, T):  # windows inside, across and after the file boundary
        x, y = ds[i]
        torch.testing.assert_close(x, torch.from_numpy(full[i][:, s]), rtol=0, atol=0)
        torch.testing.assert_close(y, torch.from_numpy(full[i + 1][:, s]), rtol=0, atol=0)


def test_dataloader_workers_open_their_own_files(manager, sample):
    ds = ShardedH5Dataset(sample, manager=manager, normalize="stored", dtype=F64)
    ds[0]  # the parent opens its handle first: workers must not reuse it
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, shuffle=False)
    got = torch.cat([x for x, _ in loader])
    want = torch.stack([ds[i][0] for i in range(len(ds))])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("domain", [d for d in (1, 2, 4) if P % d == 0])
def test_sampler_splits_dp_and_repeats_domain(domain):
    """Every layout this world allows: dp > 1 splits (P = 2, 3, 4 with domain 1), domain
    peers repeat (domain 2 and 4); at one rank the one replica reads every sample."""
    with mpidp.DistributedManager(domain_parallel_size=domain) as m:
        data = list(range(11))
        sampler = DataParallelSampler(data, m, seed=3)
        sampler.set_epoch(2)
        mine = list(sampler)
        if m.dp_world_size == 1:
            assert sorted(mine) == data and mine != data  # all of it, shuffled
        table = WORLD.allgather((m.dp_rank, m.domain_rank, mine))
        by_dp = {dp: idx for dp, dom, idx in table if dom == 0}
        for dp, _, idx in table:
            assert idx == by_dp[dp]  # domain peers read the same samples
        assert len({len(v) for v in by_dp.values()}) == 1
        union = sorted(i for v in by_dp.values() for i in v)
        assert set(union) == set(data) and len(union) == len(mine) * m.dp_world_size
        again = DataParallelSampler(data, m, seed=3)
        again.set_epoch(2)
        assert list(again) == mine
        again.set_epoch(3)
        assert m.dp_world_size == 1 or list(again) != mine or len(data) < 3


# -- writing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_write_read_round_trip(manager, shared, method, kind):
    sizes = specs()[kind] or list(ShardSpec.balanced(H, P).sizes)
    spec = ShardSpec.from_sizes(sizes)
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(2, 3, H, W, generator=gen, dtype=F64)
    path = shared / f"out-{method}-{kind}.nc"
    lat, lon = np.linspace(90, -90, H), np.arange(W) * 360.0 / W
    write_sharded(
        path,
        "x",
        full[:, :, spec.slice(ME)],
        manager=manager,
        method=method,
        dims=("time", "channel", "latitude", "longitude"),
        coords={"latitude": lat, "longitude": lon, "time": np.array([0.0, 6.0])},
        attrs={"units": "K"},
    )
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["x"][()], full.numpy())
    with xr.open_dataset(path, engine="h5netcdf") as xds:
        assert xds["x"].dims == ("time", "channel", "latitude", "longitude")
        np.testing.assert_array_equal(xds["latitude"].values, lat)
        np.testing.assert_array_equal(xds["longitude"].values, lon)
        assert xds["x"].attrs["units"] == "K"
    # A second variable added to the same file keeps the first.
    write_sharded(path, "y", full[0, 0, spec.slice(ME)], manager=manager, method=method, mode="a")
    with xr.open_dataset(path, engine="h5netcdf") as xds:
        assert set(xds.data_vars) == {"x", "y"} and xds["y"].dims == ("latitude", "longitude")
        np.testing.assert_array_equal(xds["y"].values, full[0, 0].numpy())
    # The written file reads back through the sharded reader.
    back = ShardedH5Dataset(
        path, "x", manager=manager, spec=sizes, normalize=None, dtype=F64, lead_time=0
    )
    torch.testing.assert_close(back[1][0], full[1][:, spec.slice(ME)], rtol=0, atol=0)
    back.close()


@pytest.mark.parametrize("method", METHODS)
def test_rollout_writer(manager, shared, method):
    spec = manager.spec(H)
    path = shared / f"rollout-{method}.nc"
    lat, lon = np.linspace(90, -90, H), np.arange(W) * 360.0 / W
    steps = [torch.randn(2, H, W, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with RolloutWriter(
        path, ["t2m", "z500"], lat, lon, manager, method=method, time_units="hours since 2000-01-01"
    ) as out:
        for k, field in enumerate(steps):
            out.write(field[:, spec.slice(ME)][None], time=6.0 * (k + 1))
            assert not path.exists()  # published only at close
    with xr.open_dataset(path, engine="h5netcdf") as xds:
        assert xds["t2m"].dims == ("time", "latitude", "longitude")
        assert xds.sizes["time"] == 3
        times = [str(t)[:13] for t in xds["time"].values]
        assert times == ["2000-01-01T06", "2000-01-01T12", "2000-01-01T18"]
        np.testing.assert_array_equal(xds["latitude"].values, lat)
        np.testing.assert_array_equal(xds["longitude"].values, lon)
        # every variable at every step, each in its own slot (not one slice of one variable)
        for v, name in enumerate(["t2m", "z500"]):
            np.testing.assert_array_equal(xds[name].values, torch.stack(steps)[:, v].numpy())
    # A rollout that fails leaves the published file as it was.
    before = path.read_bytes() if ME == 0 else None
    with pytest.raises(RuntimeError, match="model blew up"):
        with RolloutWriter(path, ["t2m", "z500"], lat, lon, manager, method=method) as out:
            out.write(steps[0][:, spec.slice(ME)])
            raise RuntimeError("model blew up")
    WORLD.Barrier()
    if ME == 0:
        assert path.read_bytes() == before
        assert not [p for p in os.listdir(path.parent) if ".tmp-" in p]


def test_failed_write_on_one_rank_leaves_file_untouched(manager, shared, monkeypatch):
    path = shared / "keep.nc"
    spec = manager.spec(H)
    x = torch.ones(H, W)[spec.slice(ME)]
    write_sharded(path, "x", x, manager=manager)
    before = path.read_bytes() if ME == 0 else None
    if ME == P - 1:
        import mpidp.io.writer as writer

        def broken(*args):
            raise OSError("disk full (injected)")

        monkeypatch.setattr(writer, "_rows_slab", broken)
    with pytest.raises(DataError, match=f"rank {P - 1}: OSError: disk full"):
        write_sharded(path, "x", 2 * x, manager=manager)
    WORLD.Barrier()
    if ME == 0:
        assert path.read_bytes() == before
        assert not [p for p in os.listdir(shared) if ".tmp-" in p]


def _temporaries(folder: Path) -> list[str]:
    """The temporary files in ``folder``, as every rank sees them at one point in time."""
    WORLD.Barrier()
    found = [p for p in os.listdir(folder) if ".tmp-" in p]
    WORLD.Barrier()  # nobody changes the folder before every rank has looked
    return found


def test_a_full_disk_fails_everywhere_and_leaves_nothing(manager, shared, monkeypatch):
    """Issue 19: write_sharded(mode="a") and save_checkpoint on a full disk (ENOSPC injected
    where the bytes are written: the copy of the file to append to, torch.save) raise the same
    DataError on every rank, naming the errno and the free space; no temporary file is left
    and the previous file is intact."""
    import errno

    import mpidp.io.checkpoint as checkpoint
    import mpidp.io.writer as writer

    folder = shared / "full"
    _on_rank0(folder.mkdir)
    spec = manager.spec(H)
    x = torch.ones(H, W)[spec.slice(ME)]
    path = folder / "append.nc"
    write_sharded(path, "x", x, manager=manager)
    before = path.read_bytes() if ME == 0 else None

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    if ME == 0:  # rank 0 alone copies the file it appends to, and alone saves checkpoints
        monkeypatch.setattr(writer.shutil, "copy2", full)
        monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(DataError, match=r"rank 0: OSError: .*No space left") as err:
        write_sharded(path, "y", x, manager=manager, mode="a")
    assert "bytes free: is the disk full?" in str(err.value)
    assert not _temporaries(folder)
    if ME == 0:
        assert path.read_bytes() == before
    model = torch.nn.Linear(2, 2)
    with pytest.raises(DataError, match=r"(?s)save_checkpoint.*No space left"):
        save_checkpoint(folder / "ckpt.pt", model, step=1, manager=manager)
    assert not _temporaries(folder) and not (folder / "ckpt.pt").exists()


def test_one_rank_abandoning_a_rollout_removes_its_temporary_file(manager, shared):
    """An exception on one rank inside ``with RolloutWriter``: that rank's abort removes the
    temporary file (only rank 0 used to); the published path is never created."""
    folder = shared / "abandon"
    _on_rank0(folder.mkdir)
    spec = manager.spec(H)
    w = RolloutWriter(folder / "r.nc", ["a"], manager=manager)
    w.write(torch.zeros(1, H, W)[:, spec.slice(ME)])
    assert _temporaries(folder)
    if ME == P - 1:
        w.abort()
    assert not _temporaries(folder) and not (folder / "r.nc").exists()
    w._closed = True  # the other ranks' job would end here


def test_stale_temporary_files_are_reported(manager, shared):
    """A killed job leaves ``.<name>.tmp-*`` beside its target: the next write to that path
    warns, naming them (they are not removed: another job may be writing)."""
    path = shared / "stale.nc"
    old = shared / ".stale.nc.tmp-dead"
    if ME == 0:
        old.write_bytes(b"x" * 100)
        os.utime(old, (time.time() - 7200, time.time() - 7200))
    WORLD.Barrier()
    spec = manager.spec(H)
    with pytest.warns(UserWarning, match=r"\.stale\.nc\.tmp-dead \(100 bytes\)"):
        write_sharded(path, "x", torch.ones(H, W)[spec.slice(ME)], manager=manager)
    assert old.exists() and path.exists()
    WORLD.Barrier()  # every rank has looked
    _on_rank0(old.unlink)


def test_write_bad_arguments_fail_everywhere(manager, shared):
    spec = manager.spec(H)
    x = torch.ones(H, W)[spec.slice(ME)]
    with pytest.raises(DataError, match="does not exist"):
        write_sharded(shared / "no-such-folder" / "x.nc", "x", x, manager=manager)
    if P > 1:
        with pytest.raises(DataError, match=f"rank {P - 1}: name="):
            write_sharded(shared / "x.nc", "x" if ME < P - 1 else "y", x, manager=manager)
    with pytest.raises(DataError, match="coordinate 'latitude' has shape"):
        write_sharded(shared / "x.nc", "x", x, manager=manager, coords={"latitude": [1.0, 2.0]})
    with pytest.raises(DataError, match="mode='a' but"):
        write_sharded(shared / "absent.nc", "x", x, manager=manager, mode="a")


# -- checkpoints ------------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.GroupNorm(2, 4),
        torch.nn.SiLU(),
        torch.nn.Conv2d(4, 2, 3, padding=1),
    ).double()


def _train(model, m, steps=3):
    """A few Adam steps of the domain-parallel model on this replica's own random sample."""
    dist = mpidp.convert_to_domain_parallel(model, m)
    opt = torch.optim.Adam(dist.parameters(), lr=1e-2)
    spec = m.spec(H)
    for k in range(steps):
        gen = torch.Generator().manual_seed(100 * k + m.dp_rank)
        x = torch.randn(1, 2, H, W, generator=gen, dtype=F64)
        loss = mpidp.global_mean(dist(x[..., spec.slice(m.domain_rank), :]) ** 2, manager=m)
        opt.zero_grad()
        loss.backward()
        mpidp.sync_gradients(dist, m)
        opt.step()
    return dist, opt


def _domains():
    return [d for d in (1, 2, 4, 3) if P % d == 0]


@pytest.mark.parametrize("save_domain", _domains())
def test_checkpoint_loads_at_every_layout(shared, save_domain):
    """Saved from (dp x domain) = (P / d) x d; loaded into every other layout and into the
    serial model: the same weights, optimizer state and outputs."""
    path = shared / f"ckpt-{save_domain}.pt"
    with mpidp.DistributedManager(domain_parallel_size=save_domain) as m:
        model, opt = _train(_model(), m)
        save_checkpoint(path, model, opt, step=3, manager=m, extra={"note": "x"})
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        opt_ref = opt.state_dict()
    serial = _model()
    state = load_checkpoint(path, serial)
    assert state["step"] == 3 and state["layout"]["domain"] == save_domain
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(v, reference[k], rtol=0, atol=0)
    x = torch.randn(1, 2, H, W, generator=torch.Generator().manual_seed(9), dtype=F64)
    want = serial(x)
    for d in _domains():
        with mpidp.DistributedManager(domain_parallel_size=d) as m:
            model = mpidp.convert_to_domain_parallel(_model(), m)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            load_checkpoint(path, model, opt, m)
            got = model(x[..., m.spec(H).slice(m.domain_rank), :])
            torch.testing.assert_close(
                got, want[..., m.spec(H).slice(m.domain_rank), :], rtol=1e-12, atol=1e-14
            )
            for group, ref in zip(
                opt.state_dict()["state"].values(), opt_ref["state"].values(), strict=True
            ):
                assert set(group) == set(ref) == {"step", "exp_avg", "exp_avg_sq"}, set(group)
                for key in ref:  # every optimizer state, not only the first moment
                    torch.testing.assert_close(group[key], ref[key], rtol=0, atol=0, msg=key)
            model2, _ = _train(model, m, steps=1)  # training goes on after loading
            assert torch.isfinite(next(model2.parameters())).all()


def test_checkpoint_refuses_diverged_replicas(shared):
    model = _model()
    if ME == P - 1 and P > 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    with mpidp.DistributedManager(domain_parallel_size=1) as m:
        if P > 1:
            with pytest.raises(DataError, match=r"differ between ranks: \['model.0.weight'\]"):
                save_checkpoint(shared / "diverged.pt", model, manager=m)
        save_checkpoint(shared / "diverged.pt", model, manager=m, verify=False)
        assert load_checkpoint(shared / "diverged.pt", manager=m)["step"] == 0


def test_checkpoint_bad_files_fail_everywhere(manager, shared):
    good = shared / "bad-files-good.pt"  # this test's own file, not another test's leftover
    save_checkpoint(good, mpidp.convert_to_domain_parallel(_model(), manager), manager=manager)
    assert load_checkpoint(good, _model(), manager=manager)["step"] == 0
    with pytest.raises(DataError, match="no such file"):
        load_checkpoint(shared / "none.pt" if ME == P - 1 else good, _model(), manager=manager)
    garbage = shared / "garbage.pt"
    _on_rank0(garbage.write_bytes, b"not a checkpoint" * 10)
    with pytest.raises(DataError, match="unreadable"):
        load_checkpoint(garbage, _model(), manager=manager)
    with pytest.raises(DataError, match="does not fit the model"):
        load_checkpoint(good, torch.nn.Linear(2, 2), manager=manager)
    # damaged metadata beside a good model: named, with the rank and the fix
    damaged = shared / "damaged.pt"
    state = torch.load(good, weights_only=False)
    state.update(step="7", layout={"world": 0}, format="mpidp-checkpoint-9")
    _on_rank0(torch.save, state, damaged)
    with pytest.raises(DataError) as err:
        load_checkpoint(damaged, _model(), manager=manager)
    text = str(err.value)
    assert f"rank {manager.rank}: load_checkpoint" in text and "fix: " in text, text
    assert "its metadata is damaged or from another program" in text
    assert "format='mpidp-checkpoint-9'" in text and "step is a str" in text
    assert "layout={'world': 0}" in text


# -- bad input: the same clear error on every rank ----------------------------------------


def _expect_everywhere(match, *args, **kwargs):
    with pytest.raises(DataError, match=match) as err:
        ShardedH5Dataset(*args, **kwargs)
    return str(err.value)


def test_missing_file_on_one_rank(manager, sample, shared):
    path = shared / "nowhere.h5" if ME == P - 1 else sample
    text = _expect_everywhere(f"rank {P - 1}: .*nowhere.h5: no such file", path, manager=manager)
    assert f"rank {ME}:" in text and "fix:" in text


def test_a_file_deleted_after_the_dataset_was_built(manager, sample, shared):
    """The files are opened lazily, per DataLoader worker: one that vanished since (a scratch
    purge) is a DataError naming the rank, the file and what to do, not h5py's bare one."""
    copy = shared / "vanishing.h5"
    _on_rank0(shutil.copy, sample, copy)
    ds = ShardedH5Dataset(copy, manager=manager)
    _on_rank0(copy.unlink)
    with pytest.raises(DataError) as err:
        ds[0]
    text = str(err.value)
    assert text.startswith(f"rank {manager.domain_rank}: {copy} (time index 0) cannot be opened")
    assert "deleted or purged" in text and "fix:" in text


def test_missing_variable_and_wrong_rank(manager, sample, shared):
    _expect_everywhere(r"no variable \['q'\]", sample, ["t2m", "q"], manager=manager)
    flat = shared / "flat.h5"
    _on_rank0(lambda: h5py.File(flat, "w").create_dataset("t2m", data=np.zeros((H, W))))
    _expect_everywhere(r"not shaped \(time, lat, lon\)", flat, ["t2m"], manager=manager)
    _expect_everywhere(r"level indices \[5\]", sample, [("z", [5])], manager=manager)


def test_grid_and_partition_mismatch(manager, sample, shared):
    _expect_everywhere(
        r"13 x 16 .*model expects \(721, 1440\)", sample, manager=manager, grid=(721, 1440)
    )
    if P > 1:
        _expect_everywhere(
            r"partition \[13\] cuts 13 rows over 1 ranks", sample, manager=manager, spec=[H]
        )
    tiny = shared / "tiny.h5"
    _on_rank0(make_sample_data, tiny, n_lat=3, n_lon=4, n_time=3)
    if P > 3:
        _expect_everywhere("use fewer domain ranks", tiny, manager=manager)
    _expect_everywhere("use a smaller halo", sample, manager=manager, halo=H, boundary="reflect")


def test_corrupt_and_truncated_files(manager, sample, shared):
    corrupt, truncated = shared / "corrupt.h5", shared / "truncated.h5"

    def spoil():
        corrupt.write_bytes(os.urandom(4096))
        data = sample.read_bytes()
        truncated.write_bytes(data[: len(data) // 2])

    _on_rank0(spoil)
    _expect_everywhere("not a readable HDF5", corrupt, manager=manager)
    _expect_everywhere("not a readable HDF5", truncated, manager=manager)


@pytest.mark.mpi(min_size=2)
def test_file_that_differs_between_ranks(manager, sample, shared):
    """The same path showing other data on one rank (a stale node-local copy, a file being
    rewritten): caught at construction, on every rank."""
    changed = shared / "changed.h5"
    _on_rank0(make_sample_data, changed, n_lat=H, n_lon=W, n_time=T + 1)

    def opener(path):
        return h5py.File(changed if ME == P - 1 else path, "r")

    text = _expect_everywhere(f"rank {P - 1}: files=", sample, manager=manager, opener=opener)
    assert "same data on every rank" in text


def test_sample_data_is_deterministic_and_self_describing(sample, shared):
    again = shared / f"again-{ME}.h5"
    make_sample_data(again, n_lat=H, n_lon=W, n_time=T)
    with h5py.File(sample, "r") as a, h5py.File(again, "r") as b:
        for name in ("t2m", "z", "latitude", "time"):
            np.testing.assert_array_equal(a[name][()], b[name][()])
        assert a["z"].attrs["mean"].shape == (2,)
    with xr.open_dataset(sample, engine="h5netcdf") as xds:
        assert xds["z"].dims == ("time", "level", "latitude", "longitude")
        assert list(xds["level"].values) == [500, 850]
        assert float(xds["latitude"][0]) == 90.0
        assert xds["msl"].attrs["long_name"] == "mean sea level pressure"  # CF, as ERA5's
        assert xds["t"].attrs["standard_name"] == "air_temperature"
        assert xds["z"].attrs["units"] == "m2 s-2"
    again.unlink()
