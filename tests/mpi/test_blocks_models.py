"""The example models' spectral and windowed-attention layers on latitude x longitude blocks
(issue 46, item 4) against the serial modules on the full field, at every grid that fits the
world (bands are the grid (P, 1), so the same tests run on bands too).

Each case converts the model's domain-parallel layers (the spectral filters, the window
attention: their band code per cut axis), runs the model's own forward on this rank's block
(uneven in both dims; the layers around them act on each point alone) and compares, in
float64, the output block, the input gradient and every parameter gradient after
``mpidp.sync_gradients`` with the serial model's; the checks are asserted only after every
collective of a test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import close, rand, refusal
from torch import nn

import mpidp
from mpidp.models import AFNOFilter, AFNONet, FNO2d, SwinBlock, SwinNet, WindowAttention
from mpidp.models.window import DomainParallelWindowAttention
from mpidp.ops.attention import sliding_window_attention

pytestmark = pytest.mark.mpi


def model_case(m, serial, convert, shape, dims, seed=0):
    """The failed checks of ``serial`` with its layers named by ``convert`` (attribute paths;
    None: the whole model, its forward then runs on block ShardedTensors) converted, run on
    this rank's block (cut along ``dims``), against ``serial`` on the full
    field: output, input gradient, every parameter gradient. The output has the input's
    blocks (the layers keep their input's partition)."""
    serial = serial.double()
    serial.zero_grad(set_to_none=True)  # a model checked twice: its own gradients afresh
    model = copy.deepcopy(serial)
    if convert is None:
        model = mpidp.convert_to_domain_parallel(model, manager=m)
    for path in convert or ():
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, name, mpidp.convert_to_domain_parallel(getattr(owner, name), manager=m))
    full = rand(shape, seed)
    x = mpidp.shard_tensor(full, dim=dims, manager=m).detach().requires_grad_()
    y = model(x)
    fr = full.clone().requires_grad_()
    want = serial(fr)
    w = rand(tuple(want.shape), seed + 1)
    rows, cols = m.block_spec(shape, dims).block(m.domain_rank)
    index = [slice(None)] * len(shape)
    index[dims[0]], index[dims[1]] = rows, cols
    mine = tuple(index)
    (y * w[mine]).sum().backward()
    (want * w).sum().backward()
    mpidp.sync_gradients(model, m)
    name = type(serial).__name__
    checks = [
        (f"{name} forward", close(y, want[mine])),
        (f"{name} input grad", close(x.grad, fr.grad[mine])),
    ]
    pairs = zip(model.named_parameters(), serial.named_parameters(), strict=True)
    checks += [(f"{name} grad {n}", close(p.grad, q.grad)) for (n, p), (_, q) in pairs]
    return [what for what, ok in checks if not ok]


def test_fno_and_afno(gm):
    """An FNO (1x1 lift, spectral convolutions + 1x1 convolutions, projection): modes kept in
    both dims (3 of each sign along H, the first 5 of W's 11, cut unevenly over the domain
    ranks, some holding none); an AFNO filter on channels-last tokens with half its modes kept
    in both dims."""
    torch.manual_seed(0)
    fno = FNO2d(3, 2, modes1=3, modes2=5, width=4, depth=2)
    bad = model_case(gm, fno, ["spectral.0", "spectral.1"], (2, 3, 13, 20), (-2, -1))
    bad += model_case(gm, fno, None, (2, 3, 13, 20), (-2, -1), seed=1)  # the whole model
    afno = AFNOFilter(8, (14, 20), num_blocks=2, hard_thresholding_fraction=0.5)
    bad += model_case(gm, nn.Sequential(afno), ["0"], (2, 14, 20, 8), (-3, -2), seed=2)
    assert not bad


def test_shifted_window_swin(gm):
    """An unshifted then a shifted Swin block (LayerNorm, window attention, MLP, residuals) on
    channels-last 13 x 20 tokens, windows of 4 x 6 (the grid padded to 16 x 24; at 2 x 2 the
    shifted windows straddle both cuts, at 3 ranks along an axis the unshifted ones too, at 4
    they span two ranks), the shifted one with Pangu's earth-specific bias; and a 3-D shifted
    window (the levels whole, padded and rolled locally)."""
    torch.manual_seed(1)
    swin = nn.Sequential(
        SwinBlock(8, 2, (4, 6), shift=False),
        SwinBlock(8, 2, (4, 6), shift=True, earth_grid=(13, 20)),
    )
    bad = model_case(gm, swin, ["0.attn", "1.attn"], (2, 13, 20, 8), (-3, -2), seed=4)
    attn = WindowAttention(4, 2, (2, 4, 6), shift=True, earth_grid=(3, 13, 20))
    bad += model_case(gm, nn.Sequential(attn), ["0"], (1, 3, 13, 20, 4), (-3, -2), seed=6)
    assert not bad


def test_patch_networks(gm):
    """FourCastNet's AFNO network and a Pangu-style Swin network (a patch-2 embedding, a
    position embedding, AFNO or unshifted and shifted window blocks, a patch head) on 16 x 20
    fields: 8 x 10 tokens, cut unevenly at 3 ranks along an axis, moved back to the pixels'
    partition by the head."""
    torch.manual_seed(2)
    common = ["patch_embed", "pos_embed", "head"]
    afno = AFNONet(3, 2, (16, 20), patch=2, embed_dim=8, depth=1, num_blocks=2)
    afno.blocks[0].filter.mask[:, 4:] = False  # not every W mode kept: the cut shows
    bad = model_case(gm, afno, [*common, "blocks.0.filter"], (2, 3, 16, 20), (-2, -1), seed=10)
    swin = SwinNet(3, 2, (16, 20), patch=2, embed_dim=8, depth=2, heads=2, window=(3, 4))
    paths = [*common, "blocks.0.attn", "blocks.1.attn"]
    bad += model_case(gm, swin, paths, (1, 3, 16, 20), (-2, -1), seed=12)
    for net in (afno, swin):  # the whole models: linear layers over the tokens' channels
        bad += model_case(gm, net, None, (1, 3, 16, 20), (-2, -1), seed=14)
    assert not bad


def test_sequence_attention_refuses_blocks(gm):
    """Attention over a 1-D sequence cut over the domain group takes blocks for bands: refused
    on blocks (on every rank, before any message) unless an axis group is named; on bands it
    runs. The window attention converts to its block form."""
    q = rand((1, 2, 5, 4), 8)
    got = refusal(lambda: sliding_window_attention(q, q, q, 1, group=gm))
    along = sliding_window_attention(q, q, q, 1, group=gm.transport("lon"))
    converted = mpidp.convert_to_domain_parallel(WindowAttention(4, 2, (2, 2)), manager=gm)
    if gm.grid[1] == 1:
        assert got is None
    else:
        assert "sliding_window_attention over the domain group" in (got or ""), got
    assert along.shape == q.shape
    assert isinstance(converted, DomainParallelWindowAttention)
