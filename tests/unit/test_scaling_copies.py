"""The scaling model's copy term (mpidp/preflight/scaling.py: the copies a band step makes that
a serial step does not) against its formula on layers small enough to price by hand, the
copy rate measured here, and what ``mpidp plan`` prints of bytes moved when there are none."""

from __future__ import annotations

import math

import pytest
from torch import nn

from mpidp.models import SpectralConv2d
from mpidp.preflight.plan import plan_model
from mpidp.preflight.scaling import Network, copy_bytes_per_second, predict_scaling, table

NET = Network("test", alpha=1e-3, beta=1e6)
RATE = 1e6  #: bytes per second: 1 us a byte


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters()) * 4


def test_a_conv_on_bands_copies_its_band_with_its_halo_forward_and_backward():
    """One 3x3 conv over 9 x 8 at P = 2: the busiest rank holds 5 rows and fetches one on each
    side (the neighbour's and the zero row beyond the field); its input with the halo is
    7 x 8 points of 2 channels (the columns padded by the convolution itself: no copy),
    copied once each way; the gradient sync packs and unpacks the gradients."""
    model = nn.Conv2d(2, 2, 3, padding=1)
    one, two = predict_scaling(
        model, (1, 2, 9, 8), [1, 2], serial_step=1.0, network=NET, per_call=0.0, copy_rate=RATE
    )
    assert (one.copies, one.copy_bytes) == (0.0, 0.0)  # a serial step copies nothing more
    nbytes = 2 * (7 * 8 * 2 * 4) + 2 * _params(model)
    assert two.copy_bytes == nbytes
    assert two.copies == pytest.approx(nbytes / RATE)
    assert two.step == pytest.approx(two.compute + two.comm + two.copies)  # fixed 0, calls 0
    # the default prices no copies, and the rest of the point is the same
    (plain,) = predict_scaling(model, (1, 2, 9, 8), [2], serial_step=1.0, network=NET, per_call=0)
    assert plain.copies == 0.0
    assert two.step == pytest.approx(plain.step + nbytes / RATE)
    assert two.fixed == pytest.approx(0.0)


def test_blocks_copy_rows_and_columns_with_their_halos():
    """2 x 2 blocks of 9 x 8: block (0, 0) holds 5 x 4 and fetches one row and one column on
    each side (6 + 1 by 4 + 2: its input with the halo is 7 x 6 points)."""
    model = nn.Conv2d(2, 2, 3, padding=1)
    (pt,) = predict_scaling(
        model, (1, 2, 9, 8), [(2, 2)], serial_step=1.0, network=NET, copy_rate=RATE
    )
    assert pt.copy_bytes == 2 * (7 * 6 * 2 * 4) + 2 * _params(model)


def test_a_layer_without_a_halo_copies_nothing_and_a_transpose_packs_and_unpacks():
    """A 1x1 conv fetches no halo: only the gradient sync's buffer is copied. A spectral
    convolution packs what its transposes send and unpacks what they receive."""
    pointwise = nn.Conv2d(2, 2, 1)
    (pt,) = predict_scaling(
        pointwise, (1, 2, 9, 8), [2], serial_step=1.0, network=NET, copy_rate=RATE
    )
    assert pt.copy_bytes == 2 * _params(pointwise)
    spectral = SpectralConv2d(2, 3, 2, 2)
    (pt,) = predict_scaling(
        spectral, (1, 2, 9, 8), [2], serial_step=1.0, network=NET, copy_rate=RATE
    )
    sent = plan_model(spectral, (1, 2, 9, 8), 2, simulate=False).ranks
    busiest = max(sent, key=lambda r: r.transpose_bytes)
    assert busiest.transpose_bytes > 0
    assert pt.copy_bytes == 2 * busiest.transpose_bytes + 2 * _params(spectral)


def test_the_table_shows_each_term():
    model = nn.Conv2d(2, 2, 3, padding=1)
    points = predict_scaling(
        model, (1, 2, 9, 8), [1, 2], serial_step=1.0, network=NET, copy_rate=RATE, fixed=0.5
    )
    text = table(points, 1.0, NET, copy_rate=RATE)
    assert "copies 0.00 GB/s" in text
    head = text.splitlines()[1].split()
    assert head[6:11] == ["compute", "comm", "copies", "calls", "fixed"]
    row = text.splitlines()[3].split()
    assert float(row[7]) == pytest.approx(points[1].copies * 1e3, abs=0.01)
    assert float(row[9]) == pytest.approx(500.0)
    assert "copies not priced" in table(points, 1.0, NET)


def test_the_copy_rate_is_measured_here():
    rate = copy_bytes_per_second(nn.Conv2d(2, 2, 3, padding=1), (1, 2, 64, 64), repeats=2)
    assert math.isfinite(rate) and rate > 1e7  # at least 10 MB/s, whatever the load


def test_equal_bytes_of_bands_and_blocks_are_said_so():
    """A 1x1 conv moves nothing on bands or blocks: no ratio of nothing to nothing."""
    text = str(plan_model(nn.Conv2d(1, 1, 1), (1, 1, 8, 8), 2, simulate=False))
    assert "and the best blocks, 1 x 2, move as many bytes: 0.000 MB" in text
    assert "x more" not in text


def test_a_strided_layer_copies_its_window_not_the_band_and_the_gap():
    """A stride-2 conv over 9 rows at P = 8: rank 4 holds input row 5 and computes output row
    4, which reads input rows 7-9: its window (halo before -2, after 4) is 3 rows away from
    its band, not the band with 4 more; ranks 5-7 compute no output row and copy nothing.
    Counted as band plus the positive widths, 1024 thin bands of 1801 x 3600 made one rank
    copy 129 rows for 3 and priced it the busiest."""
    from mpidp.preflight.scaling import _halo_input_bytes

    plan = plan_model(nn.Conv2d(2, 2, 3, stride=2, padding=1), (1, 2, 9, 8), 8, simulate=False)
    (lat,), (lon,) = plan.report.layers, plan.across
    assert (lat.halo_before[4], lat.halo_after[4]) == (-2, 4)
    row = 8 * 2 * 4  # 8 columns of 2 channels, float32
    copied = [_halo_input_bytes(lat, lon, r, 0, 4) // row for r in range(8)]
    assert copied == [3, 3, 3, 3, 3, 0, 0, 0]
