"""Window models on latitude x longitude blocks at a batch above 1: the window partition's
reshape merges the batch with the cut window index (B x windows), so that dim holds ``lead``
runs of the windows and each rank its own windows of every batch entry (``BlockSpec.lead``),
against serial torch.

The FuXi-like (Swin V2) window block of ``test_tokens_peraxis``: ``@``, einsum with a plain
weight per window, SDPA with a mask per window, causal SDPA; windows as tall as the field (the
latitude cuts each window inside, the longitude falls in the window index merged with the
batch; a 5 x 20 field, batch 2 and 3) and as wide as the field (the longitude cuts each
window inside, its rows merged before the cut in the tokens; the latitude in the window index
merged with the batch; 6 x 10, windows of 2 x 10, batch 2). Float64: the output, the input
gradient and every parameter
gradient after ``mpidp.sync_gradients``, asserted only after every collective; a gather of the
merged layout; the calls that stay refused, refused on every rank alike.
Grids: 1 x 1; 1 x 2 and 2 x 1 at two ranks (2 x 1 is bands: their merged blocks); 1 x 3 at
three; 2 x 2 at four; 2 x 3 and 3 x 2 at six.
"""

from __future__ import annotations

import pytest
import torch
from helpers import WORLD, agreed, grid_id, rand, refusal
from test_tokens_peraxis import WW, C, H, N, W, mismatches, model

import mpidp
from mpidp.errors import MpidpError

pytestmark = pytest.mark.mpi

GRIDS = {
    1: [(1, 1)],
    2: [(1, 2), (2, 1)],
    3: [(1, 3)],
    4: [(2, 2)],
    6: [(2, 3), (3, 2)],
}.get(WORLD, [])


#: (name, batch, window, field): windows as tall as the field (FuXi's: the latitude cuts them
#: inside, the longitude in the window index merged with the batch), and as wide as the
#: field (the longitude cuts them inside: each window's tokens hold its rows merged before the
#: cut; the latitude in the window index merged with the batch)
CASES = [
    ("tall", 2, (H, WW), (H, W)),
    ("tall", 3, (H, WW), (H, W)),
    ("wide", 2, (2, 10), (6, 10)),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-batch{c[1]}")
def serial(request):
    """The serial model of one case, its input and output weights, its output and gradients
    (once per case)."""
    _, b, window, field = request.param
    torch.manual_seed(0)  # one model on every rank
    net = model(window, field)
    full, w = rand((b, *field, C), 20 + b), rand((b, *field, C), 30 + b)
    xr = full.clone().requires_grad_()
    want = net(xr)
    (want * w).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    return (net, window, field), full, w, want.detach(), xr.grad, grads


@pytest.fixture(scope="module", params=GRIDS, ids=grid_id)
def bm(request):
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


def test_window_blocks_at_a_batch_above_one_equal_serial(bm, serial):
    """The axis cut in the window index merged with the batch local (its windows of every
    batch entry), the one cut inside the windows as the queries' rows against the keys and
    values gathered over its group (each of a window's rows, when the longitude cuts them):
    forward and every gradient."""
    (net, window, field), full = serial[0], serial[1]
    dist = model(window, field)
    dist.load_state_dict(net.state_dict())
    x = mpidp.shard(full, dim=(1, 2), manager=bm).requires_grad_()
    if bm.grid[1] == 1 and window[1] == field[1]:  # bands: their einsum takes no merged band
        msg = refusal(lambda: dist(x), MpidpError)
        ok = msg is not None and "einsum" in msg and "blocks merged" in msg
        failed = agreed([] if ok else [f"rank {bm.rank} grid {bm.grid}: {msg}"])
        assert not failed, failed
        return
    failed = agreed(mismatches(bm, dist, x, serial[1:]))
    assert not failed, failed


def _windows(m, b=2):
    """(full, windows): a (b, H, W, C) field and its windows (b x windows, tokens, C) with the
    batch merged into the longitude's window index."""
    full = rand((b, H, W, C), 40)
    x = mpidp.shard(full, dim=(1, 2), manager=m)
    s = x.view(b, 1, H, W // WW, WW, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, N, C)
    return full, s


def test_merged_windows_gather_and_reduce_as_the_serial_layout(bm):
    """``full_tensor`` of the merged layout is the serial window partition (each rank's
    strided windows of every batch entry back in their place); reductions over both cut dims
    (every entry once) and over neither (per token) are the serial ones."""
    full, s = _windows(bm)
    want = full.view(2, 1, H, W // WW, WW, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, N, C)
    got = s.full_tensor()
    failed = [] if got.shape == want.shape == s.shape and torch.equal(got, want) else ["gather"]
    for name, f in {
        "mean": lambda t: t.mean(dim=(0, 1)),
        "amax": lambda t: t.amax(dim=(0, 1)),
        "sum per token": lambda t: t.sum(-1),
    }.items():
        y = f(s)
        y = y.full_tensor() if isinstance(y, mpidp.ShardedTensor) else y
        if not torch.allclose(y, f(want), rtol=1e-12, atol=1e-12):
            failed.append(name)
    failed = agreed([f"rank {bm.rank} grid {bm.grid}: {f}" for f in failed])
    assert not failed, failed


def _rows_merged(s):
    """A (1, C, 2 H, W) image whose rows hold the batch merged before the latitude cut."""
    return s.view(2, W // WW, H, WW, C).permute(4, 0, 2, 1, 3).reshape(1, C, 2 * H, W)


def _converted_conv(s, m):
    conv = torch.nn.Conv2d(C, 1, 3, padding=1).double()
    return mpidp.convert_to_domain_parallel(conv, m)(_rows_merged(s))


REFUSED = {
    "a slice of the merged windows": lambda s, m: s[1:3],
    "a roll of the merged windows": lambda s, m: s.roll(1, 0),
    "a conv over the merged rows": lambda s, m: torch.nn.functional.conv2d(
        _rows_merged(s), torch.ones(1, C, 3, 3, dtype=s.dtype), padding=1
    ),
    "a converted conv over the merged rows": _converted_conv,
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_reads_across_the_merged_windows_is_refused_on_every_rank(bm, name):
    """Refused on every rank alike, naming the merged blocks, with a fix (on a grid whose
    longitude is cut: bands have their own band rules of merged blocks)."""
    if bm.grid[1] == 1:
        pytest.skip("bands: the band rules of merged blocks")
    _, s = _windows(bm)
    msg = refusal(lambda: REFUSED[name](s, bm), MpidpError)
    ok = msg is not None and "merged" in msg and "fix" in msg
    failed = agreed([] if ok else [f"rank {bm.rank} grid {bm.grid}: {msg}"])
    assert not failed, failed
