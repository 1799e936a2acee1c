"""Layout invariance, the promise a user can check (issue 46, item 7): the example U-Net
(:class:`mpidp.models.WeatherUNet`: polar and periodic convolutions, stride-2 convolutions,
GroupNorm, periodic bilinear upsampling, skips) trained a few steps on every layout of the
world's ranks, bands (P, 1), blocks (P_lat, P_lon) and a longitude-only grid (1, P), gives the
serial losses and weights (float64).

Each layout converts a copy of the serial model, feeds it each rank's block of the same data
and trains it with the latitude-weighted global loss, ``mpidp.sync_gradients`` and SGD with
momentum (Adam would turn a gradient that is zero in exact arithmetic, a conv bias before
GroupNorm, into a full-size step of rounding noise, different on every layout). Every rank
trains the serial model too (it is small), so the comparison needs no communication; the
checks are asserted after every layout ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rand
from mpi4py import MPI

import mpidp
from mpidp.models import WeatherUNet

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
LAYOUTS = (
    [(WORLD, 1), (1, WORLD)] + [(2, WORLD // 2)] * (WORLD == 4) + [(2, 3), (3, 2)] * (WORLD == 6)
)
LAYOUTS = list(dict.fromkeys(LAYOUTS))  # world 1: the one layout (1, 1)
SHAPE = (2, 3, 13, 20)  # uneven over every grid above; W a multiple of 4 (the U-Net's rule)
STEPS = 3


def batches():
    return [(rand(SHAPE, 10 + s), rand(SHAPE, 50 + s)) for s in range(STEPS)]


def train(model, data, loss_of, after_backward=lambda: None):
    """Losses of ``STEPS`` SGD steps of ``model`` on ``data``, and its parameters after them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        after_backward()
        opt.step()
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in model.parameters()]


def weighted_mse(weights):
    def loss(out, y):
        sq, w = (out - y).square(), torch.broadcast_to(weights, out.shape)
        return (sq * w).sum() / w.sum()

    return loss


@pytest.fixture(scope="module")
def serial():
    torch.manual_seed(0)
    model = WeatherUNet(SHAPE[1], SHAPE[1], SHAPE[-2:], width=4, groups=2).double()
    weights = mpidp.latitude_weights(SHAPE[-2], spec=[SHAPE[-2]])
    return model, train(copy.deepcopy(model), batches(), weighted_mse(weights))


def scaled_gap(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("grid", LAYOUTS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_training_is_the_same_on_every_layout(serial, grid):
    model, (want_losses, want_params) = serial
    with mpidp.DistributedManager(domain_parallel_size=grid) as m:
        par = mpidp.convert_to_domain_parallel(copy.deepcopy(model), manager=m)
        weights = mpidp.latitude_weights(SHAPE[-2], manager=m)

        def cut(t):
            return mpidp.shard_tensor(t, dim=(-2, -1), manager=m)

        data = [(cut(x), cut(y)) for x, y in batches()]

        def loss(out, y):
            return mpidp.global_mean((out - y).square(), weights, manager=m)

        losses, params = train(par, data, loss, lambda: mpidp.sync_gradients(par, m))
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses, strict=True))
    param_gap = max(scaled_gap(p, q) for p, q in zip(params, want_params, strict=True))
    assert loss_gap <= 1e-10 and param_gap <= 1e-10, (grid, losses, want_losses, param_gap)
