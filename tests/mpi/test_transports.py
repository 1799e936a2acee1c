"""Both transports against torch.split / torch.cat references, uneven and empty shards included.

Every case runs through the MPI transport and the torch.distributed (gloo) transport, over the
domain group (all ranks) and over a data-parallel group of two ranks or more (every rank at 2
and 3 ranks; two groups of two, numbered unlike the world, at 4 ranks).
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.errors import CommError
from mpidp.runtime.partition import balanced_sizes, offsets

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="module")
def managers():
    """Manager 'domain': the domain group is the world. Manager 'dp': a data-parallel group of
    more than one rank that is not numbered like the world where the world allows (dp 2 x
    domain 2 at 4 ranks, dp = world at 2 and 3 ranks)."""
    dp_domain = 2 if WORLD % 2 == 0 and WORLD > 2 else 1
    with mpidp.DistributedManager(domain_parallel_size=WORLD, transport="auto") as d:
        with mpidp.DistributedManager(domain_parallel_size=dp_domain, transport="auto") as dp:
            yield {"domain": d, "dp": dp}


@pytest.fixture(params=["mpi", "torch"])
def kind(request):
    return request.param


# At one rank the dp group would be the same one-rank group as the domain group: not run twice.
@pytest.fixture(params=["domain", "dp"] if WORLD > 1 else ["domain"])
def transport(request, managers, kind):
    m = managers[request.param]
    if kind == "torch":
        from mpidp.comm import TorchTransport

        group = m.domain_group if request.param == "domain" else m.data_parallel_group
        t = TorchTransport(group)
    else:
        from mpidp.comm.mpi import MPITransport

        t = MPITransport(m.domain_comm if request.param == "domain" else m.dp_comm)
    assert t.size == (WORLD if request.param == "domain" else m.dp_world_size)
    assert WORLD == 1 or t.size > 1
    return t


def global_tensor(shape, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
    if dtype == torch.bool:
        return t > 0
    return t.to(dtype)


# Named partitions for p ranks: balanced 13 and 721 rows, one row each, an empty first rank
# (which needs two ranks or more, so it is not collected at one rank: no duplicate cases).
CASES = ["balanced13", "balanced721", "one_row"] + (["empty_first"] if WORLD > 1 else [])


def size_cases(p):
    """{name: sizes} for p ranks."""
    cases = {
        "balanced13": balanced_sizes(13, p),
        "balanced721": balanced_sizes(721, p),
        "one_row": (1,) * p,
    }
    if p > 1:
        cases["empty_first"] = (0, *tuple(range(2, p + 1)))
    return cases


def local_part(full, sizes, dim, rank):
    return full.narrow(dim, offsets(sizes)[rank], sizes[rank])


DIMS = [0, 1, -1, -2]


def shape_for(total, dim):
    shape = [2, 3, 4]
    shape[dim] = total
    return tuple(shape)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("case", CASES)
def test_all_gather_v(transport, dim, case):
    name, sizes = case, size_cases(transport.size)[case]
    full = global_tensor(shape_for(sum(sizes), dim))
    out = transport.all_gather_v(local_part(full, sizes, dim, transport.rank), sizes, dim)
    assert torch.equal(out, full), name


def test_a_repeated_all_gather_v_is_still_checked(transport):
    """The MPI transport keeps the validated facts of an all_gather_v it has seen (same sizes,
    shape and dtype): the repeat returns the same rows (into a new tensor), and a later call
    whose ranks disagree (rank 0 counts one row more for itself than the others think) still
    raises on every rank, naming every rank's sizes."""
    p, r = transport.size, transport.rank
    sizes = [2 + i % 2 for i in range(p)]
    full = global_tensor((sum(sizes), 3))
    mine = local_part(full, sizes, 0, r)
    first = transport.all_gather_v(mine, sizes)
    again = transport.all_gather_v(mine, sizes)
    assert torch.equal(first, full) and torch.equal(again, full)
    if p == 1:  # one rank: the input itself, detached
        return
    assert again.data_ptr() != first.data_ptr()
    wrong = list(sizes)
    if r == 0:
        wrong[0] += 1
    part = torch.zeros(wrong[r], 3, dtype=torch.float64)
    with pytest.raises(CommError, match=r"different arguments.*rank 0: .*rank 1: "):
        transport.all_gather_v(part, wrong)
    assert torch.equal(transport.all_gather_v(mine, sizes), full)  # the group still works


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("case", CASES)
def test_gather_v_to_last_rank(transport, dim, case):
    name, sizes = case, size_cases(transport.size)[case]
    full = global_tensor(shape_for(sum(sizes), dim))
    dst = transport.size - 1
    out = transport.gather_v(local_part(full, sizes, dim, transport.rank), sizes, dim, dst=dst)
    if transport.rank == dst:
        assert torch.equal(out, full), name
    else:
        assert out is None


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("case", CASES)
def test_scatter_v_from_last_rank_others_pass_none(transport, dim, case):
    name, sizes = case, size_cases(transport.size)[case]
    full = global_tensor(shape_for(sum(sizes), dim))
    src = transport.size - 1
    out = transport.scatter_v(full if transport.rank == src else None, sizes, dim, src=src)
    assert torch.equal(out, local_part(full, sizes, dim, transport.rank)), name


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex128],
)
def test_dtypes_move_exactly(transport, dtype):
    sizes = balanced_sizes(7, transport.size, allow_empty=True)
    full = global_tensor((sum(sizes), 5), dtype)
    out = transport.all_gather_v(local_part(full, sizes, 0, transport.rank), sizes, 0)
    assert out.dtype == dtype and torch.equal(out, full)


