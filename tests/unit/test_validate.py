"""validate_sharding_constraints: a dry run by shape arithmetic (meta tensors), no MPI needed."""

from __future__ import annotations

from torch import nn

import mpidp
from mpidp.models import PeriodicResBlock, WeatherUNet


def test_unet_rows_and_halos_per_layer():
    report = mpidp.validate_sharding_constraints(
        WeatherUNet(3, 2, (37, 16), width=4), (1, 3, 37, 16), parts=4, partition=mpidp.Balanced()
    )
    assert report.ok, report.problems
    by_path = {layer.path: layer for layer in report.layers}
    down = by_path["down1.0"]  # 3x3 stride 2 pad 1: 37 rows -> 19
    assert down.rows_in == (10, 9, 9, 9) and down.rows_out == (5, 5, 5, 4)
    # rank r needs input rows [2 * first - 1, 2 * last + 2): [-1, 10), [9, 20), [19, 30), [29, 38)
    assert (down.halo_before, down.halo_after) == ((1, 1, 0, -1), (0, 1, 2, 1))
    assert by_path["up1.0"].rows_out == (10, 9, 9, 9)
    assert "down1.0" in str(report)


def test_problems_are_listed():
    model = nn.Sequential(nn.Conv2d(1, 2, 3, stride=4, padding=1), nn.Flatten())
    report = mpidp.validate_sharding_constraints(
        model, (1, 1, 9, 8), parts=4, partition=mpidp.Balanced()
    )
    assert not report.ok
    text = "\n".join(report.problems)
    assert "0 (Conv2d): cannot split 3 rows over 4 ranks" in text
    assert "1 (Flatten)" in text


def test_odd_longitude_with_polar_padding():
    report = mpidp.validate_sharding_constraints(
        PeriodicResBlock(2, 1, pole="polar"), (1, 2, 13, 9), parts=2, partition=mpidp.Balanced()
    )
    assert any("even W" in p for p in report.problems)
