"""Layer geometry: the input rows each rank needs, checked against torch's own layers.

Every rank is simulated in one process: its range of the zero-padded input is cut out, the
layer runs on it without padding, and the rows must equal the serial layer's rows that rank
owns. That is exactly what a domain-parallel layer does after a halo exchange.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import mpidp
from mpidp.errors import ConfigError
from mpidp.testing import serial_halo

SPECS = [(13, 1), (13, 3), (721, 4), (9, 4), (17, 3)]
CONV = list(
    itertools.product([1, 2, 3, 4, 5], [1, 2, 3], [0, 1, 2, "same", "valid", (2, 0)], [1, 2])
)


def rand(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def close(got, want):
    # Equal up to summation order: the layers run on different lengths.
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(("n", "parts"), SPECS)
def test_conv_ranges_reproduce_the_serial_conv(n, parts):
    x, checked = rand(1, 2, n), 0
    in_spec = mpidp.ShardSpec.balanced(n, parts)
    for k, s, pad, d in CONV:
        if pad == "same" and s != 1:
            continue
        lo_pad, hi_pad = mpidp.ops.geometry.padding_pair(pad, k, s, d)
        if mpidp.conv_output_size(n, k, s, pad, d) < parts:
            continue
        w = rand(3, 2, k, seed=1)
        want = F.conv1d(F.pad(x, (lo_pad, hi_pad)), w, stride=s, dilation=d)
        out_spec = mpidp.ShardSpec.balanced(want.size(-1), parts)
        ranges = mpidp.input_ranges(in_spec, out_spec, k, s, pad, d)
        for r, (lo, hi) in enumerate(ranges):
            got = F.conv1d(serial_halo(x, lo, hi, -1, "zeros"), w, stride=s, dilation=d)
            part = want.narrow(-1, out_spec.offsets[r], out_spec.sizes[r])
            torch.testing.assert_close(
                got, part, rtol=1e-13, atol=1e-13, msg=str((k, s, pad, d, r))
            )
            checked += 1
    assert checked > 50


@pytest.mark.parametrize(("n", "parts"), SPECS)
def test_conv_transpose_ranges_reproduce_the_serial_layer(n, parts):
    """The rows outside a rank's input range contribute nothing to its outputs."""
    x, checked = rand(1, 2, n), 0
    in_spec = mpidp.ShardSpec.balanced(n, parts)
    for k, s, pad, d in CONV:
        if not isinstance(pad, int):
            continue
        for op in range(max(s, d)):
            n_out = mpidp.conv_output_size(n, k, s, pad, d, transposed=True, output_padding=op)
            if n_out < parts:
                continue
            w = rand(2, 3, k, seed=2)
            want = F.conv_transpose1d(x, w, stride=s, padding=pad, dilation=d, output_padding=op)
            out_spec = mpidp.ShardSpec.balanced(n_out, parts)
            ranges = mpidp.input_ranges(
                in_spec, out_spec, k, s, pad, d, transposed=True, output_padding=op
            )
            for r, (lo, hi) in enumerate(ranges):
                keep = torch.zeros_like(x)
                keep[..., lo:hi] = x[..., lo:hi]
                full = F.conv_transpose1d(
                    keep, w, stride=s, padding=pad, dilation=d, output_padding=op
                )
                rows = slice(out_spec.offsets[r], out_spec.offsets[r] + out_spec.sizes[r])
                close(full[..., rows], want[..., rows])
                checked += 1
    assert checked > 50


def test_halo_spec_widths():
    in_spec = mpidp.ShardSpec.balanced(13, 3)  # 5, 4, 4
    hs = mpidp.HaloSpec.for_layer(in_spec, None, 3, 2, 1)  # 7 outputs: 3, 2, 2
    assert hs.ranges(in_spec) == [(-1, 6), (5, 10), (9, 14)]
    assert hs == mpidp.HaloSpec((1, 0, 0), (1, 1, 1))
    hs = mpidp.HaloSpec.for_layer(in_spec, None, 1, 2)  # 1x1 stride 2: 7 outputs, no halo
    assert hs.ranges(in_spec) == [(0, 5), (6, 9), (10, 13)]
    assert hs == mpidp.HaloSpec((0, -1, -1), (0, 0, 0))
    assert mpidp.HaloSpec.from_ranges(in_spec, hs.ranges(in_spec)) == hs


def test_geometry_errors():
    in_spec = mpidp.ShardSpec.balanced(13, 3)
    with pytest.raises(ConfigError, match="does not fit this layer"):
        mpidp.input_ranges(in_spec, mpidp.ShardSpec.balanced(12, 3), 3, 1, 1)
    with pytest.raises(ConfigError, match="needs stride 1"):
        mpidp.input_ranges(in_spec, None, 3, 2, "same")
    with pytest.raises(ConfigError, match="output_padding=2"):
        mpidp.input_ranges(in_spec, None, 3, 2, 1, transposed=True, output_padding=2)
    with pytest.raises(ConfigError, match="one before and one after"):
        mpidp.HaloSpec((1, 2), (1,))
