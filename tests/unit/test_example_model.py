"""The example U-Net on the globe (serially): no column is an edge, the poles are crossed.

A model whose padding wraps longitude commutes with a rotation of the globe by a whole number
of its coarsest columns (4 for two stride-2 levels); one that pads the date line with zeros
does not, and its edge columns forecast worse (issue 49: a seam at 0/360 degrees).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.layers.periodic import PeriodicConv2d
from mpidp.models import PeriodicUpsample, WeatherUNet

F64 = torch.float64


@pytest.mark.parametrize("grid", [(91, 180), (37, 16), (46, 24)])
def test_unet_commutes_with_a_rotation_of_the_globe(grid):
    torch.manual_seed(0)
    model = WeatherUNet(3, 2, grid, width=4).to(F64)
    x = torch.randn(2, 3, *grid, dtype=F64)
    y = model(x)
    for shift in (4, 8, 4 * (grid[1] // 8)):  # multiples of the coarsest column
        rotated = model(x.roll(shift, -1))
        torch.testing.assert_close(rotated, y.roll(shift, -1), rtol=1e-12, atol=1e-12)


def test_every_spatial_kernel_wraps_longitude_and_crosses_the_poles():
    model = WeatherUNet(3, 2, (37, 16), width=4)
    spatial = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    spatial = {n: m for n, m in spatial.items() if m.kernel_size != (1, 1)}
    assert sorted(spatial) == ["dec1.0", "dec2.0", "down1.0", "down2.0", "inc.0", "up2.1"]
    for name, conv in spatial.items():
        assert isinstance(conv, PeriodicConv2d) and conv.pole == "polar", name
    assert sum(isinstance(m, PeriodicUpsample) for m in model.modules()) == 2
    assert not any(isinstance(m, nn.ConvTranspose2d) for m in model.modules())


@pytest.mark.parametrize(
    "grid, size", [((23, 45), (46, 90)), ((19, 8), (37, 16)), ((4, 7), (7, 13))]
)
def test_periodic_upsample_is_the_upsample_of_the_repeated_circle(grid, size):
    """Three copies of the circle side by side, upsampled, the middle copy kept: the
    interpolation sees the columns across the date line, whatever the ratio of the widths."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, *grid, dtype=F64)
    three = nn.functional.interpolate(
        torch.cat([x, x, x], -1), size=(size[0], 3 * size[1]), mode="bilinear"
    )
    want = three[..., size[1] : 2 * size[1]]
    torch.testing.assert_close(PeriodicUpsample(grid, size)(x), want, rtol=0, atol=1e-14)


def test_a_circle_the_poles_cannot_roll_half_of_is_refused():
    with pytest.raises(ConfigError, match="W=18 longitudes; use a multiple of 4"):
        WeatherUNet(3, 2, (19, 18))
