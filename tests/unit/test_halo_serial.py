"""The serial halo reference against torch's own F.pad, and the halo plan without MPI.

The MPI tests compare :func:`mpidp.halo_exchange` with :func:`mpidp.testing.serial_halo`; here
that reference is itself checked against ``F.pad`` for every mode torch has, and the polar
kinds against a hand-written latitude mirror.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpidp
from mpidp.errors import ConfigError
from mpidp.ops.halo_plan import plan as _plan
from mpidp.testing import serial_halo

FPAD = {"zeros": "constant", "replicate": "replicate", "reflect": "reflect", "circular": "circular"}


def field(h=7, w=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, h, w), generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("kind", list(FPAD))
@pytest.mark.parametrize(("lo", "hi"), [(-3, 10), (-1, 7), (0, 9), (-2, 5), (2, 4), (-6, 13)])
def test_reference_matches_fpad(kind, lo, hi):
    full = field()
    h = full.size(-2)
    pad_lo, pad_hi = max(0, -lo), max(0, hi - h)
    assert max(pad_lo, pad_hi) < h  # torch's reflect limit; every case here is within it
    want = F.pad(full, (0, 0, pad_lo, pad_hi), mode=FPAD[kind])
    want = want.narrow(-2, lo + pad_lo, hi - lo)
    assert torch.equal(serial_halo(full, lo, hi, -2, kind), want)


@pytest.mark.parametrize("kind", ["polar", "polar_half"])
def test_reference_polar_by_hand(kind):
    """Row by row: beyond a pole, the mirrored latitude half way round the circle."""
    full = field(h=5, w=8)
    h, w = 5, 8
    got = serial_halo(full, -3, h + 3, -2, kind)
    shift = 0 if kind == "polar" else 1  # poles on rows, or half a row beyond them
    for k in range(1, 4):
        north = full[:, :, k - shift, :]
        south = full[:, :, h - 1 - k + shift, :]
        for j in range(w):
            assert torch.equal(got[:, :, 3 - k, j], north[:, :, (j + w // 2) % w])
            assert torch.equal(got[:, :, 3 + h - 1 + k, j], south[:, :, (j + w // 2) % w])


def test_reference_other_dim_and_pairs():
    full = field().movedim(-2, 0)  # the sharded dim first, the "longitude" last
    got = serial_halo(full, -2, 9, 0, ("zeros", "replicate"))
    assert torch.equal(got[:2], torch.zeros_like(got[:2]))
    assert torch.equal(got[-2:], full[-1:].expand(2, *full.shape[1:]))


# -- the plan ------------------------------------------------------------------------------


def test_plan_thin_shards_multi_hop_one_message_per_peer():
    """1-row shards, halo 3, reflect: rank 0 needs rows from three ranks; a row that serves as
    both a mirrored and a neighbour row travels once."""
    b = mpidp.Boundary.of("reflect")
    plan = _plan((1, 1, 1, 1), (3,) * 4, (3,) * 4, b, 0)
    assert plan.length == 7
    assert [peer for peer, _, _ in plan.recv] == [1, 2, 3]
    assert len(plan.remote) == 6
    assert plan.send == ((1, 0, 1), (2, 0, 1), (3, 0, 1))


def test_plan_zeros_and_interior():
    plan = _plan((3, 3), (2, 2), (2, 2), mpidp.Boundary.of("zeros"), 0)
    assert plan.zeros == ((0, 2),)
    assert plan.recv == ((1, 0, 2),)
    assert plan.send == ((1, 1, 3),)


def test_plan_zeros_wider_than_the_field():
    """FNO's pad of a small dim: zero rows past the whole field, on either side."""
    plan = _plan((3, 3), (9, 1), (2, 8), mpidp.Boundary.of("zeros"), 0)
    assert plan.length == 3 + 9 + 2
    assert plan.zeros == ((0, 9),)
    assert plan.recv == ((1, 0, 2),)
    plan = _plan((3, 3), (9, 1), (2, 8), mpidp.Boundary.of("zeros"), 1)
    assert plan.zeros == ((4, 8),)


@pytest.mark.parametrize(
    ("sizes", "before", "after", "boundary", "match"),
    [
        ((3, 3), (1, 1), (1, 1), "none", "beyond the low edge"),
        ((3, 3), (0, 1), (1, 2), None, "beyond the high edge"),
        ((3, 3), (7, 7), (0, 0), "circular", "supplies 6"),
        ((3, 3), (6, 6), (0, 0), "reflect", "supplies 5"),
        ((3, 3), (-2, 0), (-2, 0), "zeros", "trim more than its 3 rows"),
    ],
)
def test_plan_rejects_widths(sizes, before, after, boundary, match):
    with pytest.raises(ConfigError, match=match):
        _plan(sizes, before, after, mpidp.Boundary.of(boundary), 0)


def test_boundary_parsing():
    assert mpidp.Boundary.of(None) == mpidp.Boundary("none", "none")
    assert mpidp.Boundary.of(("zeros", "polar"), roll_dim=1).roll_dim == 1
    assert repr(mpidp.Boundary.of("polar")) == "Boundary('polar', roll_dim=-1)"
    with pytest.raises(ConfigError, match="unknown halo boundary 'mirror'"):
        mpidp.Boundary.of("mirror")
    with pytest.raises(ConfigError, match="circular must be used at both ends"):
        mpidp.Boundary.of(("circular", "zeros"))
