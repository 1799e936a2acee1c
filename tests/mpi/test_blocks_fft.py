"""mpidp.ops.fft on latitude x longitude blocks (issue 46, item 4) against torch.fft of the whole
field, float64, at every grid that fits the world (bands are the grid (P, 1)).

The spectral layout on blocks is the band one over the domain group: every H frequency, the
modes cut over all P_lat * P_lon ranks in domain rank order. Each test: the forward against
torch's (restricted to this rank's modes), the round trip back to this rank's block, the input
gradients against torch's gradient of the serial transform, on the manager's uneven blocks and
on given thin ones; double backward through the pencil transposes; the exchange count (bands:
exactly the band path's one all-to-all per transform); what stays refused on blocks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import gradcheck_global, rand, refusal

import mpidp.ops.fft as dfft
from mpidp.errors import ConfigError
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.partition import ShardSpec
from mpidp.testing import count_traffic

pytestmark = pytest.mark.mpi

SHAPES = [(9, 14), (7, 10)]  # uneven over 2, 3 and 4 ranks in both dims; odd and even W // 2
CLOSE = dict(rtol=1e-12, atol=1e-12)


def crand(shape, seed):
    return torch.complex(rand(shape, seed), rand(shape, seed + 1))


def block(full, bs, rank):
    rows, cols = bs.block(rank)
    return full[..., rows, cols]


def thin_blocks(m, h, w):
    """One row / column on every rank but the last of each axis: uneven the other way."""
    p_lat, p_lon = m.grid
    lat = ShardSpec.from_sizes([1] * (p_lat - 1) + [h - p_lat + 1])
    lon = ShardSpec.from_sizes([1] * (p_lon - 1) + [w - p_lon + 1])
    return BlockSpec(lat, lon)


@pytest.mark.parametrize("norm", [None, "ortho"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("cut", ["policy", "thin"])
def test_rfft2_and_irfft2_on_blocks_equal_torch(gm, shape, norm, cut):
    h, w = shape
    me = gm.domain_rank
    bs = gm.block_spec((h, w)) if cut == "policy" else thin_blocks(gm, h, w)
    given = None if cut == "policy" else bs  # the policy's blocks are learned (all-gathered)
    full = rand((2, 3, h, w), 1)
    x = block(full, bs, me).clone().requires_grad_()
    X = dfft.rfft2(x, norm=norm, manager=gm, spec=given)
    k = w // 2 + 1
    mine = dfft.modes(X)
    assert mine == dfft.mode_spec(k, manager=gm).slice(me) == dfft.modes(k, manager=gm)
    serial_x = full.clone().requires_grad_()
    serial_X = torch.fft.rfft2(serial_x, norm=norm)
    assert X.shape[-2] == h
    torch.testing.assert_close(X, serial_X[..., mine].detach(), **CLOSE)
    weight = crand(serial_X.shape, 5)  # the gradient of Re <X, G> with a complex G
    (X * weight[..., mine]).real.sum().backward()
    (serial_X * weight).real.sum().backward()
    torch.testing.assert_close(x.grad, block(serial_x.grad, bs, me), **CLOSE)

    # irfft2 of a non-Hermitian spectrum, back to blocks
    spectrum = crand((2, 3, h, k), 9)
    Y = spectrum[..., mine].clone().requires_grad_()
    y = dfft.irfft2(Y, s=(h, w), norm=norm, manager=gm, out_spec=given)
    serial_Y = spectrum.clone().requires_grad_()
    serial_y = torch.fft.irfft2(serial_Y, s=(h, w), norm=norm)
    torch.testing.assert_close(y, block(serial_y, bs, me).detach(), **CLOSE)
    probe = rand(serial_y.shape, 11)
    (y * block(probe, bs, me)).sum().backward()
    (serial_y * probe).sum().backward()
    torch.testing.assert_close(Y.grad, serial_Y.grad[..., mine], **CLOSE)

    # and back: irfft2(rfft2(x)) is x, on the same block
    back = dfft.irfft2(X, s=(h, w), norm=norm, manager=gm, out_spec=given)
    torch.testing.assert_close(back, x.detach(), **CLOSE)


def test_fft2_and_ifft2_of_complex_blocks(gm):
    h, w = 7, 10
    me = gm.domain_rank
    bs = gm.block_spec((h, w))
    full = crand((2, h, w), 21)
    x = block(full, bs, me).clone().requires_grad_()
    X = dfft.fft2(x, norm="ortho", manager=gm)
    mine = dfft.modes(X)
    assert mine == dfft.mode_spec(w, manager=gm).slice(me)
    serial_x = full.clone().requires_grad_()
    serial_X = torch.fft.fft2(serial_x, norm="ortho")
    torch.testing.assert_close(X, serial_X[..., mine].detach(), **CLOSE)
    weight = crand(serial_X.shape, 23)
    (X * weight[..., mine]).real.sum().backward()
    (serial_X * weight).real.sum().backward()
    torch.testing.assert_close(x.grad, block(serial_x.grad, bs, me), **CLOSE)
    torch.testing.assert_close(dfft.ifft2(X, norm="ortho", manager=gm), x.detach(), **CLOSE)


def test_s_crops_and_pads_on_blocks(gm):
    h, w = 9, 14
    me = gm.domain_rank
    full = rand((2, h, w), 3)
    x = block(full, gm.block_spec((h, w)), me)
    X = dfft.rfft2(x, s=(11, 9), manager=gm)
    want = torch.fft.rfft2(full, s=(11, 9))
    torch.testing.assert_close(X, want[..., dfft.modes(X)], **CLOSE)
    out = dfft.irfft2(X, s=(8, 12), manager=gm)
    serial = torch.fft.irfft2(want, s=(8, 12))
    torch.testing.assert_close(out, block(serial, gm.block_spec((8, 12)), me), **CLOSE)


def test_gradgradcheck_through_the_pencils(gm):
    """The global function of every rank's block, once and twice differentiated."""
    h, w = 5, 6
    t = gm.transport()
    bs = gm.block_spec((h, w))
    shapes = [(1, *bs.block_shape(r)) for r in range(t.size)]
    gradcheck_global(
        t, shapes, lambda x: torch.view_as_real(dfft.rfft2(x, norm="ortho", manager=gm))
    )