def test_non_contiguous_input(transport):
    sizes = balanced_sizes(11, transport.size)
    full = global_tensor((6, sum(sizes)))
    mine = local_part(full, sizes, 1, transport.rank).t()  # non-contiguous, split dim is 0
    assert not mine.is_contiguous() or mine.size(1) == 1
    out = transport.all_gather_v(mine, sizes, 0)
    assert torch.equal(out, full.t())


def chunk(src, dst, rows, cols=3):
    """The block rank src sends to rank dst: recognisable values."""
    base = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)
    return base + 1000 * src + 100 * dst


def a2a_rows(src, dst):
    return (src + 2 * dst) % 3  # uneven, zeros included


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_to_all_v(transport, dim):
    p, me = transport.size, transport.rank
    send_sizes = [a2a_rows(me, j) for j in range(p)]
    recv_sizes = [a2a_rows(i, me) for i in range(p)]
    send = torch.cat([chunk(me, j, send_sizes[j]) for j in range(p)], 0)
    want = torch.cat([chunk(i, me, recv_sizes[i]) for i in range(p)], 0)
    if dim == 1:  # put the split rows on another axis
        send, want = send.unsqueeze(0), want.unsqueeze(0)
    elif dim == -1:
        send, want = send.t().unsqueeze(0), want.t().unsqueeze(0)
    out = transport.all_to_all_v(send, send_sizes, recv_sizes, dim=dim)
    assert torch.equal(out, want)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
def test_all_reduce(transport, op):
    p, me = transport.size, transport.rank
    contributions = [global_tensor((4, 3), seed=r) for r in range(p)]
    stacked = torch.stack(contributions)
    want = {
        "sum": stacked.sum(0),
        "avg": stacked.mean(0),
        "max": stacked.amax(0),
        "min": stacked.amin(0),
        "prod": stacked.prod(0),
    }[op]
    mine = contributions[me].clone()
    out = transport.all_reduce(mine, op)
    torch.testing.assert_close(out, want, rtol=1e-13, atol=1e-12)
    assert torch.equal(mine, contributions[me]), "input must be untouched"


def test_all_reduce_low_precision_accumulates_in_float32(transport):
    # 1 + 2**-9 per rank: a bfloat16 running sum would lose the small part, float32 keeps it.
    p = transport.size
    x = torch.full((8,), 1 + 2**-9, dtype=torch.float32)
    out = transport.all_reduce(x.to(torch.bfloat16), "sum")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (x * p).to(torch.bfloat16))


def test_all_reduce_avg_of_integers_is_refused(transport):
    with pytest.raises(CommError, match=r"avg of a torch\.int64 tensor"):
        transport.all_reduce(torch.ones(3, dtype=torch.int64), "avg")


def test_broadcast_from_last_rank(transport):
    src = transport.size - 1
    want = global_tensor((5, 2), seed=42)
    mine = want if transport.rank == src else torch.zeros_like(want)
    assert torch.equal(transport.broadcast(mine, src), want)


