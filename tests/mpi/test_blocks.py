"""Latitude x longitude blocks (issue 46, first step): the domain group as a P_lat x P_lon grid,
block specs, this rank's block / the whole tensor / a scatter, and the 2-D halo exchange
(corners, the polar fold to the block half a circle away, multi-hop), each against a serial
reference on the full field, at every grid that fits the world (bands are the grid (P, 1)).

The halo oracle is written here with index arithmetic on the whole field (index_select, a
mask for zeros, torch.roll for the fold): latitude padded first, then longitude, as the serial
model pads. Its autograd is the serial backward the distributed gradient is compared with.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import ALL_GRIDS, GRIDS, WORLD, close, gradcheck_global, grid_id, rand, refusal
from mpi4py import MPI

import mpidp
from mpidp.comm import TorchTransport
from mpidp.errors import ConfigError
from mpidp.ops.blocks import scatter_blocks
from mpidp.runtime.partition import ShardSpec, Weighted

pytestmark = pytest.mark.mpi

DP_GRIDS = [g for g in ALL_GRIDS if WORLD % (g[0] * g[1]) == 0 and g[0] * g[1] < WORLD]
SHAPES = [(7, 10), (9, 13)]
BOUNDARIES = [
    ("zeros", "circular"),
    ("reflect", "circular"),
    ("replicate", "zeros"),
    ("symmetric", "zeros"),
    ("circular", "circular"),
    ("polar", "circular"),
    ("polar", "zeros"),
    ("polar_half", "circular"),
    (("zeros", "polar"), "circular"),
]
# (before, after), each (latitude, longitude): equal, asymmetric, wider than the thinnest
# blocks (multi-hop at 3 and 4 ranks: 7 rows over 4 are 2, 2, 2, 1; 10 columns 3, 3, 2, 2),
# trimming
WIDTHS = [((1, 1), (1, 1)), ((2, 1), (0, 3)), ((3, 4), (3, 4)), ((-1, 2), (2, -1))]


# -- the serial reference ----------------------------------------------------------------------


def _kinds(b):
    return (b, b) if isinstance(b, str) else b


def _polar(boundary):
    return any(str(k).startswith("polar") for k in _kinds(boundary[0]))


def source_index(n, lo, hi, boundary):
    """For every global index in [lo, hi) of a dim of n: (source index or -1 for zero, rolled by
    half the other dim)."""
    low, high = _kinds(boundary)
    out = []
    for i in range(lo, hi):
        if 0 <= i < n:
            out.append((i, False))
            continue
        kind = low if i < 0 else high
        if kind == "zeros":
            out.append((-1, False))
        elif kind == "replicate":
            out.append((0 if i < 0 else n - 1, False))
        elif kind == "circular":
            out.append((i % n, False))
        elif kind in ("reflect", "polar"):
            out.append((-i if i < 0 else 2 * (n - 1) - i, kind == "polar"))
        else:  # symmetric, polar_half
            out.append((-i - 1 if i < 0 else 2 * n - 1 - i, kind == "polar_half"))
    return out


def serial_block(full, rows, cols, boundary):
    """Rows [rows) x columns [cols) of ``full`` padded along the latitude, then the longitude."""
    b_lat, b_lon = boundary
    w = full.size(-1)
    ri = source_index(full.size(-2), *rows, b_lat)
    ext = full.index_select(-2, torch.tensor([max(s, 0) for s, _ in ri], dtype=torch.long))
    fold = torch.tensor([r for _, r in ri]).view(-1, 1)
    if fold.any():
        ext = torch.where(fold, ext.roll(w // 2, -1), ext)
    ext = ext.masked_fill(torch.tensor([s < 0 for s, _ in ri]).view(-1, 1), 0.0)
    ci = source_index(w, *cols, b_lon)
    ext = ext.index_select(-1, torch.tensor([max(s, 0) for s, _ in ci], dtype=torch.long))
    return ext.masked_fill(torch.tensor([s < 0 for s, _ in ci]), 0.0)


def test_serial_reference_is_f_pad():
    """The oracle against torch's own padding where torch has one (a 2-D F.pad pads both dims
    at once; reflect and circular commute across dims)."""
    full = rand((1, 2, 6, 8), 1)
    for mode, b in (("reflect", ("reflect", "reflect")), ("circular", ("circular", "circular"))):
        want = torch.nn.functional.pad(full, (2, 3, 1, 2), mode=mode)
        assert torch.equal(serial_block(full, (-1, 8), (-2, 11), b), want)
    want = torch.nn.functional.pad(full, (2, 3, 1, 2))
    assert torch.equal(serial_block(full, (-1, 8), (-2, 11), ("zeros", "zeros")), want)
    # the fold: row -k is row k rolled by half the circle
    ext = serial_block(full, (-2, 6), (0, 8), ("polar", "zeros"))
    assert torch.equal(ext[..., 0, :], full[..., 2, :].roll(4, -1))
    assert torch.equal(ext[..., 1, :], full[..., 1, :].roll(4, -1))


def my_range(bs, rank, before, after):
    rs, cs = bs.block(rank)
    (bl, bn), (al, an) = before, after
    return (rs.start - bl, rs.stop + al), (cs.start - bn, cs.stop + an)


# -- the grid ----------------------------------------------------------------------------------


def _members(m):
    p_lat, p_lon = m.grid
    i_lat, i_lon = m.grid_coords
    base = m.dp_rank * p_lat * p_lon
    column = [base + i * p_lon + i_lon for i in range(p_lat)]
    row = [base + i_lat * p_lon + j for j in range(p_lon)]
    return column, row


def _check_layout(m, grid):
    """Every collective first, then the verdicts (a rank that fails never strands its peers)."""
    p_lat, p_lon = grid
    column, row = _members(m)
    t_lat, t_lon = m.transport("lat"), m.transport("lon")
    got = {"column": t_lat.all_gather_object(m.rank), "row": t_lon.all_gather_object(m.rank)}
    both = p_lat > 1 and p_lon > 1
    if both:  # groups of their own, through torch.distributed too
        groups = m._grid_axes.groups
        got["torch column"] = TorchTransport(groups["lat"]).all_gather_object(m.rank)
        got["torch row"] = TorchTransport(groups["lon"]).all_gather_object(m.rank)
        got["pg column"] = dist.get_process_group_ranks(groups["lat"])
        got["pg row"] = dist.get_process_group_ranks(groups["lon"])
    assert m.grid == grid
    assert m.domain_world_size == p_lat * p_lon
    assert m.dp_world_size == WORLD // (p_lat * p_lon)
    assert m.grid_coords == divmod(m.domain_rank, p_lon)
    assert (t_lat.size, t_lat.rank) == (p_lat, m.grid_coords[0])
    assert (t_lon.size, t_lon.rank) == (p_lon, m.grid_coords[1])
    want = {"column": column, "row": row}
    if both:
        want.update({"torch column": column, "torch row": row})
        want.update({"pg column": column, "pg row": row})
    else:  # bands (or one row): each axis is the domain group or this rank alone
        assert m._grid_axes is None
        full, alone = (t_lat, t_lon) if p_lon == 1 else (t_lon, t_lat)
        assert full is m.transport("domain")
        assert alone.size == 1
    assert got == want


def test_grid_layout(gm):
    _check_layout(gm, gm.grid)


@pytest.mark.skipif(not DP_GRIDS, reason="no grid smaller than the world divides it")
@pytest.mark.parametrize("grid", DP_GRIDS, ids=grid_id)
def test_grid_beside_data_parallel(grid):
    with mpidp.DistributedManager(domain_parallel_size=grid) as m:
        _check_layout(m, grid)
        assert m.dp_rank == m.rank // (grid[0] * grid[1])


def test_int_is_bands():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as m:
        assert (m.grid, m.grid_coords) == ((WORLD, 1), (m.domain_rank, 0))
        assert m.transport("lat") is m.transport("domain")
        assert m.transport("lon").size == 1
        assert m._grid_axes is None


@pytest.mark.parametrize(
    ("domain", "match"),
    [
        (0, "domain_parallel_size must be an integer >= 1, got 0"),
        ((0, 2), r"a \(P_lat, P_lon\) pair of integers >= 1 \(blocks\), got \(0, 2\)"),
        ((2,), r"got \(2,\); e.g. domain_parallel_size=\(2, 2\)"),
        ((1, 2, 1), r"got \(1, 2, 1\)"),
        ("2x2", "got '2x2'"),
        ((WORLD + 1, 1), rf"world size {WORLD} is not divisible by the domain grid "),
        ((1, WORLD + 1), rf"of {WORLD + 1} ranks; use a grid whose product divides {WORLD}"),
    ],
)
def test_bad_grids_are_refused(domain, match):
    with pytest.raises(ConfigError, match=rf"^rank {MPI.COMM_WORLD.Get_rank()}: .*{match}"):
        mpidp.DistributedManager(domain_parallel_size=domain)


@pytest.mark.parametrize("shape", SHAPES)
def test_block_spec_cuts_each_dim_by_the_policy(gm, shape):
    p_lat, p_lon = gm.grid
    bs = gm.block_spec((2, 3, *shape))
    assert bs.lat == ShardSpec.balanced(shape[0], p_lat)
    assert bs.lon == ShardSpec.balanced(shape[1], p_lon)
    seen = torch.zeros(shape, dtype=torch.int64)
    for r in range(p_lat * p_lon):
        rs, cs = bs.block(r)
        seen[rs, cs] += 1
        assert bs.block_shape(r) == (rs.stop - rs.start, cs.stop - cs.start)
    assert bool((seen == 1).all())  # the blocks tile the field
    # the other dims may be any pair
    assert gm.block_spec((shape[0], 5, shape[1]), dims=(0, 2)).lon == bs.lon
    if p_lat * p_lon > 1:
        with pytest.raises(ConfigError, match=r"blocks of .* over .*weighted partition"):
            from mpidp.runtime.grid import block_spec

            block_spec(Weighted((1,) * (p_lat * p_lon + 1)), shape, gm.grid)


# -- whole tensors and blocks ------------------------------------------------------------------


def failed(checks):
    """The names of the checks that failed (checked after every collective of a test, so that
    a rank that fails early never leaves its peers waiting in the next one)."""
    return [name for name, ok in checks if not ok]


@pytest.mark.parametrize("shape", SHAPES)
def test_shard_and_gather(gm, shape):
    full = rand((2, 3, *shape), 3)
    bs = gm.block_spec(full.shape)
    rs, cs = bs.block(gm.domain_rank)
    w = rand(full.shape, 4)
    # this rank's block; the backward of a replicated input gives every rank the whole gradient
    fr = full.clone().requires_grad_()
    x = mpidp.shard_tensor(fr, dim=(-2, -1), manager=gm)
    (x * w[..., rs, cs]).sum().backward()
    checks = [("block", torch.equal(x, full[..., rs, cs])), ("shard grad", torch.equal(fr.grad, w))]
    # the whole tensor, replicated downstream: each rank gets its block's gradient once
    x = x.detach().requires_grad_()
    y = mpidp.gather_tensor(x, dim=(-2, -1), manager=gm)
    (y * w).sum().backward()
    checks += [
        ("gather", torch.equal(y, full)),
        ("gather grad", torch.equal(x.grad, w[..., rs, cs])),
    ]
    # partial downstream: every rank's own use of the whole tensor, summed
    x.grad = None
    y = mpidp.gather_tensor(x, dim=(-2, -1), manager=gm, spec=bs, replicated=False)
    (y * rand(full.shape, 10 + gm.domain_rank)).sum().backward()
    total = sum(rand(full.shape, 10 + r) for r in range(gm.domain_world_size))
    checks += [
        ("partial", torch.equal(y, full)),
        ("partial grad", close(x.grad, total[..., rs, cs], 1e-13)),
    ]
    assert not failed(checks)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src", ["first", "last"])
def test_scatter_blocks(gm, shape, src):
    root = 0 if src == "first" else gm.domain_world_size - 1
    full = rand((2, 3, *shape), 5)
    fr = full.clone().requires_grad_()
    x = scatter_blocks(fr if gm.domain_rank == root else None, src=root, manager=gm)
    rs, cs = gm.block_spec(full.shape).block(gm.domain_rank)
    w = rand(full.shape, 6)
    (x * w[..., rs, cs]).sum().backward()
    checks = [("block", torch.equal(x, full[..., rs, cs]))]
    if gm.domain_rank == root:  # the gradients gathered back to the source
        checks.append(("grad at src", torch.equal(fr.grad, w)))
    assert not failed(checks)


# -- the 2-D halo exchange ---------------------------------------------------------------------


# the polar fold needs an even longitude: 9 x 14 in place of 9 x 13 (the refusal is tested below)
CASES = [((s[0], s[1] + s[1] % 2) if _polar(b) else s, b) for s in SHAPES for b in BOUNDARIES]


@pytest.mark.parametrize(("shape", "boundary"), CASES, ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("widths", WIDTHS, ids=str)
def test_halo_matches_serial(gm, shape, boundary, widths):
    """Forward equal to the serial padding, bit for bit; the input gradient equal to the
    serial backward of every rank's weighted output at once."""
    assert not halo_case(gm, shape, boundary, widths, learn=widths == WIDTHS[1])


