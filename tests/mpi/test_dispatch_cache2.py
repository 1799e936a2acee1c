"""The per-call costs of ShardedTensor dispatch that issue 47 removed, each checked to keep
what the general path gives:

* a plain model fed ShardedTensors: each functional layer call (``F.conv2d``, the periodic
  convolution, ``F.group_norm``, ``F.interpolate``) keeps the plan its handler made for the
  call's signature (the band's layout, the other arguments, the parameters by identity); a
  call of another layout, length or parameter is checked afresh, a refused layout is still
  refused on every rank after a plan exists;
* no module hook runs per module call: a refusal still names the module path (read off the
  stack when it is raised);
* a converted layer called eagerly in a process that imported dynamo runs its forward as it
  is, not through ``torch.compiler.disable``'s entry.

Float64, uneven shards, output, input gradient and every parameter gradient (after
``mpidp.sync_gradients``) against the serial model; asserted after every collective.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import rand, refusal
from test_dispatch_cache import GRIDS, SHAPE, _differs, _run, _serial
from torch import nn

import mpidp
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import UnsupportedOp

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def gm(request):
    """Bands, and at 4 and 6 ranks a grid of blocks with both axes cut."""
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


class _Net(nn.Module):
    """A periodic conv, a GroupNorm, a bilinear upsampling and a plain conv: every functional
    layer call a U-Net step makes."""

    def __init__(self) -> None:
        super().__init__()
        self.pconv = mpidp.PeriodicConv2d(3, 4, 3, pole="polar")
        self.norm = nn.GroupNorm(2, 4)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.conv = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.up(self.norm(self.pconv(x))))


def test_functional_layer_plans_follow_the_call(gm):
    """The fed model called with one layout twice (the second call takes the plans), then a
    longer field whose cut gives rank 0 the same band shape (on blocks: a longer field), then
    new parameters (other tensors, other values), then the first layout again: every call
    equals serial. On bands, a band cut along the channels is still refused on every rank
    after the plans exist."""
    torch.manual_seed(30)
    serial = _Net().double()
    fed = copy.deepcopy(serial)
    first = gm.partition.spec(SHAPE[2], gm.domain_world_size)
    same_band = ShardSpec((first.sizes[0], *(n + 1 for n in first.sizes[1:])))
    short, longer = rand(SHAPE, 2), rand((2, 3, same_band.total, 20), 3)
    if gm._blocks:  # (a block's cut is the policy's)
        same_band = None
    bad = []
    for name, full, spec in [
        ("first", short, None),
        ("first again", short, None),
        ("another length", longer, same_band),
        ("new parameters", short, None),
        ("first once more", short, None),
    ]:
        if name == "new parameters":
            for net in (serial, fed):  # the same new values in both
                torch.manual_seed(31)
                net.conv.weight = nn.Parameter(torch.randn_like(net.conv.weight))
                net.pconv.bias = nn.Parameter(torch.randn_like(net.pconv.bias))
        want = _serial(serial, serial, full)
        bad += [f"{name}: {b}" for b in _differs(_run(gm, fed, fed, full, spec), want)]
    said = "sharded along dim 1"
    if not gm._blocks:
        channels = mpidp.shard(rand((1, 6, 13, 20), 4), 1, gm)  # 6: a channel a rank
        said = refusal(lambda: F.conv2d(channels, fed.conv.weight, None, padding=1), UnsupportedOp)
    assert not bad
    assert said is not None and "sharded along dim 1" in said, said


class _Cumsum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=-2)


def test_no_module_hook_and_refusals_still_name_the_module(manager):
    """Once ShardedTensors exist and a model ran on them, torch holds no global module hook
    (every module call of the process, plain ones too, would pay for it); a refusal inside a
    nested module still names its path."""
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Sequential(nn.SiLU(), _Cumsum()))
    x = mpidp.shard(rand((1, 3, 13, 20), 5), 2, manager)
    said = refusal(lambda: model.double()(x), UnsupportedOp)
    hooks = torch.nn.modules.module
    assert not hooks._global_forward_pre_hooks and not hooks._global_forward_hooks
    assert said is not None and "in module 1.1 (_Cumsum) of Sequential" in said, said


def test_an_eager_layer_call_skips_the_compiler_entry(manager):
    """A converted layer called eagerly after dynamo was imported (a process that compiles
    something else) runs no frame of dynamo's ``disable`` wrapper."""
    import torch._dynamo  # noqa: F401

    layer = mpidp.convert_to_domain_parallel(nn.GroupNorm(1, 3).double(), manager)
    band = mpidp.shard(rand((1, 3, 13, 20), 6), 2, manager).local
    files: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        layer(band)
    finally:
        sys.setprofile(None)
    assert not [f for f in files if "_dynamo" in f], sorted(files)