def test_exchanges_per_transform(gm):
    """A forward and inverse pair: on bands the band path's two all-to-alls (the longitude
    row is this rank alone: nothing more moves); on blocks two more, along the row."""
    h, w = 9, 14
    bs = gm.block_spec((h, w))
    x = block(rand((2, h, w), 61), bs, gm.domain_rank)
    k = dfft.mode_spec(w // 2 + 1, manager=gm)
    with count_traffic(gm) as traffic:
        dfft.irfft2(dfft.rfft2(x, manager=gm, spec=bs), s=(h, w), manager=gm, spec=k)
    counts = {op: c for op, (c, _) in traffic.ops.items() if c}
    p_lat, p_lon = gm.grid
    expected = 0 if p_lat * p_lon == 1 else 2 if p_lon == 1 else 4
    assert counts == ({"all_to_all_v": expected} if expected else {})


def test_band_only_transforms_refuse_on_blocks(gm):
    """The 1-D transforms, the halved-cut layout and a 2-D transform leaving out the latitude
    take their input for a band: on blocks each raises on every rank, before any message."""
    if gm.grid[1] == 1:
        pytest.skip("bands: these are the band transforms of tests/mpi/test_fft.py")
    x = block(rand((2, 9, 14), 7), gm.block_spec((9, 14)), gm.domain_rank)
    calls = [
        lambda: dfft.rfft(x, dim=-2, manager=gm),
        lambda: dfft.irfft2_halved_cut(x, manager=gm),
        lambda: dfft.fft2(x, dim=(0, -1), manager=gm),
    ]
    for call in calls:
        message = refusal(call)
        assert message is not None and "works on bands" in message, message
    with pytest.raises(ConfigError, match="gives this rank a block of"):
        dfft.rfft2(x, manager=gm, spec=thin_blocks(gm, 9, 14))