def halo_case(m, shape, boundary, widths, learn=False):
    """The failed checks of one exchange against the serial reference (every collective
    first). ``learn``: no spec passed (the blocks learned from the extents)."""
    before, after = widths
    full = rand((2, 3, *shape), 7)
    bs = m.block_spec(full.shape)
    me = m.domain_rank
    x = mpidp.shard_tensor(full, dim=(-2, -1), manager=m).requires_grad_()
    spec = None if learn else bs
    ext = mpidp.halo_exchange(
        x, before, after, dim=(-2, -1), spec=spec, manager=m, boundary=boundary
    )
    rows, cols = my_range(bs, me, before, after)
    (ext * rand(tuple(ext.shape), 100 + me)).sum().backward()
    fr = full.clone().requires_grad_()
    total = 0
    for r in range(m.domain_world_size):
        ref = serial_block(fr, *my_range(bs, r, before, after), boundary)
        total = total + (ref * rand(tuple(ref.shape), 100 + r)).sum()
    total.backward()
    rs, cs = bs.block(me)
    forward = torch.equal(ext, serial_block(full, rows, cols, boundary))
    return failed([("forward", forward), ("grad", close(x.grad, fr.grad[..., rs, cs], 1e-12))])


@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_halo_through_torch_distributed(grid):
    """The same exchanges with the axis groups' torch.distributed (gloo) transports."""
    with mpidp.DistributedManager(domain_parallel_size=grid, transport="torch") as m:
        assert {m.transport("lat").name, m.transport("lon").name} <= {"torch", "self"}
        bad = []
        for boundary in (("polar", "circular"), ("reflect", "zeros")):
            for widths in (WIDTHS[0], WIDTHS[2]):
                bad += halo_case(m, (7, 10), boundary, widths)
        assert not bad


