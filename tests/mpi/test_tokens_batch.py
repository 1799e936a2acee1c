"""Window models on latitude x longitude blocks at a batch above 1: the window partition's
reshape merges the batch with the cut window index (B x windows), so that dim holds ``lead``
runs of the windows and each rank its own windows of every batch entry (``BlockSpec.lead``),
against serial torch.

The FuXi-like (Swin V2) window block of ``test_tokens_peraxis`` (windows as tall as the field:
the latitude cuts each window inside, the longitude falls in the window index merged with the
batch): ``@``, einsum with a plain weight per window, SDPA with a mask per window, causal SDPA.
Float64, a 5 x 20 field, batch 2 and 3: the output, the input gradient and every parameter
gradient after ``mpidp.sync_gradients``, asserted only after every collective; a gather of the
merged layout; the calls that stay refused, refused on every rank alike.
Grids: 1 x 1; 1 x 2 and 2 x 1 at two ranks (2 x 1 is bands: their merged blocks); 1 x 3 at
three; 2 x 2 at four; 2 x 3 and 3 x 2 at six.
"""

from __future__ import annotations

import pytest
import torch
from helpers import WORLD, agreed, grid_id, rand, refusal
from test_tokens_peraxis import WW, C, H, N, W, model

import mpidp
from mpidp.errors import MpidpError

pytestmark = pytest.mark.mpi

TOL = 1e-10
GRIDS = {
    1: [(1, 1)],
    2: [(1, 2), (2, 1)],
    3: [(1, 3)],
    4: [(2, 2)],
    6: [(2, 3), (3, 2)],
}.get(WORLD, [])


@pytest.fixture(scope="module", params=[2, 3], ids=lambda b: f"batch{b}")
def serial(request):
    """The serial model at batch ``B``, its input and output weights, its output and gradients
    (once per batch)."""
    b = request.param
    torch.manual_seed(0)  # one model on every rank
    net, full, w = model(), rand((b, H, W, C), 20 + b), rand((b, H, W, C), 30 + b)
    xr = full.clone().requires_grad_()
    want = net(xr)
    (want * w).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    return net, full, w, want.detach(), xr.grad, grads


@pytest.fixture(scope="module", params=GRIDS, ids=grid_id)
def bm(request):
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


def test_window_blocks_at_a_batch_above_one_equal_serial(bm, serial):
    """The longitude's windows of every batch entry local, the latitude's rows of each window
    against its keys and values gathered over the column: forward and every gradient."""
    net, full, w, want, grad_in, grads = serial
    dist = model()
    dist.load_state_dict(net.state_dict())
    x = mpidp.shard(full, dim=(1, 2), manager=bm).requires_grad_()
    y = dist(x)
    (y * w).sum().backward()
    got = y.full_tensor()
    mpidp.sync_gradients(dist, bm)
    rows, cols = bm.block_spec(full.shape, (1, 2)).block(bm.domain_rank)
    failed = [] if torch.allclose(got, want, rtol=TOL, atol=TOL) else ["forward"]
    if not torch.allclose(x.local.grad, grad_in[:, rows, cols], rtol=TOL, atol=TOL):
        failed.append("input grad")
    failed += [
        f"grad {n}"
        for n, p in dist.named_parameters()
        if not torch.allclose(p.grad, grads[n], rtol=TOL, atol=TOL)
    ]
    failed = agreed([f"rank {bm.rank} grid {bm.grid} batch {full.size(0)}: {f}" for f in failed])
    assert not failed, failed


def _windows(m, b=2):
    """(full, windows): a (b, H, W, C) field and its windows (b x windows, tokens, C) with the
    batch merged into the longitude's window index."""
    full = rand((b, H, W, C), 40)
    x = mpidp.shard(full, dim=(1, 2), manager=m)
    s = x.view(b, 1, H, W // WW, WW, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, N, C)
    return full, s


def test_merged_windows_gather_to_the_serial_layout(bm):
    """``full_tensor`` of the merged layout is the serial window partition (each rank's
    strided windows of every batch entry back in their place)."""
    full, s = _windows(bm)
    want = full.view(2, 1, H, W // WW, WW, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, N, C)
    got = s.full_tensor()
    assert got.shape == want.shape == s.shape
    failed = agreed([] if torch.equal(got, want) else [f"rank {bm.rank} grid {bm.grid}"])
    assert not failed, failed


def _rows_merged(s):
    """A (1, C, 2 H, W) image whose rows hold the batch merged before the latitude cut."""
    return s.view(2, W // WW, H, WW, C).permute(4, 0, 2, 1, 3).reshape(1, C, 2 * H, W)


REFUSED = {
    "a slice of the merged windows": lambda s: s[1:3],
    "a roll of the merged windows": lambda s: s.roll(1, 0),
    "a conv over the merged rows": lambda s: torch.nn.functional.conv2d(
        _rows_merged(s), torch.ones(1, C, 3, 3, dtype=s.dtype), padding=1
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_reads_across_the_merged_windows_is_refused_on_every_rank(bm, name):
    """Refused on every rank alike, naming the merged blocks, with a fix (on a grid whose
    longitude is cut: bands have their own band rules of merged blocks)."""
    if bm.grid[1] == 1:
        pytest.skip("bands: the band rules of merged blocks")
    _, s = _windows(bm)
    msg = refusal(lambda: REFUSED[name](s), MpidpError)
    ok = msg is not None and "merged" in msg and "fix" in msg
    failed = agreed([] if ok else [f"rank {bm.rank} grid {bm.grid}: {msg}"])
    assert not failed, failed
