"""I/O on latitude x longitude blocks (issue 46, item 5), at every grid that fits the world
(bands are the grid (P, 1)): the HDF5 and Zarr readers give each rank its rows x columns plus
halo, bitwise equal to slicing the file (the oracle pads the whole field by index arithmetic:
latitude first, the polar rows half a circle away, then longitude) and to the block halo
exchange of the plain block; ``write_sharded`` writes blocks that read back whole as the
original; a checkpoint saved at one layout loads at another, the model state replicated.

Files are tiny (13 x 18, uneven over every grid) and shared per module.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import WORLD, agreed
from mpi4py import MPI

import mpidp
from mpidp.errors import DataError
from mpidp.io import (
    ShardedH5Dataset,
    ShardedZarrDataset,
    load_checkpoint,
    make_sample_data,
    save_checkpoint,
    write_sharded,
    zarr_available,
)
from mpidp.ops.block_halo import block_halo_exchange
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.partition import ShardSpec

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
ME = COMM.Get_rank()
H, W, T = 13, 18, 3
F64 = torch.float64


@pytest.fixture(scope="module")
def shared():
    """A folder every rank sees (made by rank 0), removed at the end of the module."""
    path = COMM.bcast(tempfile.mkdtemp(prefix="mpidp-io-blocks-") if ME == 0 else None)
    yield Path(path)
    COMM.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sample(shared):
    """The sample data as netCDF-4 and (with zarr) as a Zarr store, and the whole fields."""
    h5, store = shared / "sample.h5", shared / "sample.zarr"
    if ME == 0:
        make_sample_data(h5, n_lat=H, n_lon=W, n_time=T)
        if zarr_available():
            make_sample_data(store, n_lat=H, n_lon=W, n_time=T, format="zarr")
    COMM.Barrier()
    return h5, store


def uneven(n, parts):
    """Sizes of ``n`` over ``parts``, the first one larger than balanced (uneven when
    ``parts > 1``)."""
    sizes = list(ShardSpec.balanced(n, parts).sizes)
    if parts > 1:
        sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] - 1
    return sizes


def whole_field(path, time):
    """Every input channel of the sample file at ``time``, as ShardedH5Dataset orders them
    (file order: 3-D variables one channel, 4-D ones a channel per level), float64."""
    with h5py.File(path, "r") as f:
        out = []
        for d in f.values():
            if isinstance(d, h5py.Dataset) and d.ndim in (3, 4) and "CLASS" not in d.attrs:
                v = np.asarray(d[time], dtype=np.float64)
                out += [v] if d.ndim == 3 else list(v)
    return torch.from_numpy(np.stack(out))


def source(n, lo, hi, kinds):
    """For global indices [lo, hi) of a dim of n: (field index or -1 for zero, rolled)."""
    low, high = kinds if isinstance(kinds, tuple) else (kinds, kinds)
    out = []
    for i in range(lo, hi):
        if 0 <= i < n:
            out.append((i, False))
            continue
        kind = low if i < 0 else high
        mirror = i if kind in ("zeros", "circular") else (-i if i < 0 else 2 * n - 2 - i)
        if kind in ("symmetric", "polar_half"):
            mirror = -i - 1 if i < 0 else 2 * n - 1 - i
        out.append(
            {
                "zeros": (-1, False),
                "replicate": (min(max(i, 0), n - 1), False),
                "circular": (i % n, False),
            }.get(kind, (mirror, kind.startswith("polar")))
        )
    return out


def padded(field, rows, cols, lat_kind, lon_kind):
    """The oracle: rows x columns (global ranges) of the whole field padded by index
    arithmetic, latitude first (polar rows half a circle away), then longitude."""
    n, w = field.shape[-2:]
    out = torch.zeros(field.shape[0], rows[1] - rows[0], cols[1] - cols[0], dtype=field.dtype)
    for r, (i, roll) in enumerate(source(n, *rows, lat_kind)):
        for c, (j, _) in enumerate(source(w, *cols, lon_kind)):
            if i >= 0 and j >= 0:
                out[:, r, c] = field[:, i, (j + w // 2) % w if roll else j]
    return out


def block_spec(m, how):
    if how == "manager":
        return None
    p_lat, p_lon = m.grid
    return BlockSpec(ShardSpec.from_sizes(uneven(H, p_lat)), ShardSpec.from_sizes(uneven(W, p_lon)))


# -- reading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["manager", "uneven"])
def test_block_read_is_the_file_slice(gm, sample, how):
    """Input and target of a block without halo: exactly the file's rows x columns; the
    blocks are the manager's (bands on a (P, 1) grid) or an explicit BlockSpec."""
    ds = ShardedH5Dataset(
        sample[0], manager=gm, spec=block_spec(gm, how), normalize=None, dtype=F64
    )
    bs = ds.blocks if how == "uneven" else gm.block_spec((H, W))
    rs, cs = bs.block(gm.domain_rank)
    x, y = ds[0]
    failures = []
    if (ds.rows, ds.columns) != ((rs.start, rs.stop), (cs.start, cs.stop)):
        failures.append(f"rank {ME}: rows {ds.rows} columns {ds.columns}, want {rs} {cs}")
    if not torch.equal(x, whole_field(sample[0], 0)[:, rs, cs]):
        failures.append(f"rank {ME}: input block differs from the file")
    if not torch.equal(y, whole_field(sample[0], 1)[:, rs, cs]):
        failures.append(f"rank {ME}: target block differs from the file")
    assert not agreed(failures), agreed(failures)