def test_halo_widths_per_axis_rank(gm):
    """Widths may differ per latitude index and per longitude index, as on bands."""
    p_lat, p_lon = gm.grid
    before = ([i % 3 for i in range(p_lat)], [(j + 1) % 3 for j in range(p_lon)])
    after = ([(i + 2) % 3 for i in range(p_lat)], [j % 2 for j in range(p_lon)])
    full = rand((1, 2, 7, 10), 8)
    bs = gm.block_spec(full.shape)
    x = mpidp.shard_tensor(full, dim=(-2, -1), manager=gm)
    i, j = gm.grid_coords
    boundary = ("polar", "circular")
    ext = mpidp.halo_exchange(x, before, after, (-2, -1), bs, gm, boundary)
    mine = ((before[0][i], before[1][j]), (after[0][i], after[1][j]))
    assert torch.equal(ext, serial_block(full, *my_range(bs, gm.domain_rank, *mine), boundary))


@pytest.mark.parametrize(
    ("boundary", "widths"),
    [
        (("polar", "circular"), ((2, 2), (2, 3))),
        (("reflect", "zeros"), ((2, 1), (1, 2))),
        ((("zeros", "polar_half"), "circular"), ((1, 3), (3, 1))),
    ],
    ids=str,
)
def test_halo_gradcheck(gm, boundary, widths):
    """The Jacobian of the whole distributed exchange (halos wider than the thinnest blocks
    at 3 ranks) and, for the first case, its double backward."""
    bs = gm.block_spec((5, 6))
    shapes = [(1, 2, *bs.block_shape(r)) for r in range(gm.domain_world_size)]

    def f(x):
        return mpidp.halo_exchange(x, *widths, (-2, -1), bs, gm, boundary)

    second = boundary == ("polar", "circular")
    gradcheck_global(gm.transport("domain"), shapes, f, second=second)