def test_exchange_ring_both_directions(transport):
    """Each rank sends one block to each neighbour on a ring; with 2 ranks both neighbours are
    the same peer (two messages to one rank), with 1 rank both are itself."""
    p, me = transport.size, transport.rank
    nxt, prv = (me + 1) % p, (me - 1) % p
    up, down = chunk(me, nxt, 2), chunk(me, prv, 3)
    from_prv, from_nxt = (
        torch.empty(2, 3, dtype=torch.float64),
        torch.empty(3, 3, dtype=torch.float64),
    )
    transport.exchange([(nxt, up), (prv, down)], [(prv, from_prv), (nxt, from_nxt)])
    assert torch.equal(from_prv, chunk(prv, me, 2))
    assert torch.equal(from_nxt, chunk(nxt, me, 3))


def test_exchange_into_non_contiguous_buffer(transport):
    p, me = transport.size, transport.rank
    nxt, prv = (me + 1) % p, (me - 1) % p
    storage = torch.zeros(4, 2, dtype=torch.float64)
    target = storage.t()  # (2, 4), non-contiguous
    assert not target.is_contiguous()
    send = torch.arange(8, dtype=torch.float64).reshape(2, 4) + 10 * me
    transport.exchange([(nxt, send)], [(prv, target)])
    assert torch.equal(storage.t(), torch.arange(8, dtype=torch.float64).reshape(2, 4) + 10 * prv)


def test_exchange_through_host_copies(manager):
    """gloo's point-to-point reads a buffer's address on the host, so a gloo group moving GPU
    tensors stages them through host copies (scripts/test-gpu.sh runs it on CUDA); here the
    staging is forced on CPU tensors: fresh receive buffers copied back, non-contiguous ones
    too, and send copies kept alive until the wait."""
    from mpidp.comm import TorchTransport

    t = TorchTransport(manager.domain_group)
    t._host_p2p = True
    p, me = t.size, t.rank
    nxt, prv = (me + 1) % p, (me - 1) % p
    storage = torch.zeros(4, 3, dtype=torch.float64)
    from_prv = storage.t()  # (3, 4), non-contiguous
    from_nxt = torch.empty(3, 3, dtype=torch.float64)
    up = chunk(me, nxt, 4).t()  # non-contiguous send
    t.exchange([(nxt, up), (prv, chunk(me, prv, 3))], [(prv, from_prv), (nxt, from_nxt)])
    assert torch.equal(storage.t(), chunk(prv, me, 4).t())
    assert torch.equal(from_nxt, chunk(nxt, me, 3))


def test_objects(transport):
    assert transport.all_gather_object({"r": transport.rank}) == [
        {"r": r} for r in range(transport.size)
    ]
    assert transport.broadcast_object(("x", transport.rank), src=transport.size - 1) == (
        "x",
        transport.size - 1,
    )
    transport.barrier()


def test_argument_errors_are_the_same_on_every_rank(transport):
    p = transport.size
    x = torch.zeros(2, 3)
    with pytest.raises(CommError, match=rf"expecting {p} sizes, one per rank, got {p + 1}"):
        transport.all_gather_v(x, [2] * (p + 1))
    with pytest.raises(CommError, match=r"dim 3 is out of range for a 2-d tensor"):
        transport.all_gather_v(x, [2] * p, dim=3)
    with pytest.raises(
        CommError,
        match=rf"rank {transport.rank} of {p}: tensor of shape \(2, 3\) "
        r"has 2 entries along dim 0 but sizes\[\d+\] = 5",
    ):
        transport.all_gather_v(x, [5] * p)
    with pytest.raises(CommError, match="negative entry"):
        transport.gather_v(x, [-1] * p)
    with pytest.raises(CommError, match=rf"dst {p} is not a rank of this group"):
        transport.gather_v(x, [2] * p, dst=p)
    with pytest.raises(CommError, match="unknown reduction 'median'"):
        transport.all_reduce(x, "median")


def test_dp_group_over_world(kind):
    """dp x domain = world x 1: the dp group spans every rank."""
    with mpidp.DistributedManager(domain_parallel_size=1, transport=kind) as m:
        t = m.transport(m.data_parallel_group)
        assert (t.name, t.size, t.rank) == (kind, WORLD, MPI.COMM_WORLD.Get_rank())
        sizes = balanced_sizes(9, WORLD)
        full = global_tensor((sum(sizes), 2))
        assert torch.equal(t.all_gather_v(local_part(full, sizes, 0, t.rank), sizes, 0), full)
        assert m.transport().size == 1  # the domain group of one rank
