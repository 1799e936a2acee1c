"""all_gather_v's kept calls (issue 47: a repeated call is a lookup and one exchange): each
call of a kept key computes what the serial concatenation computes, forward and backward, and
returns new memory (a caller that keeps one result never sees the next call's); on two ranks
the one-message exchange still fails on every rank when a peer passes something else; and a
kept transport gives way to the wrapped one of a ``count_traffic`` block."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.comm.mpi import MPITransport
from mpidp.errors import CommError
from mpidp.testing import count_traffic

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()


def rand(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def uneven(p):
    """Two lists of uneven sizes, the second with a zero on the first rank (two ranks: its
    message is the header alone) and a zero among them from three ranks on."""
    first = [3, 1, 0, 2][:p] if p > 2 else [3, 1][:p]
    return [first, [0, *first[1:]]]


def _close(got, want):
    return bool(torch.allclose(got, want, rtol=1e-10, atol=0))


def test_kept_calls_match_serial_forward_and_backward(manager):
    """Three calls of each key (the first takes the full path, the others the kept one), each
    on new data: the result is the whole field; the gradient is every rank's weight summed on
    this rank's part (partial downstream) or this rank's part of the one weight (replicated),
    along dim 0 (the transport's kept plan) and dim 1 (the transport's general path), with a
    rank of no rows, by a manager and by a transport, and under no_grad for an input that
    requires grad."""
    p, me = manager.domain_world_size, manager.domain_rank
    t = MPITransport(manager.domain_comm)
    problems = []
    for dim, sizes in ((d, s) for d in (0, 1) for s in uneven(p)):
        for fn, partial in ((mpidp.all_gather_v, True), (mpidp.all_gather_v_replicated, False)):
            for group in (manager, t):
                for call in range(3):
                    seed = 100 * dim + 10 * call + partial + 1000 * sizes[0]
                    shape = [2, 3]
                    shape[dim] = sum(sizes)
                    full = rand(shape, seed)
                    start = sum(sizes[:me])
                    x = full.narrow(dim, start, sizes[me]).clone().requires_grad_(True)
                    out = fn(x, sizes, dim, group)
                    w = [rand(shape, 1000 + seed + (j if partial else 0)) for j in range(p)]
                    (out * w[me]).sum().backward()
                    want = sum(w) if partial else w[me]
                    with torch.no_grad():
                        again = fn(x, sizes, dim, group)
                    where = f"dim {dim} sizes {sizes} {fn.__name__} {type(group).__name__} #{call}"
                    if not (torch.equal(out, full) and torch.equal(again, full)):
                        problems.append(f"{where}: forward")
                    if x.grad is None or not _close(x.grad, want.narrow(dim, start, sizes[me])):
                        problems.append(f"{where}: gradient")
    everyone = manager.transport().all_gather_object(problems)
    assert not any(everyone), everyone


@pytest.mark.parametrize("rows", [4, 3000], ids=["1KB", "72KB"])
def test_a_kept_result_is_never_overwritten_by_the_next_call(manager, rows):
    """A caller keeps the first result (and a view of it) across further calls of the same
    key, with and without a gradient, for small rows (a kept send buffer) and rows past the
    buffer cache's threshold (its buffers are reused once idle): each result keeps its own
    values, in its own memory."""
    p = manager.domain_world_size
    sizes = [rows] * p
    firsts, views, wants, ptrs = [], [], [], set()
    for call in range(4):
        full = rand((rows * p, 3), call)
        x = full[rows * manager.domain_rank :][:rows].clone().requires_grad_(call % 2 == 1)
        out = mpidp.all_gather_v(x, sizes, 0, manager)
        firsts.append(out)
        views.append(out[1:])
        wants.append(full)
        ptrs.add(out.data_ptr())
    problems = [
        f"call {i}: overwritten"
        for i, (out, view, want) in enumerate(zip(firsts, views, wants, strict=True))
        if not (torch.equal(out, want) and torch.equal(view, want[1:]))
    ]
    if len(ptrs) != len(firsts):
        problems.append(f"results share memory: {len(ptrs)} addresses for {len(firsts)}")
    everyone = manager.transport().all_gather_object(problems)
    assert not any(everyone), everyone


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rows", [3, 3000], ids=["copied", "datatype"])
def test_other_sizes_after_a_kept_call_fail_everywhere_and_the_kept_call_runs(manager, rows):
    """After two calls of a key, rank 1 passes a block of another length with sizes that say
    so (its own check passes, its message is shorter or longer than its peer expects), small
    rows and rows sent from the tensor by a datatype: every rank raises, and the kept call
    then gives the whole field."""
    p, me = manager.domain_world_size, manager.domain_rank
    sizes = [rows] * p
    full = rand((rows * p, 2), 7)
    x = full[rows * me :][:rows].clone()
    for _ in range(2):
        mpidp.all_gather_v(x, sizes, 0, manager)
    problems = []
    for more in (1, -1):
        other = [rows + more if r == 1 else rows for r in range(p)]
        part = rand((rows + more, 2), 8) if me == 1 else x
        try:
            mpidp.all_gather_v(part, other if me == 1 else sizes, 0, manager)
            problems.append(f"{more:+d} row: no error")
        except CommError as err:
            if "different arguments" not in str(err):
                problems.append(f"{more:+d} row: {err}")
        if not torch.equal(mpidp.all_gather_v(x, sizes, 0, manager), full):
            problems.append(f"{more:+d} row: the kept call differs after")
    everyone = manager.transport().all_gather_object(problems)
    assert not any(everyone), everyone


def test_count_traffic_sees_a_kept_call(manager):
    """A call kept before a ``count_traffic`` block is counted inside it (the block's wrapped
    transport serves, not the kept one), and the kept one serves again after it."""
    p = manager.domain_world_size
    x = rand((2, 3), 9)
    for _ in range(2):
        mpidp.all_gather_v(x, [2] * p, 0, manager)
    with count_traffic(manager) as traffic:
        mpidp.all_gather_v(x, [2] * p, 0, manager)
    out = mpidp.all_gather_v(x, [2] * p, 0, manager)
    calls = traffic.ops.get("all_gather_v", [0, 0])[0]
    assert calls == (1 if p > 1 else 0), traffic.ops
    assert torch.equal(out, torch.cat([x] * p))


@pytest.mark.mpi(min_size=2)
def test_the_debug_switch_still_checks_a_kept_call(manager, monkeypatch):
    """``MPIDP_DEBUG=1`` set after a key was kept: the call takes the debug check, whose
    message names it, when rank 1's block disagrees with the sizes."""
    p, me = manager.domain_world_size, manager.domain_rank
    x = rand((2, 3), 11)
    for _ in range(2):
        mpidp.all_gather_v(x, [2] * p, 0, manager)
    monkeypatch.setenv("MPIDP_DEBUG", "1")
    problems = []
    try:
        mpidp.all_gather_v(rand((3, 3), 11) if me == 1 else x, [2] * p, 0, manager)
        problems.append("no error")
    except CommError as err:
        if "debug check" not in str(err):
            problems.append(str(err))
    monkeypatch.setenv("MPIDP_DEBUG", "0")
    if not torch.equal(mpidp.all_gather_v(x, [2] * p, 0, manager), torch.cat([x] * p)):
        problems.append("the kept call differs after")
    everyone = manager.transport().all_gather_object(problems)
    assert not any(everyone), everyone