# (latitude boundary, longitude boundary, (lat before, after), (lon before, after)); halos
# wider than the thinnest blocks (multi-hop at 3 and 4 ranks)
PADDED = [
    ("zeros", "circular", (1, 1), (1, 1)),
    ("polar", "circular", (2, 1), (3, 2)),
    ("polar_half", "circular", (4, 4), (5, 5)),
    ("reflect", "zeros", (1, 2), (2, 0)),
]


@pytest.mark.parametrize("lat_kind, lon_kind, halo, lon_halo", PADDED)
def test_padded_block_read(gm, sample, lat_kind, lon_kind, halo, lon_halo):
    """A block plus halo equals the padded file (index oracle) and the block halo exchange
    of the plain block, bitwise, normalised; the Zarr reader gives the same."""
    kw = dict(manager=gm, spec=block_spec(gm, "uneven"), dtype=F64)
    ds = ShardedH5Dataset(
        sample[0], halo=halo, boundary=lat_kind, lon_halo=lon_halo, lon_boundary=lon_kind, **kw
    )
    plain = ShardedH5Dataset(sample[0], **kw)
    x = ds.read_band(1)
    normalised = (whole_field(sample[0], 1) - ds.mean.view(-1, 1, 1)) / ds.std.view(-1, 1, 1)
    want = padded(normalised, ds.rows, ds.columns, lat_kind, lon_kind)
    exchanged = block_halo_exchange(
        plain.read_band(1),
        (halo[0], lon_halo[0]),
        (halo[1], lon_halo[1]),
        spec=ds.blocks,
        manager=gm,
        boundary=(lat_kind, lon_kind),
    )
    failures = []
    if x.shape != want.shape or not torch.equal(x, want):
        failures.append(f"rank {ME}: {lat_kind}/{lon_kind} read differs from the padded file")
    if not torch.equal(x, exchanged):
        failures.append(f"rank {ME}: {lat_kind}/{lon_kind} read differs from the exchange")
    if zarr_available():
        z = ShardedZarrDataset(
            sample[1], halo=halo, boundary=lat_kind, lon_halo=lon_halo, lon_boundary=lon_kind, **kw
        )
        if not torch.equal(z.read_band(1), x):
            failures.append(f"rank {ME}: {lat_kind}/{lon_kind} Zarr read differs")
    assert not agreed(failures), agreed(failures)


def _refused(call):
    try:
        call()
    except DataError as err:
        return str(err)
    return None


def test_block_reader_refusals(gm, sample):
    """What cannot be read raises the same DataError on every rank."""
    path = sample[0]
    got = {
        "polar lon": _refused(
            lambda: ShardedH5Dataset(path, manager=gm, lon_boundary="polar", normalize=None)
        ),
        "too wide": _refused(
            lambda: ShardedH5Dataset(
                path, manager=gm, lon_halo=W, lon_boundary="reflect", normalize=None
            )
        ),
        "rows only": _refused(
            lambda: ShardedH5Dataset(path, manager=gm, spec=uneven(H, gm.grid[0]), normalize=None)
        ),
    }
    want = {
        "polar lon": "the polar fold is a latitude boundary",
        "too wide": "use a smaller halo",
        "rows only": "partitions the rows only" if gm.grid[1] > 1 else None,
    }
    failures = [
        f"rank {ME}: {k}: {got[k]!r}"
        for k, w in want.items()
        if (w is None) != (got[k] is None) or (w is not None and w not in got[k])
    ]
    assert not agreed(failures), agreed(failures)


