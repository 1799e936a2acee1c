"""Checks shared by the MPI tests: seeded data, gradcheck of a distributed function as one
global function, the adjoint identity summed over ranks, and the grids of latitude x
longitude blocks that fit the world (the ``gm`` fixture of tests/mpi/conftest.py runs a
module's tests once on each)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp
from mpidp.errors import ConfigError
from mpidp.sharded import Replicated, ShardedTensor, shard

WORLD = MPI.COMM_WORLD.Get_size()
#: every grid of blocks the suite runs (1-4 ranks, and 6: 2 x 3 and 3 x 2); bands are (P, 1)
ALL_GRIDS = [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2)]
#: the grids whose product is the world: one domain group of every rank
GRIDS = [g for g in ALL_GRIDS if g[0] * g[1] == WORLD]


@contextlib.contextmanager
def own_process_group() -> Iterator[None]:
    """The user's own torch.distributed set-up, as their scripts make it (gloo over TCP on rank
    0's free port, no mpidp); destroyed on exit."""
    assert not mpidp.is_initialized()
    port = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
    port = MPI.COMM_WORLD.bcast(port)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=MPI.COMM_WORLD.Get_rank(),
        world_size=WORLD,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def grid_id(grid):
    """A grid's test id: ``2x3``."""
    return f"{grid[0]}x{grid[1]}"


def close(a, b, tol=1e-10):
    """``a`` equal to ``b`` within ``tol`` (relative and absolute), of the same shape; None on
    both sides (a parameter the net did not use: no gradient on either side) is equal."""
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tol, atol=tol))


def agreed(failures):
    """Every rank's failures, on every rank (assert after every collective of a test)."""
    return [f for theirs in MPI.COMM_WORLD.allgather(failures) for f in theirs]


def refusal(call, kind=ConfigError):
    """The message of the ``kind`` error (ConfigError; MpidpError takes UnsupportedOp too)
    ``call`` raised on this rank, or None."""
    try:
        call()
    except kind as err:
        return str(err)
    return None


def rand(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def global_fn(t, local_shapes, f, replicated_out=False):
    """The distributed function as one function of a replicated global input, for gradcheck.

    Every rank gets its own block of the flat global input (``local_shapes[r]``, through the
    sharding Function, whose backward all-gathers), applies ``f`` and the outputs of all ranks
    are concatenated (flat) on every rank with a replicated-downstream gather. gradcheck then
    perturbs the same input entry and seeds the same output entry on every rank, so it checks
    the Jacobian of the whole distributed computation, communication included. With
    ``replicated_out`` the output of ``f`` already is one value held by every rank.
    """
    numels = [int(torch.Size(s).numel()) for s in local_shapes]

    def g(xg):
        x = mpidp.shard_tensor(xg, 0, spec=numels, group=t).view(local_shapes[t.rank])
        y = f(x)
        if replicated_out:
            return y
        sizes = [int(n) for n in t.all_gather_object(y.numel())]
        return mpidp.all_gather_v_replicated(y.reshape(-1), sizes, 0, group=t)

    return g, sum(numels)


def on_transports(cases, torch_cases):
    """``(transport, *case)`` parameters for a gradcheck test: every case on the MPI transport,
    ``torch_cases`` on torch.distributed (gloo) too. gradcheck checks the math of mpidp's
    autograd Functions, which is one code over both transports (a transport only moves the
    bytes); the forward, gradient-against-serial and adjoint tests run every case on both.
    Use with ``indirect=["t"]``."""
    wrap = [c if isinstance(c, tuple) else (c,) for c in cases]
    return [("mpi", *c) for c in wrap] + [
        ("torch", *(c if isinstance(c, tuple) else (c,))) for c in torch_cases
    ]


def gradcheck_global(t, local_shapes, f, replicated_out=False, second=True):
    """gradcheck, and with ``second`` gradgradcheck (every backward is a partner Function, so
    double backward works) with ``grad_outputs`` drawn from one seed: the same on every rank,
    as the replicated output needs (gradgradcheck's own draw would differ between ranks)."""
    g, n = global_fn(t, local_shapes, f, replicated_out)
    xg = rand((n,), 60).requires_grad_()
    with _unchecked(t):
        assert torch.autograd.gradcheck(g, (xg,), eps=1e-6, atol=1e-8, rtol=1e-6)
        if not second or t.name != "mpi":  # the Functions are the transport's clients: once
            return
        seeded = rand(tuple(g(xg).shape), 64).requires_grad_()
        assert torch.autograd.gradgradcheck(g, (xg,), (seeded,), eps=1e-6, atol=1e-8, rtol=1e-6)


@contextlib.contextmanager
def _unchecked(t):
    """The transport's always-on argument checks off while gradcheck evaluates the function
    hundreds of times: the checks have their own tests (tests/launch/test_faults.py); here
    they would only add a collective to every collective of every evaluation (on gloo a
    blocking one: the torch-transport gradchecks took twice as long)."""
    old = getattr(t, "_checks", None)
    if old is not None:
        t._checks = False
    try:
        yield
    finally:
        if old is not None:
            t._checks = old


def adjoint_gap(t, f, x, replicated_out=False, replicated_in=False, seed=70):
    """|<F x, y> - <x, F* y>| relative, both sides summed over ranks (a side counted once when
    it is replicated: one value held by every rank). F* y is the backward pass seeded with y."""
    y_out = f(x) if x is not None else f(None)
    y = rand(y_out.shape, seed if replicated_out else seed + t.rank)
    lhs = float((y_out.detach() * y).sum())
    y_out.backward(y)
    rhs = float((x.detach() * x.grad).sum()) if x is not None and x.grad is not None else 0.0
    lhs_all = lhs if replicated_out else sum(t.all_gather_object(lhs))
    rhs_all = rhs if replicated_in else sum(t.all_gather_object(rhs))
    return abs(lhs_all - rhs_all) / max(1.0, abs(lhs_all))


def check_sharded(m, fn, full, dim=2, module=None, rtol=1e-10, atol=1e-12):
    """``fn(shard(full))`` against ``fn(full)``: values, shape, the input's gradient and the
    module's parameter gradients (summed by sync_gradients)."""
    if module is not None:
        module.zero_grad()
    xr = full.clone().requires_grad_()
    yr = fn(xr)
    w = rand(tuple(yr.shape), 5)
    (yr * w).sum().backward()
    refs = {}
    if module is not None:
        refs = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.zero_grad()
    x = shard(full, dim, m).requires_grad_()
    y = fn(x)
    assert tuple(y.shape) == tuple(yr.shape)
    got = y.full_tensor() if isinstance(y, ShardedTensor) else y
    assert isinstance(got, Replicated), type(got)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), yr.detach(), rtol=rtol, atol=atol)
    loss = (y * w).sum()
    assert isinstance(loss, Replicated)
    torch.testing.assert_close(
        float(loss.detach()), float((yr * w).sum().detach()), rtol=rtol, atol=atol
    )
    loss.backward()
    s = x.spec
    want = xr.grad.narrow(dim, s.start(x.rank), s.sizes[x.rank])
    torch.testing.assert_close(x.grad.local, want, rtol=rtol, atol=atol)
    if module is not None:
        mpidp.sync_gradients(module, m)
        for n, p in module.named_parameters():
            if n in refs:
                torch.testing.assert_close(p.grad, refs[n], rtol=rtol, atol=atol, msg=n)
    return y