def test_halo_refusals(gm):
    x = mpidp.shard_tensor(rand((1, 1, 7, 13), 9), dim=(-2, -1), manager=gm)
    with pytest.raises(ConfigError, match=r"the longitude has 13 columns, odd"):
        mpidp.halo_exchange(x, 1, 1, (-2, -1), manager=gm, boundary=("polar", "circular"))
    with pytest.raises(ConfigError, match=r"the polar fold is a latitude boundary"):
        mpidp.halo_exchange(x, 1, 1, (-2, -1), manager=gm, boundary=("zeros", "polar"))
    with pytest.raises(ConfigError, match=r"pass two distinct dims"):
        mpidp.halo_exchange(x, 1, 1, (-1, 3), manager=gm)


# -- band code refuses a grid that cuts the longitude --------------------------------------------


def _band_calls(m):
    """Each entry point where band code meets the manager: a converted layer, a ShardedTensor of
    one cut dim, the 1-D halo exchange and a v-collective over the domain group, and what each
    must name (converted models and ShardedTensors run on blocks: test_blocks_sharded.py)."""
    p = m.domain_world_size
    x = rand((1, 2, 8, 12), 11)
    # a layer without a block form, 1-D (tests/mpi/test_blocks_layers.py: those with one)
    conv = mpidp.convert_to_domain_parallel(torch.nn.MaxPool1d(3, 1, 1), manager=m)
    return {
        "converted conv": (
            lambda: conv(x[..., 0, :]),
            "the converted layer DomainParallelMaxPool1d",
        ),
        "mpidp.shard": (lambda: mpidp.shard(x, -2, manager=m), "a ShardedTensor of one cut"),
        "1-D halo": (
            lambda: mpidp.halo_exchange(x, 1, 1, -2, manager=m),
            "halo_exchange with one dim over the domain group",
        ),
        "all_gather_v": (
            lambda: mpidp.all_gather_v(x, [8] * p, -2, group=m),
            "all_gather_v over the domain group",
        ),
        "shard_tensor": (
            lambda: mpidp.shard_tensor(x.repeat(1, 1, p, 1), -2, manager=m),
            "shard_tensor / gather_tensor with one dim",
        ),
        # a module conversion leaves as it is: on bands it acts along W, whole on every rank
        "bare Linear": (
            lambda: mpidp.convert_to_domain_parallel(torch.nn.Linear(12, 12).double(), m)(x),
            "Linear, left as it is by the conversion,",
        ),
    }


