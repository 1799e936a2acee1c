"""Windowed attention (Swin, Pangu) on latitude bands against the serial modules: shifted and
unshifted windows, grids padded to a multiple of the window (offset window grids), Swin's
relative and Pangu's earth-specific bias, 2-D and 3-D, every cut (balanced, weighted, thin,
window-aligned), float64; output, input gradient and every parameter gradient (the oracle).
The serial block itself is checked against an independent Swin written the reference way."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import check_sharded, rand
from mpi4py import MPI
from zoo_models import SwinBlock as ReferenceSwin

import mpidp
from mpidp.models import SwinBlock, SwinNet, WindowAttention
from mpidp.models.window import DomainParallelWindowAttention, window_rows
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


def cuts(h: int, window: int) -> dict[str, tuple[int, ...]]:
    out = {"balanced": mpidp.ShardSpec.balanced(h, WORLD).sizes}
    if WORLD > 1:
        out["weighted"] = mpidp.ShardSpec.from_weights(range(WORLD, 0, -1), h).sizes
        out["thin"] = (1,) * (WORLD - 1) + (h - WORLD + 1,)
        out["empty"] = (0,) + (1,) * (WORLD - 2) + (h - WORLD + 2,)
        if h // window >= WORLD:
            out["aligned"] = mpidp.Aligned(window).spec(h, WORLD).sizes
    return out


def converted(serial, manager):
    return mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)


#: (tokens (Z, H, W) or (H, W), window, earth-specific bias)
GEOMETRIES = {
    "swin-2d-padded": ((13, 12), (4, 4), False),
    "swin-2d-even": ((16, 10), (4, 5), False),
    "pangu-3d-padded": ((3, 11, 12), (2, 3, 4), True),
}


@pytest.mark.parametrize("shift", [False, True], ids=["windows", "shifted"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_window_attention_equals_serial(manager, geometry, shift):
    grid, window, earth = GEOMETRIES[geometry]
    serial = WindowAttention(8, 2, window, shift, grid if earth else None).to(F64)
    with torch.no_grad():
        serial.bias.normal_()  # large biases: a bias read for the wrong window shows
    dist = converted(serial, manager)
    assert isinstance(dist, DomainParallelWindowAttention) or WORLD == 1
    x = rand((2, *grid, 8), 3)
    for name, sizes in cuts(grid[-2], window[-2]).items():
        res = assert_matches_serial(
            serial,
            dist,
            [x],
            manager=manager,
            dim=-3,
            sizes=sizes,
            out_sizes=sizes,
            modules=(serial, dist),
        )
        assert res is not None, name


@pytest.mark.parametrize("earth", [False, True], ids=["swin", "pangu"])
def test_shifted_block_pair_converts_and_equals_serial(manager, earth):
    grid = (3, 13, 8) if earth else (13, 8)
    window = (2, 4, 4) if earth else (4, 4)
    serial = torch.nn.Sequential(
        SwinBlock(8, 2, window, False, grid if earth else None),
        SwinBlock(8, 2, window, True, grid if earth else None),
    ).to(F64)
    dist = converted(serial, manager)
    assert list(dist.state_dict()) == list(serial.state_dict())
    verdicts = mpidp.explain_conversion(copy.deepcopy(serial), manager)
    assert [v.path for v in verdicts if v.action == "converted"] == ["0.attn", "1.attn"]
    sizes = cuts(grid[-2], window[-2])["thin" if WORLD > 1 else "balanced"]
    assert_matches_serial(
        serial,
        dist,
        [rand((1, *grid, 8), 4)],
        manager=manager,
        dim=-3,
        sizes=sizes,
        out_sizes=sizes,
        modules=(serial, dist),
    )


def test_serial_block_equals_reference_swin():
    """mpidp.models.SwinBlock is Swin V1's block: with the weights of an independent Swin
    written the reference way (roll, view/permute windows, the -100 mask), the same output."""
    for shift in (0, 2):
        ref = ReferenceSwin(8, 2, 4, shift, 8, 12).to(F64)
        ours = SwinBlock(8, 2, (4, 4), shift=bool(shift)).to(F64)
        with torch.no_grad():
            for a, b in [(ours.norm1, ref.norm1), (ours.norm2, ref.norm2), (ours.mlp, ref.mlp)]:
                a.load_state_dict(b.state_dict())
            ours.attn.qkv.load_state_dict(ref.qkv.state_dict())
            ours.attn.proj.load_state_dict(ref.proj.state_dict())
            ours.attn.bias.copy_(ref.rpb)
        x = rand((2, 8, 12, 8), 5)
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-13, atol=1e-13)


def test_aligned_bands_fetch_only_what_the_shift_needs():
    """Bands of whole windows: unshifted windows need no row of another rank (no exchange at
    all); shifted ones need half a window from each neighbour (around the globe at the ends),
    the rows of the two windows that straddle the band's boundaries."""
    w = 4
    sizes = mpidp.Aligned(w).spec(w * WORLD, WORLD).sizes
    h = w * WORLD
    for q in range(WORLD):
        first, wanted, runs, keep = window_rows(sizes, w, 0, q)
        assert wanted == [[(w * r, w * r + w)] for r in range(WORLD)]
        assert (first, runs, keep) == (q, [(w * q, w)], 0)
        first, wanted, runs, keep = window_rows(sizes, w, w // 2, q)
        rows = [r for a, b in wanted[q] for r in range(a, b)]
        assert rows == [(w * q + i) % h for i in range(-2, w + 2)], (q, wanted[q])
        assert (first, keep) == (q - 1, 2)


def test_serial_blocks_on_sharded_tensors(manager):
    """The serial module, unconverted, on ShardedTensor tokens (the route of a third-party
    block): the 2-D pair runs (pad, roll and window reshapes on the sharded dim, batch 2);
    the 3-D windows merge the level windows into the latitude windows: the band is then in
    blocks (one per level window) and the block runs too."""
    pair = torch.nn.Sequential(SwinBlock(8, 2, (4, 4)), SwinBlock(8, 2, (4, 4), True)).to(F64)
    check_sharded(manager, pair, rand((2, 13, 8, 8), 6), dim=1, module=pair)
    block = SwinBlock(8, 2, (2, 3, 4), True, (3, 11, 12)).to(F64)
    check_sharded(manager, block, rand((1, 3, 11, 12, 8), 7), dim=2, module=block)


@pytest.mark.parametrize("cut", ["balanced", "thin"])
def test_plan_prices_the_window_rows_that_move(manager, cut):
    """``mpidp plan``'s bytes for the windows' row fetches (and the head's row move) equal what
    each rank's all-to-alls send in one forward and backward of the converted SwinNet."""
    from mpidp.preflight.plan import plan_model
    from mpidp.testing import count_traffic

    grid, shape = (52, 16), (2, 3, 52, 16)  # 13 token rows in windows of 4, padded to 16
    serial = SwinNet(3, 2, grid, patch=4, embed_dim=8, depth=2, heads=2, window=(4, 2)).to(F64)
    old = manager.partition
    if cut == "thin":
        manager.partition = mpidp.Weighted((1,) * (WORLD - 1) + (4 * WORLD,))
    try:
        priced = plan_model(serial, shape, WORLD, partition=manager.partition, dtype=F64)
        dist = converted(serial, manager)
        rows = manager.spec(grid[0])
        me = manager.domain_rank
        x = rand(shape, 9).narrow(-2, rows.start(me), rows[me]).requires_grad_()
        with count_traffic(manager) as traffic:
            dist(x).sum().backward()
    finally:
        manager.partition = old
    sent = traffic.ops.get("all_to_all_v", [0, 0])[1]
    assert sent == priced.ranks[me].transpose_bytes, (sent, priced.ranks[me])
    assert (sent > 0) == (WORLD > 1)


def test_attention_layers_over_gloo():
    """The converted window attention (3-D, shifted, thin cut) and MultiheadAttention (one
    head) through the torch.distributed transport (gloo) too."""
    with mpidp.DistributedManager(domain_parallel_size=WORLD, transport="torch") as gloo:
        serial = WindowAttention(8, 2, (2, 3, 4), True, (3, 11, 12)).to(F64)
        dist = converted(serial, gloo)
        sizes = cuts(11, 3)["thin" if WORLD > 1 else "balanced"]
        x = rand((1, 3, 11, 12, 8), 8)
        kw = dict(manager=gloo, dim=-3, sizes=sizes, out_sizes=sizes)
        assert_matches_serial(serial, dist, [x], modules=(serial, dist), **kw)
        mha = torch.nn.MultiheadAttention(6, 1, batch_first=True, dtype=F64)
        dmha = converted(mha, gloo)
        assert_matches_serial(
            lambda z: mha(z, z, z)[0],
            lambda z: dmha(z, z, z)[0],
            [rand((2, 11, 6), 9)],
            manager=gloo,
            dim=-2,
            modules=(mha, dmha),
        )
