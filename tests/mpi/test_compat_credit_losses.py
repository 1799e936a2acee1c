"""CREDIT's training rule (a loss on each rank's band, then ``sync_domain_gradients``, an
average over the domain ranks) for every loss form its users write, on uneven bands (13 rows
over 2-4 ranks), float64: the parameter gradients are what the average gives on even bands
(a local mean: the global mean's; a local sum: the global sum's over P), and each rank's input
gradient is its rows of the gradient of the sum of the ranks' losses read that way. What the
row weights cannot follow is refused on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.compat.credit.domain_parallel import (
    convert_to_domain_parallel,
    initialize_domain_parallel,
    shard_tensor,
)
from mpidp.compat.credit.parallel import sync_domain_gradients
from mpidp.errors import ConfigError
from tests.mpi.helpers import rand

WORLD = MPI.COMM_WORLD.Get_size()
TOL = {"rtol": 1e-10, "atol": 1e-12}
H, W = 13, 6


@pytest.fixture(scope="module")
def manager():
    with mpidp.init(domain_parallel_size=WORLD):
        yield initialize_domain_parallel(WORLD, WORLD)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.b = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.b(F.gelu(self.norm(self.a(x))))


def serial_net():
    torch.manual_seed(0)
    return Net().double()


def _lat():
    return torch.cos(torch.linspace(-1.4, 1.4, H, dtype=torch.float64))[:, None]


def one_step(model, x):
    return [model(x)]


def rollout(model, x):
    out1 = model(x)
    return [out1, model(torch.cat([x[:, 1:], out1[:, :1]], dim=1))]


def rollout_detached(model, x):
    out1 = model(x)
    return [out1, model(out1.detach())]


def credit_base_loss(o, y, w, p):
    """CREDIT's BaseLoss on its Reconstruct postblock: per-variable channel slices unflattened
    to (B, levels, time, H, W), an element-wise base loss, latitude weights, a mean per
    variable, weighted variables stacked and averaged."""
    terms = []
    for i, weight in enumerate((0.7, 1.3)):
        pred = o[0][:, i : i + 1, ...].unflatten(1, (1, 1)).float()
        target = y[:, i : i + 1, ...].unflatten(1, (1, 1)).float()
        elementwise = F.mse_loss(target, pred, reduction="none") * w
        terms.append(weight * elementwise.mean())
    return p * torch.stack(terms).mean()


# each case: (steps, loss(outs, y, w) written as CREDIT's users write it on a band, and the
# number P multiplies each term by when the loss is read on the whole field: means P, sums 1)
CASES = {
    "local mean": (one_step, lambda o, y, w, p: p * F.mse_loss(o[0], y)),
    "local sum": (one_step, lambda o, y, w, p: ((o[0] - y) ** 2).sum()),
    "latitude-weighted mean": (one_step, lambda o, y, w, p: p * (w * (o[0] - y) ** 2).mean()),
    "mean of per-variable means": (
        one_step,
        lambda o, y, w, p: p * (o[0] - y).abs().mean(dim=(-2, -1)).mean(),
    ),
    "several losses added": (
        one_step,
        lambda o, y, w, p: (
            p * F.mse_loss(o[0], y)
            + 0.5 * p * F.l1_loss(o[0], y, reduction="mean")
            + 1e-3 * (o[0] * y).sum()
        ),
    ),
    "sum of output times weights": (one_step, lambda o, y, w, p: (o[0] * w).sum()),
    "rollout keeping the graph": (
        rollout,
        lambda o, y, w, p: p * F.mse_loss(o[0], y) + p * torch.mean((o[1] - y) ** 2),
    ),
    "CREDIT's BaseLoss": (one_step, credit_base_loss),
    "rollout detached": (
        rollout_detached,
        lambda o, y, w, p: p * F.mse_loss(o[0], y) + p * F.mse_loss(o[1], y),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_loss_form_averages_to_its_meaning_on_uneven_bands(manager, case):
    steps, loss = CASES[case]
    x, y, w = rand((2, 2, H, W), 1), rand((2, 2, H, W), 2), _lat()
    ref = serial_net()
    xr = x.clone().requires_grad_()
    loss(steps(ref, xr), y, w, WORLD).backward()  # the ranks' losses, read on the whole field

    model = convert_to_domain_parallel(serial_net(), manager)
    xb = shard_tensor(x).requires_grad_()
    loss(steps(model, xb), shard_tensor(y), shard_tensor(w, dim=0), 1).backward()
    sync_domain_gradients(model, manager)
    torch.testing.assert_close(xb.grad, shard_tensor(xr.grad), **TOL)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad / WORLD, **TOL, msg=n)


REFUSED = {
    "a nonlinear function of a mean": lambda o, y: torch.sqrt(F.mse_loss(o, y)),
    "a sum over the element count": lambda o, y: ((o - y) ** 2).sum() / o.numel(),
    "a mean over cropped rows": lambda o, y: (o - y)[..., 1:, :].mean(),
    "a product of two means": lambda o, y: (o - y).mean() * o.mean(),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_weights_cannot_follow_is_refused_on_every_rank(manager, case):
    model = convert_to_domain_parallel(serial_net(), manager)
    out = model(shard_tensor(rand((1, 2, H, W), 1)))
    with pytest.raises(ConfigError, match=r"rank \d+: .*sync_domain_gradients.*fix:"):
        REFUSED[case](out, shard_tensor(rand((1, 2, H, W), 2)))


def test_without_gradients_the_output_is_a_plain_band(manager):
    model = convert_to_domain_parallel(serial_net(), manager)
    x = shard_tensor(rand((1, 2, H, W), 1))
    with torch.no_grad():
        assert type(model(x)) is torch.Tensor
    assert type(model(x).detach()) is torch.Tensor
    # values are CREDIT's: the local loss as computed on the band
    out = model(x)
    assert torch.sqrt(F.mse_loss(out.detach(), out.detach() + 1)).item() == pytest.approx(1.0)