def test_band_code_refuses_blocks(gm):
    """On a grid with P_lon > 1 every band entry point raises the same ConfigError on every
    rank before any message (no hang), naming the rank, the grid, what works on blocks and the
    fix; on bands (P_lon = 1) none refuses."""
    calls = _band_calls(gm)
    got = {name: refusal(call) for name, (call, _) in calls.items()}
    p_lat, p_lon = gm.grid
    if p_lon == 1:
        checks = [(f"{name} refused on bands: {msg}", msg is None) for name, msg in got.items()]
    else:
        must = [
            f"rank {gm.rank}: ",
            f"grid ({p_lat}, {p_lon})",
            "halo_exchange(x, ..., dim=(-2, -1))",
            "gather_tensor(x, dim=(-2, -1))",
            "manager.block_spec(shape)",
            f"domain_parallel_size={p_lat * p_lon}",
            "group=manager.transport('lat') or group=manager.transport('lon')",
        ]
        checks = [
            (f"{name}: {msg}", msg is not None and all(s in msg for s in [what, *must]))
            for (name, msg), (_, what) in zip(got.items(), calls.values(), strict=True)
        ]
    verdicts = MPI.COMM_WORLD.allgather(failed(checks))
    assert not any(verdicts), verdicts


def test_axis_groups_pass_the_guard(gm):
    """The 1-D primitives over an axis group of the grid (what the block code runs on) and the
    reductions over the domain group (the same on bands and blocks) are not refused."""
    full = rand((2, 8, 12), 12)
    bs = gm.block_spec(full.shape)
    rs, cs = bs.block(gm.domain_rank)
    block = full[..., rs, cs]
    lat, lon = gm.transport("lat"), gm.transport("lon")
    rows = mpidp.all_gather_v(block, list(bs.lat.sizes), -2, group=lat)
    halo = mpidp.halo_exchange(block, 1, 1, -1, bs.lon, boundary="circular", group=lon)
    whole = torch.nn.functional.pad(full[..., rs, :], (1, 1), mode="circular")
    c0, c1 = cs.start, cs.stop + 2
    total = mpidp.global_sum(block, manager=gm)
    mean = mpidp.global_mean(block, manager=gm)
    checks = [
        ("all_gather_v over lat", torch.equal(rows, full[..., :, cs])),
        ("halo over lon", torch.equal(halo, whole[..., c0:c1])),
        ("global_sum", close(total, full.sum(), 1e-12)),
        ("global_mean", close(mean, full.mean(), 1e-12)),
    ]
    verdicts = MPI.COMM_WORLD.allgather(failed(checks))
    assert not any(verdicts), verdicts
