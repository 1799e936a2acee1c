"""Importing mpidp changes nothing in torch: ``torch.autograd.Function.apply`` is torch's own
until the first ShardedTensor of the process is made (then a user's Function on
ShardedTensors runs with ShardedTensor semantics: tests/mpi/test_sharded.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from mpidp.layers.base import DomainParallel, band_forward


def run(code: str) -> str:
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_importing_mpidp_leaves_function_apply_alone():
    out = run(
        """
        import torch
        own = torch.autograd.Function.__dict__["apply"]
        import mpidp, mpidp.sharded, mpidp.compat.physicsnemo, mpidp.compat.credit
        model = mpidp.convert_to_domain_parallel(torch.nn.Conv2d(1, 1, 3, padding=1))
        print(torch.autograd.Function.__dict__["apply"] is own)
        """
    )
    assert out.split() == ["True"], out


def test_the_first_sharded_tensor_wraps_it_once():
    out = run(
        """
        import torch
        own = torch.autograd.Function.__dict__["apply"]
        import mpidp
        with mpidp.DistributedManager(domain_parallel_size=1) as m:
            x = mpidp.shard(torch.ones(1, 1, 4, 4), 2, m)
            first = torch.autograd.Function.__dict__["apply"]
            mpidp.shard(torch.ones(1, 1, 4, 4), 2, m)
            print(first is not own, torch.autograd.Function.__dict__["apply"] is first)
        """
    )
    assert out.split() == ["True", "True"], out


def test_a_layer_forward_says_what_wraps_it():
    """A domain-parallel layer's forward is decorated where it is written (band_forward);
    the class statement of one that is not raises, naming the decorator."""
    with pytest.raises(TypeError, match="band_forward"):

        class Bare(DomainParallel, nn.Identity):
            def forward(self, x):
                return x

    class Marked(DomainParallel, nn.Identity):
        @band_forward
        def forward(self, x):
            return x + 1

    assert float(Marked()(torch.zeros(1))) == 1.0