# -- writing -----------------------------------------------------------------------------------


def read_whole(path, name):
    if str(path).endswith(".zarr"):
        import zarr

        return torch.from_numpy(np.asarray(zarr.open_group(str(path), mode="r")[name][...]))
    with h5py.File(path, "r") as f:
        return torch.from_numpy(f[name][()])


FORMATS = ["nc"] + (["zarr"] if zarr_available() else [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_blocks_reads_back_whole(gm, shared, fmt):
    """Uneven blocks (the longitude found by its name, or given as a dim pair) written by
    every rank read back whole as the original, coordinates included; a Zarr store's column
    chunks (the widest block) do not match the blocks, so entries move to their owners."""
    full = torch.randn(2, H, W, generator=torch.Generator().manual_seed(3), dtype=F64)
    bs = block_spec(gm, "uneven")
    rs, cs = bs.block(gm.domain_rank)
    tag = f"{gm.grid[0]}x{gm.grid[1]}"
    path = shared / f"blocks-{tag}.{fmt}"
    lat = np.linspace(90, -90, H)
    dims = ("level", "latitude", "longitude")
    write_sharded(path, "v", full[:, rs, cs], manager=gm, dims=dims, coords={"latitude": lat})
    # the same field at dims (0, 2) of its transpose, added to the same file, against spec
    swapped = full.transpose(0, 1)[rs, :, cs].contiguous()
    names = ("latitude", "level", "longitude")
    write_sharded(path, "w", swapped, (0, 2), bs, gm, dims=names, mode="a", chunk_rows=2)
    failures = []
    if not torch.equal(read_whole(path, "v"), full):
        failures.append(f"rank {ME}: {fmt} blocks read back differ")
    if not torch.equal(read_whole(path, "w"), full.transpose(0, 1)):
        failures.append(f"rank {ME}: {fmt} blocks at dims (0, 2) read back differ")
    if not np.array_equal(read_whole(path, "latitude").numpy(), lat):
        failures.append(f"rank {ME}: {fmt} latitude coordinate differs")
    assert not agreed(failures), agreed(failures)


def test_write_blocks_refusals(gm, shared):
    """A variable without the longitude dim on blocks, and blocks that do not tile the grid
    (the last rank one column wider), raise the same DataError on every rank and leave no
    temporary file."""
    bs = block_spec(gm, "uneven")
    rs, cs = bs.block(gm.domain_rank)
    zonal = torch.zeros(2, rs.stop - rs.start, dtype=F64)
    wider = torch.zeros(rs.stop - rs.start, cs.stop - cs.start + (ME == WORLD - 1), dtype=F64)
    tag = f"refused-{gm.grid[0]}x{gm.grid[1]}"
    got = {
        "no lon": _refused(
            lambda: write_sharded(
                shared / f"{tag}-a.nc", "z", zonal, -1, manager=gm, dims=("level", "latitude")
            )
        ),
        "not tiling": _refused(
            lambda: write_sharded(shared / f"{tag}-b.nc", "v", wider, manager=gm)
        ),
    }
    p_lat, p_lon = gm.grid
    want = {
        "no lon": "a variable without the longitude dim" if p_lon > 1 else None,
        # a 1 x P grid of blocks one column wider is a tiling (of W + 1 columns); bands must
        # all hold every column
        "not tiling": "do not tile"
        if p_lat > 1 and p_lon > 1
        else "inconsistent arguments"
        if p_lat > 1
        else None,
    }
    failures = [
        f"rank {ME}: {k}: {got[k]!r}"
        for k, w in want.items()
        if (w is None) != (got[k] is None) or (w is not None and w not in got[k])
    ]
    COMM.Barrier()
    left = [p.name for p in shared.iterdir() if p.name.startswith(tag) and "tmp" in p.name]
    failures += [f"rank {ME}: left {left}"] if left else []
    assert not agreed(failures), agreed(failures)


# -- checkpoints across layouts ----------------------------------------------------------------

SAVE = (2, 2) if WORLD == 4 else (1, WORLD)  # blocks that cut the longitude where they can
LOADS = [(WORLD, 1), 1]  # bands, data parallel


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular"),
        torch.nn.GroupNorm(2, 4),
        torch.nn.SiLU(),
        torch.nn.Conv2d(4, 2, 3, padding=1),
    ).double()


def _converted(m):
    """The net with each layer converted (the layers run on blocks; the model wrapper does
    not yet), its state_dict keys the serial net's."""
    net = _net()
    for j, layer in enumerate(net):
        net[j] = mpidp.convert_to_domain_parallel(layer, manager=m)
    return net


def _field(k):
    return torch.randn(1, 2, H, W, generator=torch.Generator().manual_seed(50 + k), dtype=F64)


def _step(model, opt, m, k):
    """One Adam step on sample ``k`` (every replica the same), the loss the mean square of
    the output over the whole field: each rank's block's share, summed by sync_gradients."""
    x = _field(k) if m is None else mpidp.shard_tensor(_field(k), dim=(-2, -1), manager=m)
    loss = (model(x.detach()) ** 2).sum() / _field(k).numel()
    opt.zero_grad()
    loss.backward()
    if m is not None:
        mpidp.sync_gradients(model, m)
    opt.step()


def _close(a, b):
    return bool(torch.allclose(a, b, rtol=1e-10, atol=1e-14))


def test_checkpoint_across_layouts(shared):
    """Two steps at SAVE blocks (2 x 2 at 4 ranks) equal the serial steps; saved (the
    replicas verified equal, a diverged one refused) and loaded at bands (4 x 1) and at
    domain size 1 (data parallel): the same weights and Adam state bitwise, and a third step
    there equals the serial run's third step."""
    path = shared / "blocks.pt"
    serial = _net()
    s_opt = torch.optim.Adam(serial.parameters(), lr=1e-2)
    for k in range(3):
        _step(serial, s_opt, None, k)
        if k == 1:
            after_two = {n: p.detach().clone() for n, p in serial.named_parameters()}
    failures = []
    with mpidp.DistributedManager(domain_parallel_size=SAVE) as m:
        model = _converted(m)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for k in range(2):
            _step(model, opt, m, k)
        save_checkpoint(path, model, opt, step=2, manager=m)
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        saved_opt = opt.state_dict()
        failures += [
            f"rank {ME}: {n} after 2 steps" for n in saved if not _close(saved[n], after_two[n])
        ]
        if WORLD > 1:
            with torch.no_grad():
                next(model.parameters()).add_(float(ME == WORLD - 1))
            got = _refused(lambda: save_checkpoint(shared / "diverged.pt", model, manager=m))
            if got is None or "differ between ranks: " not in got or "0.weight" not in got:
                failures.append(f"rank {ME}: diverged replica: {got!r}"[-300:])
    for layout in LOADS:
        with mpidp.DistributedManager(domain_parallel_size=layout) as m:
            model = _converted(m)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            state = load_checkpoint(path, model, opt, m)
            failures += [
                f"rank {ME}: {layout}: {n} loaded"
                for n, p in model.named_parameters()
                if not torch.equal(p, saved[n])
            ]
            states = zip(
                opt.state_dict()["state"].values(), saved_opt["state"].values(), strict=True
            )
            for got, ref in states:
                failures += [
                    f"rank {ME}: {layout}: Adam {key}"
                    for key in ref
                    if not torch.equal(torch.as_tensor(got[key]), torch.as_tensor(ref[key]))
                ]
            _step(model, opt, m, 2)
            failures += [
                f"rank {ME}: {layout}: {n} after the third step"
                for n, p in model.named_parameters()
                if not _close(p.detach(), dict(serial.named_parameters())[n].detach())
            ]
            failures += [] if state["step"] == 2 else [f"rank {ME}: step {state['step']}"]
    assert not agreed(failures), agreed(failures)


def test_computed_statistics_on_blocks(gm, sample):
    """``normalize="compute"`` on blocks (each rank its own block of every time, merged over
    the world) gives the whole file's per-channel mean and std."""
    ds = ShardedH5Dataset(sample[0], manager=gm, normalize="compute")
    fields = torch.stack([whole_field(sample[0], k) for k in range(T)], 1).flatten(1)
    mean, std = fields.mean(1), fields.std(1, unbiased=False)
    ok = torch.allclose(ds.mean, mean, rtol=1e-10, atol=0) and torch.allclose(
        ds.std, std, rtol=1e-10, atol=0
    )
    failures = [] if ok else [f"rank {ME}: computed statistics {ds.mean} {ds.std}"]
    assert not agreed(failures), agreed(failures)
