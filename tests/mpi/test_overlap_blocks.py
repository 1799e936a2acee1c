"""The overlapped convolution on latitude x longitude blocks (issues 46 / 47): the halo of both
cut dims in flight while the interior (rows and columns that read no halo) is computed, then the
edge rows (their columns beyond the block, corners included, in a second phase) and the edge
columns; forward and backward. Against serial torch on the full field and against the blocking
path, float64, uneven blocks in both dims (11 x 13), at every grid that fits the world (bands
are the grid (P, 1): the same code). And ``manager.overlap`` set differently on two ranks:
refused on every rank, naming them, instead of a wait until the deadline.

Every check is asserted after every collective of its test.
"""

from __future__ import annotations

import copy

import pytest
from helpers import rand
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.comm.timing import HALO_WAIT
from mpidp.errors import MpidpError
from mpidp.runtime.grid import BlockSpec

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ALL_GRIDS = [(1, 1), (2, 1), (1, 2), (3, 1), (1, 3), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2)]
GRIDS = [g for g in ALL_GRIDS if g[0] * g[1] == WORLD]
SHAPE = (1, 2, 11, 13)  # uneven over every grid above, in both dims

# (kernel, stride, padding, dilation, padding_mode): each padding mode (circular: the longitude
# wraps around the circle through the longitude row), stride 2, dilation with a 'same' padding,
# a 'valid' one (negative widths: trimmed, not fetched), a kernel and stride that differ per dim
CONVS = [
    (3, 1, 1, 1, "zeros"),
    (3, 2, 1, 1, "circular"),
    (3, 1, "same", 2, "reflect"),
    (5, 1, 2, 1, "replicate"),
    (3, 1, "valid", 1, "zeros"),
    ((3, 5), (2, 1), (1, 2), (1, 2), "circular"),
]


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def gm(request):
    """A manager whose whole world is one domain grid."""
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


def _rel(a, b):
    if a.shape != b.shape:
        return float("inf")
    if not b.numel():
        return 0.0
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def _step(m, layer, full, w, block, on, sharded):
    """This rank's output block, input gradient and parameter gradients (after
    sync_gradients), with the overlap on or off, and whether an overlapped wait ran. The
    input: a ShardedTensor (``sharded``; ``w`` the output's weights, global) or a plain block
    (weighted by ``w[block]``)."""
    for p in layer.parameters():
        p.grad = None
    waits, m.overlap = HALO_WAIT.waits, on
    try:
        if sharded:
            x = mpidp.shard(full, dim=(-2, -1), manager=m).requires_grad_()
            y = layer(x)
            (y * w).sum().backward()
            y, x = y.local, x.local
        else:
            x = mpidp.shard_tensor(full, dim=(-2, -1), manager=m).detach().requires_grad_()
            y = layer(x)
            (y * w[block]).sum().backward()
    finally:
        m.overlap = False
    ran = HALO_WAIT.waits > waits
    mpidp.sync_gradients(layer, m)
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters())], ran


@pytest.mark.parametrize(
    "geometry,sharded", [(g, False) for g in CONVS] + [(CONVS[1], True)], ids=str
)
def test_overlapped_conv_on_blocks(gm, geometry, sharded):
    """Serial torch (forward, input gradient, every parameter gradient) to 1e-10 and the
    blocking path to 1e-12 with the overlap on; the overlapped path ran on every rank. On a
    plain block, and once on a ShardedTensor (the converted model's front end)."""
    k, s, p, d, mode = geometry
    serial = nn.Conv2d(2, 3, k, s, p, d, padding_mode=mode).double()
    layer = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager=gm)
    full = rand(SHAPE, 1)
    fr = full.clone().requires_grad_()
    want = serial(fr)
    w = rand(tuple(want.shape), 2)
    (want * w).sum().backward()
    (p_lat, p_lon), (h, wd) = gm.grid, want.shape[-2:]
    out = BlockSpec(gm.partition.derived(h, p_lat), gm.partition.derived(wd, p_lon))
    rs, cs = out.block(gm.domain_rank)
    irs, ics = gm.block_spec(SHAPE).block(gm.domain_rank)
    block = (..., rs, cs)
    on, ran = _step(gm, layer, full, w, block, True, sharded)
    off, _ = _step(gm, layer, full, w, block, False, sharded)
    truth = [want.detach()[block], fr.grad[..., irs, ics], *(q.grad for q in serial.parameters())]
    to_serial = max(_rel(a, b) for a, b in zip(on, truth, strict=True))
    to_blocking = max(_rel(a, b) for a, b in zip(on, off, strict=True))
    assert to_serial <= 1e-10, f"overlapped vs serial: {to_serial:.2e}"
    assert to_blocking <= 1e-12, f"overlapped vs blocking: {to_blocking:.2e}"
    assert ran == (WORLD > 1), "the overlapped path did not run"


def _differing(m, sharded):
    """The error a converted conv raised on this rank with the overlap on only where the
    latitude index is 0 (on bands and on a 1 x P grid: domain rank 0), or None. Its input: a
    ShardedTensor or a plain block (whose partition the layer learns)."""
    on = m.domain_rank == 0 if 1 in m.grid else m.grid_coords[0] == 0
    c = 5 if sharded else 3  # a shape no other call uses: its halo is agreed afresh
    layer = mpidp.convert_to_domain_parallel(nn.Conv2d(c, 2, 3, padding=1).double(), manager=m)
    full = rand((1, c, 11, 13), 3)
    cut = mpidp.shard if sharded else mpidp.shard_tensor
    x = cut(full, dim=(-2, -1), manager=m)
    m.overlap = on
    try:
        layer(x)
    except MpidpError as err:
        return str(err)
    finally:
        m.overlap = False
    return None


@pytest.mark.skipif(WORLD == 1, reason="one rank: no halo, nothing to agree")
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_overlap_differing_between_ranks_is_refused(gm, sharded):
    """``manager.overlap`` on for some ranks only: every rank raises at the layer's first
    agreement (whose facts say whether the call fetches strips), naming the ranks and the fix,
    instead of waiting for a message that never comes."""
    err = _differing(gm, sharded)
    assert err is not None, "no error on this rank"
    assert "strips=False but rank 0 passed True" in err and "manager.overlap" in err, err
