"""The element-wise and batch rules, one per cut axis (a band is the grid (P, 1): one cut dim;
a latitude x longitude block has two), against serial torch on the full field at every grid
that fits the world: plain operands of the global length along the cut dims (cut to each
rank's rows and columns), of more dims than the input (the cut dims land later in the result),
and batched like the input in attention (key, value, mask).

Float64, H = 13 and W = 20 (uneven over every grid here): the output, the input gradient and
every parameter gradient after ``mpidp.sync_gradients``, asserted only after every collective.
Six ranks (2 x 3, 3 x 2): ``mpiexec -n 6 ... tests/mpi/test_per_axis_rules.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rand
from torch import nn

import mpidp

pytestmark = pytest.mark.mpi

TOL = 1e-10


class Pointwise(nn.Module):
    """Element-wise ops whose plain operands reach the cut dims: latitude weights (H, 1), a
    longitude row (W,), and a field of one more dim than the input (the result's cut dims move
    one dim later)."""

    def __init__(self) -> None:
        super().__init__()
        self.lat = nn.Parameter(rand((13, 1), 1))
        self.lon = nn.Parameter(rand((20,), 2))
        self.field = nn.Parameter(rand((2, 2, 3, 13, 20), 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.lat + self.lon) * self.field


class Attention(nn.Module):
    """Attention over the last two dims of (B, H, W, L, E) tokens: the query a ShardedTensor,
    the key one of the same cut, the value and the additive mask plain tensors of the global
    length along H and W (each rank uses its rows and columns)."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(rand((2, 13, 20, 4, 3), 4))
        self.mask = nn.Parameter(rand((13, 20, 4, 4), 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, torch.sin(x), self.value, attn_mask=self.mask)


CASES = {
    "pointwise": (Pointwise, (2, 3, 13, 20), (-2, -1), (2, 2, 3, 13, 20)),
    "attention": (Attention, (2, 13, 20, 4, 3), (1, 2), (2, 13, 20, 4, 3)),
}


def run(m, name):
    """The checks of one case that failed on this rank (collective: every rank runs all)."""
    kind, shape, dims, out_shape = CASES[name]
    torch.manual_seed(0)
    serial, model = kind().double(), kind().double()
    model.load_state_dict(serial.state_dict())
    full, w = rand(shape, 6), rand(out_shape, 7)
    xr = full.clone().requires_grad_()
    want = serial(xr)
    (want * w).sum().backward()
    x = mpidp.shard(full, dim=dims, manager=m).requires_grad_()
    y = model(x)
    (y * w).sum().backward()  # w plain, of the global shape: cut to each rank's part
    got = y.full_tensor()
    mpidp.sync_gradients(model, m)
    d = [k % len(shape) for k in dims]
    rows, cols = m.block_spec(shape, d).block(m.domain_rank)
    index = [slice(None)] * len(shape)
    index[d[0]], index[d[1]] = rows, cols
    found = [("shape", tuple(y.shape) == tuple(want.shape))]
    found += [("forward", torch.allclose(got, want, rtol=TOL, atol=TOL))]
    found += [
        ("input grad", torch.allclose(x.local.grad, xr.grad[tuple(index)], rtol=TOL, atol=TOL))
    ]
    found += [
        (f"grad {n}", torch.allclose(p.grad, dict(serial.named_parameters())[n].grad, TOL, TOL))
        for n, p in model.named_parameters()
    ]
    return [what for what, ok in found if not ok]


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_serial(gm, name):
    """The output, input gradient and parameter gradients equal serial torch's."""
    failed = run(gm, name)
    assert not failed, f"rank {gm.rank} grid {gm.grid}: {failed}"
