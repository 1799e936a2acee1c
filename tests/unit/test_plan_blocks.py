"""``mpidp plan`` on latitude x longitude blocks: the halo bytes of each rank against a hand
count of the block exchange (mpidp.ops.block_halo: latitude rows as wide as the block, the
polar fold, then longitude columns as tall as the latitude-extended block, which carry the
corners), on uneven blocks; bands as the grid (P, 1); the comparison of grids; the CLI's
``--domain LATxLON``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpidp.cli import main
from mpidp.errors import ConfigError
from mpidp.layers.periodic import PeriodicConv2d
from mpidp.preflight.plan import best_blocks, block_shapes, plan_model
from mpidp.preflight.scaling import Network, predict_scaling
from mpidp.runtime.partition import Weighted


def test_conv_on_uneven_blocks_is_the_hand_count():
    """A 3x3 zero-padded conv, 2 channels, float64, on a 5 x 7 field over 2 x 2 blocks of
    3/2 rows by 4/3 columns. Each block receives and sends one row as wide as itself (its
    latitude neighbour), then one column as tall as its rows plus its two halo rows (the zero
    row beyond the field travels in the column too; the corner rides on it); a training step
    moves that forward and its adjoint backward."""
    res = plan_model(nn.Conv2d(2, 2, 3, padding=1), (1, 2, 5, 7), (2, 2), dtype=torch.float64)
    assert res.grid == (2, 2) and res.parts == 4 and not res.report.problems
    assert [(r.rows, r.cols) for r in res.ranks] == [(3, 4), (3, 3), (2, 4), (2, 3)]
    # points one way: row (width cols) + column (height rows + 2), each received and sent
    one_way = [4 + 5, 3 + 5, 4 + 4, 3 + 4]
    point = 2 * 8  # channels x bytes
    assert [r.recv_bytes for r in res.ranks] == [2 * n * point for n in one_way]
    assert [r.send_bytes for r in res.ranks] == [2 * n * point for n in one_way]
    assert [(r.halo_rows, r.halo_cols) for r in res.ranks] == [((2,), (2,))] * 4


def test_polar_fold_columns_come_from_half_a_circle_away():
    """A polar 3x3 conv (float32) on 4 x 8 over 2 x 2 blocks of 2 rows by 4 columns. Block
    (0, 0): the row beyond the north pole is its own row 1 (no latitude message) but its
    columns lie half a circle away, all four on block (0, 1): 4 points each way; one row from
    block (1, 0): 4 points each way; then two circular columns of 2 + 2 rows from block
    (0, 1): 8 points each way."""
    res = plan_model(PeriodicConv2d(1, 1, 3, pole="polar"), (1, 1, 4, 8), (2, 2))
    assert res.ranks[0].recv_bytes == res.ranks[0].send_bytes == 2 * (4 + 4 + 8) * 4
    assert res.across[0].boundary == "circular"
    # on bands (2 x 1) the fold stays on the rank: the rows alone
    bands = plan_model(PeriodicConv2d(1, 1, 3, pole="polar"), (1, 1, 4, 8), (2, 1))
    assert bands.ranks[0].recv_bytes == 2 * 8 * 4


def test_bands_are_the_grid_p_by_one_and_blocks_save_activations():
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Conv2d(3, 2, 3))
    shape = (1, 2, 13, 20)
    bands, pair = plan_model(model, shape, 4), plan_model(model, shape, (4, 1))
    assert bands.ranks == pair.ranks and bands.grid == pair.grid == (4, 1)
    assert all(r.cols == 20 for r in bands.ranks)
    blocks = plan_model(model, shape, (2, 2))
    saved = [r.activation_bytes for r in blocks.ranks]
    # every rank saves its share (more, for the halos it extends by), and less than serial
    assert blocks.serial_activation_bytes < sum(saved) < 1.3 * blocks.serial_activation_bytes
    assert max(saved) < 0.4 * blocks.serial_activation_bytes
    # the comparison: every grid of 4 ranks, each priced as its own plan prices it
    assert [c.grid for c in blocks.shapes] == block_shapes(4) == [(4, 1), (2, 2), (1, 4)]
    two = blocks.shapes[1]
    assert two.busiest_bytes == max(max(r.recv_bytes, r.send_bytes) for r in blocks.ranks)
    assert best_blocks(blocks.shapes) is not None


def test_square_blocks_beat_bands_on_a_wide_field():
    """Bands move two rows of W points; 4 x 4 blocks of a 64 x 128 field move about 2 x 16 +
    2 x 32 points per conv: the comparison names 4 x 4 (or the shape with fewer bytes)."""
    res = plan_model(nn.Conv2d(1, 1, 3, padding=1), (1, 1, 64, 128), 16, simulate=False)
    bands = res.shapes[0]
    best = best_blocks(res.shapes)
    assert bands.grid == (16, 1) and best is not None
    assert best.busiest_bytes == min(c.busiest_bytes for c in res.shapes if c.grid[1] > 1)
    assert best.busiest_bytes < bands.busiest_bytes / 2
    assert f"blocks {best.grid[0]} x {best.grid[1]} move the fewest bytes" in str(res)


def test_spectral_transposes_on_blocks_are_the_pencils_then_the_band_all_to_all():
    """A spectral convolution (2 channels, float32) on 6 x 8 over 2 x 2 blocks of 3 rows by 4
    columns. Block (0, 0) sub-cuts its 3 rows over its longitude row (2 and 1): its pencil
    transpose sends 1 row x 4 columns and gets 2 rows x 4 columns, real values; then the band
    all-to-all over the 4 ranks on the pencils' rows (2, 1, 2, 1) with the 5 modes cut
    (2, 1, 1, 1): it sends its 2 rows of the 3 modes it does not hold and gets the other 4
    rows of its 2 modes, complex values. rfft2 and irfft2 each, forward and backward."""
    from mpidp.models import SpectralConv2d

    res = plan_model(SpectralConv2d(2, 2, 1, 2), (1, 2, 6, 8), (2, 2), simulate=False)
    point = 2 * 4  # channels x bytes
    pencil = 2 * (1 * 4 + 2 * 4) * point
    band = 2 * (2 * 3 + 4 * 2) * point * 2  # complex
    assert res.ranks[0].transpose_bytes == pencil + band
    assert res.ranks[0].send_bytes == pencil + band  # no halo
    # on bands (2 x 1) no pencil: the band all-to-all of 3 rows, 5 modes cut (3, 2)
    bands = plan_model(SpectralConv2d(2, 2, 1, 2), (1, 2, 6, 8), (2, 1), simulate=False)
    assert bands.ranks[0].transpose_bytes == 2 * (3 * 2 + 3 * 3) * point * 2
    # the comparison of grids counts the transposes too
    two = next(c for c in res.shapes if c.grid == (2, 2))
    assert two.busiest_bytes == max(r.send_bytes for r in res.ranks)


def test_blocks_in_the_scaling_model_follow_the_formula():
    """One 3x3 conv on 8 x 8 at 4 ranks: the best blocks are 2 x 2; each rank computes a
    quarter and sends one message along each axis, each way, forward and backward."""
    model = nn.Conv2d(2, 2, 3, padding=1)
    net = Network("test", alpha=1e-3, beta=1e6)
    (pt,) = predict_scaling(
        model, (1, 2, 8, 8), [4], serial_step=1.0, network=net, per_call=0.0, blocks=True
    )
    assert pt.grid == (2, 2) and (pt.rows, pt.cols) == (4, 4)
    assert pt.compute == pytest.approx(0.25)
    priced = plan_model(model, (1, 2, 8, 8), (2, 2), simulate=False)
    nbytes = max(priced.ranks[0].send_bytes, priced.ranks[0].recv_bytes)
    params = sum(p.numel() for p in model.parameters()) * 4
    grads = net.seconds(2 * 2, 2 * 3 / 4 * params)
    assert pt.comm == pytest.approx(net.seconds(4, nbytes) + grads)


def test_refusals_are_sentences(capsys):
    with pytest.raises(ConfigError, match=r"domain_parallel_size.*\(P_lat, P_lon\)"):
        plan_model(nn.Conv2d(1, 1, 3), (1, 1, 8, 8), (2, 0))
    for bad in ("2x", "0x4", "2x2x2", "four"):
        with pytest.raises(SystemExit) as stop:
            main(["plan", "--grid", "13x20", "--domain", bad])
        assert stop.value.code == 2
        assert (
            "is not a domain: give N ranks (latitude bands) or LATxLON" in capsys.readouterr().err
        )
    cmd = ["plan", "--grid", "13x20", "--domain", "2x2", "--model", "resblock"]
    assert main([*cmd, "--partition", "weighted:1,1,1,2"]) == 2
    assert "weights are one per rank of latitude bands" in capsys.readouterr().err
    # priced; its periodic convs run on blocks (the polar fold across longitude ranks)
    assert main(cmd) == 0
    out = capsys.readouterr().out
    assert "over 2 x 2 = 4 domain ranks" in out and "halo columns per layer" in out
    assert "bands or blocks for 4 ranks" in out and "runs on bands only today" not in out
    # a weighted cut of bands is priced, the other grids are not compared under it
    res = plan_model(nn.Conv2d(1, 1, 3), (1, 1, 8, 8), 2, partition=Weighted((1.0, 3.0)))
    assert not res.shapes and "balanced cuts only" in res.unpriced[0]
