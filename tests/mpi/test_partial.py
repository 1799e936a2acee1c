"""Partial values (mpidp/sharded/partial.py): a contraction over the sharded dim stays a
summand per rank through linear ops and is summed once, when a consumer needs the value --
against serial torch, float64, uneven bands (11 rows over 2-4 ranks): values, input
gradients, the gradients of a parameter and of a Replicated factor; the all-reduces counted;
mutations (no copy_to on a Replicated factor, no reduction) fail."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.sharded import Replicated, shard
from mpidp.sharded import partial as partial_mod
from mpidp.sharded.partial import PartialSum
from mpidp.testing import count_traffic
from tests.mpi.helpers import rand

WORLD = MPI.COMM_WORLD.Get_size()
TOL = {"rtol": 1e-10, "atol": 1e-12}
H, W = 11, 5


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


def all_reduces(traffic):
    return traffic.ops.get("all_reduce", [0, 0])[0]


def linear(x, y, w, c):
    """Sums, a product with a parameter and with a value every rank holds, an einsum over
    the sharded dim, views: all linear in the partial values."""
    a = (x * x).sum((-2, -1))  # (B, C)
    b = y.mean((-2, -1))
    e = torch.einsum("bchw,bdhw->bcd", x, y)  # contracts H (sharded) and W
    s = (a + 2 * b) * w - e.sum(-1) / 3 + (e.transpose(1, 2) @ w.view(-1, 1)).squeeze(-1)
    return (s * c).reshape(-1)


def chain(x, y, w, c):
    return (linear(x, y, w, c) ** 2).sum()  # the square needs the value


def test_linear_chain_is_one_all_reduce_and_exact(m):
    xs, ys = rand((2, 3, H, W), 1), rand((2, 3, H, W), 2)
    w = torch.nn.Parameter(rand((3,), 3))
    cr = rand((3,), 4).requires_grad_()
    xr, yr = xs.clone().requires_grad_(), ys.clone().requires_grad_()
    lr = chain(xr, yr, w, (cr * 1.5))
    lr.backward()
    want = {"x": xr.grad, "y": yr.grad, "w": w.grad.clone(), "c": cr.grad.clone()}
    w.grad = None
    c0 = torch.nn.Parameter(rand((3,), 4))
    x, y = shard(xs, 2, m).requires_grad_(), shard(ys, 2, m).requires_grad_()
    c = shard(rand((1, 3, H, W), 4), 2, m).amax((0, 2, 3))  # a Replicated value (max: eager)
    c = c * 0 + c0 * 1.5  # ... that depends on c0 on every rank
    with count_traffic(m) as traffic:
        s = linear(x, y, w, c)
        assert isinstance(s, Replicated)
        if WORLD > 1:
            assert isinstance(s, PartialSum) and all_reduces(traffic) == 0
        loss = (s**2).sum()
        value = float(loss)
    assert all_reduces(traffic) == (1 if WORLD > 1 else 0)  # the square's, once
    assert value == pytest.approx(float(lr), rel=1e-10)
    loss.backward()
    params = torch.nn.ParameterList([w, c0])
    assert params[0] is w
    mpidp.sync_gradients(params, m)  # plain tensors hold shares
    s = m.spec(H)
    rows = slice(s.start(m.domain_rank), s.start(m.domain_rank) + s.sizes[m.domain_rank])
    torch.testing.assert_close(x.grad.local, want["x"][:, :, rows], **TOL, msg="x")
    torch.testing.assert_close(y.grad.local, want["y"][:, :, rows], **TOL, msg="y")
    torch.testing.assert_close(w.grad, want["w"], **TOL, msg="w")
    torch.testing.assert_close(c0.grad, want["c"], **TOL, msg="c")


def test_a_partial_value_meets_a_band_and_nonlinear_ops(m):
    full = rand((1, 2, H, W), 5)
    xr = full.clone().requires_grad_()
    mean_r = xr.mean((-2, -1), keepdim=True)
    yr = (xr - mean_r) * mean_r.exp()
    (yr * yr).sum().backward()
    x = shard(full, 2, m).requires_grad_()
    mean = x.mean((-2, -1), keepdim=True)
    y = (x - mean) * mean.exp()
    torch.testing.assert_close(y.full_tensor().as_subclass(torch.Tensor), yr.detach(), **TOL)
    (y * y).sum().backward()
    s = m.spec(H)
    want = xr.grad[:, :, s.start(m.domain_rank) : s.start(m.domain_rank) + s.sizes[m.domain_rank]]
    torch.testing.assert_close(x.grad.local, want, **TOL)


def test_what_is_not_linear_in_a_summand_sums_first(m):
    """``p + 1`` is not the sum of ``p_r + 1``; neither is ``p * p`` nor ``1 / p``."""
    full = rand((H, W), 7)
    p = shard(full, 0, m).sum(0)
    want = full.sum(0)
    for got, ref in [
        (p + 1, want + 1),
        (1 - p, 1 - want),
        (p * p, want * want),
        (1 / p, 1 / want),
        (p + p.detach(), 2 * want),
        (torch.add(p, 2.0, alpha=3), want + 6),
    ]:
        torch.testing.assert_close(got.as_subclass(torch.Tensor), ref, **TOL)


def test_number_protocols_and_unwrapping_read_the_value(m):
    full = rand((H, W), 6)
    total = shard(full, 0, m).sum()
    assert float(total) == pytest.approx(float(full.sum()), rel=1e-12)
    assert bool(total > -1e9) and int(shard(torch.ones(H, W), 0, m).sum()) == H * W
    torch.testing.assert_close(total.as_subclass(torch.Tensor), full.sum(), **TOL)
    torch.testing.assert_close(total.item(), float(full.sum()), **TOL)
    assert total.shape == () and not total.requires_grad
    assert "PartialSum(value=" in repr(total) or WORLD == 1


@pytest.mark.mpi(min_size=2)
def test_mutation_a_replicated_factor_without_copy_to_loses_its_gradient(m, monkeypatch):
    monkeypatch.setattr(partial_mod, "copy_to", lambda plain, t: plain)
    c0 = rand((3,), 4).requires_grad_()
    x = shard(rand((1, 3, H, W), 1), 2, m)
    c = shard(rand((1, 3, H, W), 4), 2, m).amax((0, 2, 3)) * 0 + c0
    (x.sum((0, 2, 3)) * c).sum().backward()
    want = rand((1, 3, H, W), 1).sum((0, 2, 3))
    assert not torch.allclose(c0.grad, want)  # each rank kept only its share
