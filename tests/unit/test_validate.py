"""validate_sharding_constraints: a dry run by shape arithmetic (meta tensors), no MPI needed."""

from __future__ import annotations

import pytest
import torch
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


class _WithStatic(nn.Module):
    """A forward of two inputs: the state and static fields (orography, land-sea mask)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3 + 2, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x, static):
        return self.pool(self.conv(torch.cat([x, static.expand(x.shape[0], -1, -1, -1)], 1)))


def test_several_inputs_and_five_d_inputs():
    report = mpidp.validate_sharding_constraints(
        _WithStatic(),
        parts=3,
        partition=mpidp.Balanced(),
        example_inputs=[(2, 3, 20, 8), torch.zeros(1, 2, 20, 8)],
    )
    assert report.ok, report.problems
    by_path = {layer.path: layer for layer in report.layers}
    assert by_path["conv"].rows_in == (7, 7, 6) and by_path["pool"].rows_out == (4, 3, 3)
    three_d = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.MaxPool3d((1, 2, 2)))
    report = mpidp.validate_sharding_constraints(
        three_d, (1, 2, 4, 21, 8), parts=2, partition=mpidp.Balanced()
    )
    assert report.ok, report.problems
    assert [layer.rows_out for layer in report.layers] == [(11, 10), (5, 5)]
    assert report.layers[0].halo_before == (1, 1)  # a zero row beyond the field at rank 0
    with pytest.raises(mpidp.ConfigError, match="global_shape or example_inputs"):
        mpidp.validate_sharding_constraints(three_d, parts=2, partition=mpidp.Balanced())
