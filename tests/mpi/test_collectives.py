"""Differentiable collectives against torch.split / torch.cat references, through both transports.

Every primitive is checked three ways, at whatever world size the job has (1-4 in CI):
forward against a serial reference built from the full tensor; ``torch.autograd.gradcheck`` in
float64 of the *global* function (see :func:`global_fn`); and the adjoint identity
<F x, y> = <x, F* y> summed over ranks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import adjoint_gap, gradcheck_global, on_transports, rand
from mpi4py import MPI

import mpidp
from mpidp.comm import Transport
from mpidp.runtime.partition import ShardSpec, offsets

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
DIMS = [0, 1, -1, -2]


def size_cases(p):
    cases = {
        "13": ShardSpec.balanced(13, p),
        "721": ShardSpec.balanced(721, p),
        "one_row": ShardSpec.from_sizes([1] * p),
    }
    if p > 1:
        cases["empty_first"] = ShardSpec.from_sizes([0, *range(2, p + 1)])
    return cases


CASES = list(size_cases(WORLD))


def shape_with(total, dim, small=(2, 3, 4)):
    shape = list(small)
    shape[dim] = total
    return tuple(shape)


def band(full, spec, dim, rank=RANK):
    sizes = list(spec)
    return full.narrow(dim, offsets(sizes)[rank], sizes[rank])


def agree(t: Transport, ok: bool, what: str) -> None:
    bad = [r for r, v in enumerate(t.all_gather_object(bool(ok))) if not v]
    assert not bad, f"{what}: wrong on ranks {bad}"


# -- forward against serial references --------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("fn", [mpidp.all_gather_v, mpidp.all_gather_v_replicated])
def test_all_gather_v(t, case, dim, fn):
    spec = size_cases(t.size)[case]
    full = rand(shape_with(spec.total, dim), 1)
    out = fn(band(full, spec, dim), spec, dim, group=t)
    assert torch.equal(out, full)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dim", DIMS)
def test_scatter_v(t, case, dim):
    spec = size_cases(t.size)[case]
    src = t.size - 1
    full = rand(shape_with(spec.total, dim), 2)
    mine = full if t.rank == src else (None if t.rank % 2 else torch.zeros(7))
    out = mpidp.scatter_v(mine, spec, dim, src=src, group=t)
    assert torch.equal(out, band(full, spec, dim, t.rank))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dim", DIMS)
def test_gather_v(t, case, dim):
    spec = size_cases(t.size)[case]
    full = rand(shape_with(spec.total, dim), 3)
    out = mpidp.gather_v(band(full, spec, dim, t.rank), list(spec), dim, dst=0, group=t)
    if t.rank == 0:
        assert torch.equal(out, full)
    else:  # documented: an empty tensor, extent 0 along dim, never None
        assert out.shape == shape_with(0, dim)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_v(t, case, dim, op):
    spec = size_cases(t.size)[case]
    parts = [rand(shape_with(spec.total, dim), 10 + r) for r in range(t.size)]
    want = torch.stack(parts).sum(0) / (t.size if op == "avg" else 1)
    out = mpidp.reduce_scatter_v(parts[t.rank], spec, dim, group=t, op=op)
    torch.testing.assert_close(out, band(want, spec, dim, t.rank), rtol=1e-14, atol=1e-13)


@pytest.mark.parametrize("dims", [(0, 1), (1, 2), (2, 0), (-1, -2), (-2, 0)])
def test_all_to_all_v_transpose(t, dims):
    """Sharded along cat_dim in, sharded along split_dim out, uneven on both."""
    split_dim, cat_dim = dims
    p = t.size
    shape = [2, 3, 4]
    shape[split_dim] = 4 * p + 1
    shape[cat_dim] = 3 * p + 2
    full = rand(tuple(shape), 4)
    split_spec = ShardSpec.balanced(shape[split_dim], p)
    cat_spec = ShardSpec.from_weights(range(1, p + 1), shape[cat_dim])
    x = band(full, cat_spec, cat_dim, t.rank)
    out = mpidp.all_to_all_v(x, split_spec, cat_spec, split_dim, cat_dim, group=t)
    assert torch.equal(out, band(full, split_spec, split_dim, t.rank))


@pytest.mark.parametrize("dim", DIMS)
def test_all_to_all_v_same_dim(t, dim):
    """Rank i sends m[i][j] rows to rank j (zeros included); rows come back in rank order."""
    p = t.size
    m = [[(i * 3 + j * 2) % 4 for j in range(p)] for i in range(p)]
    mine = [rand(shape_with(sum(m[i]), dim), 20 + i) for i in range(p)]
    out = mpidp.all_to_all_v(
        mine[t.rank], m[t.rank], [m[i][t.rank] for i in range(p)], dim, group=t
    )
    want = torch.cat([band(mine[i], m[i], dim, t.rank) for i in range(p)], dim)
    assert torch.equal(out, want)


@pytest.mark.parametrize("given_sizes", [True, False])
def test_indexed_all_to_all_v(t, given_sizes):
    p = t.size
    rows = [3 + i for i in range(p)]
    xs = [rand((rows[i], 2, 3), 30 + i) for i in range(p)]
    gen = torch.Generator().manual_seed(40)
    idx = [[torch.randint(rows[i], ((i + j) % 3 + j,), generator=gen) for j in range(p)]
           for i in range(p)]  # fmt: skip
    sizes = [[len(idx[i][j]) for j in range(p)] for i in range(p)]
    out = mpidp.indexed_all_to_all_v(
        xs[t.rank], idx[t.rank], sizes if given_sizes else None, 0, group=t
    )
    want = torch.cat([xs[i][idx[i][t.rank]] for i in range(p)])
    assert torch.equal(out, want)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_all_reduce(t, op):
    parts = [rand((3, 5), 50 + r) for r in range(t.size)]
    stack = torch.stack(parts)
    want = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0)}[op]
    close = dict(rtol=1e-14, atol=1e-15)  # float64: sums of at most 4 terms, reordered
    torch.testing.assert_close(mpidp.all_reduce(parts[t.rank], op, group=t), want, **close)
    torch.testing.assert_close(mpidp.reduce_from(parts[t.rank], group=t), stack.sum(0), **close)
    assert torch.equal(mpidp.copy_to(parts[t.rank], group=t), parts[t.rank])


def test_max_is_not_differentiable(t):
    with pytest.raises(NotImplementedError, match="not differentiable"):
        mpidp.all_reduce(torch.ones(2, requires_grad=True), "max", group=t)


# -- gradcheck of the global function -----------------------------------------------------------


def tiny(p):
    return {"uneven": ShardSpec.balanced(2 * p + 1, p), "thin": ShardSpec.from_sizes([1] * p)}


@pytest.mark.parametrize(
    ("t", "case", "dim"),
    on_transports([(c, d) for c in ("uneven", "thin") for d in (0, -1)], [("uneven", 0)]),
    indirect=["t"],
)
def test_gradcheck_all_gather_v(t, case, dim):
    spec = tiny(t.size)[case]
    shapes = [shape_with(s, dim, (2, 2)) for s in spec]
    second = case == "uneven" and dim == 0  # one second-order case each (they are slow)
    gradcheck_global(
        t, shapes, lambda x: mpidp.all_gather_v(x, spec, dim, group=t) * 1.5, second=second
    )
    gradcheck_global(
        t,
        shapes,
        lambda x: mpidp.all_gather_v_replicated(x, spec, dim, group=t) ** 2,
        replicated_out=True,
        second=second,
    )


@pytest.mark.parametrize(
    ("t", "case"), on_transports(["uneven", "thin"], ["uneven"]), indirect=["t"]
)
def test_gradcheck_reduce_scatter_v(t, case):
    spec = tiny(t.size)[case]
    shapes = [(2, spec.total)] * t.size
    second = case == "uneven"
    gradcheck_global(
        t, shapes, lambda x: mpidp.reduce_scatter_v(x, spec, -1, group=t), second=second
    )
    gradcheck_global(
        t, shapes, lambda x: mpidp.reduce_scatter_v(x, spec, 1, group=t, op="avg"), second=False
    )


@pytest.mark.parametrize(("t", "case"), on_transports(["uneven", "thin"], ["thin"]), indirect=["t"])
def test_gradcheck_scatter_gather(t, case):
    spec = tiny(t.size)[case]
    src = t.size // 2
    full = [(spec.total, 2)] * t.size  # every rank has a block; only src's is scattered

    def scatter(x):
        # Other ranks pass their block too: ignored, but it keeps every rank's graph the same.
        return mpidp.scatter_v(x, spec, 0, src, t)

    second = case == "uneven"
    gradcheck_global(t, full, scatter, second=second)
    parts = [(s, 2) for s in spec]
    gradcheck_global(
        t, parts, lambda x: mpidp.gather_v(x, spec, 0, dst=src, group=t), second=second
    )


def test_gradcheck_all_to_all_v(t):
    p = t.size
    split, cat = ShardSpec.balanced(p + 2, p), ShardSpec.from_sizes([1] * (p - 1) + [2])
    shapes = [(split.total, c, 2) for c in cat]
    gradcheck_global(t, shapes, lambda x: mpidp.all_to_all_v(x, split, cat, 0, 1, group=t))
    m = [[(i + j) % 3 for j in range(p)] for i in range(p)]
    shapes = [(sum(m[i]), 2) for i in range(p)]
    recv = [m[i][t.rank] for i in range(p)]
    gradcheck_global(
        t, shapes, lambda x: mpidp.all_to_all_v(x, m[t.rank], recv, group=t), second=False
    )


def test_gradcheck_indexed_all_to_all_v(t):
    p = t.size
    idx = [[torch.tensor([(i + j) % 3, 0][: 1 + (i + j) % 2]) for j in range(p)] for i in range(p)]
    shapes = [(3, 2)] * p
    gradcheck_global(t, shapes, lambda x: mpidp.indexed_all_to_all_v(x, idx[t.rank], group=t))


def test_gradcheck_all_reduce_family(t):
    shapes = [(2, 3)] * t.size
    gradcheck_global(t, shapes, lambda x: mpidp.all_reduce(x, "sum", group=t) * (1 + t.rank))
    gradcheck_global(t, shapes, lambda x: mpidp.all_reduce(x, "avg", group=t) ** 2, second=False)
    gradcheck_global(t, shapes, lambda x: mpidp.reduce_from(x, group=t).sin(), replicated_out=True)

    # copy_to takes a replicated input: feed the global input straight in.
    def g(xg):
        y = mpidp.copy_to(xg, group=t) * (1 + t.rank)
        return mpidp.all_gather_v_replicated(y, [xg.numel()] * t.size, 0, group=t)

    xg = rand((3,), 61).requires_grad_()
    assert torch.autograd.gradcheck(g, (xg,))
    if t.name == "mpi":
        seeded = rand((3 * t.size,), 65).requires_grad_()
        assert torch.autograd.gradgradcheck(g, (xg,), (seeded,))


def test_gradcheck_shard_gather_tensor(t, manager):
    spec = tiny(t.size)["uneven"]

    def g(xg):
        x = mpidp.shard_tensor(xg, -2, manager, spec, group=t)
        return mpidp.gather_tensor(x * x, -2, manager, group=t)

    xg = rand((2, spec.total, 3), 62).requires_grad_()
    assert torch.autograd.gradcheck(g, (xg,))
    if t.name == "mpi":  # second order once (slow under gloo); seeded, replicated grad_outputs
        seeded = rand(tuple(xg.shape), 66).requires_grad_()
        assert torch.autograd.gradgradcheck(g, (xg,), (seeded,))


# -- the adjoint identity <F x, y> = <x, F* y>, summed over ranks -------------------------------


@pytest.mark.parametrize("case", CASES)
def test_adjoints(t, case):
    spec = size_cases(t.size)[case]
    n, me, p = spec.total, t.rank, t.size
    src = p - 1

    def leaf(shape, seed):
        return rand(shape, seed + me).requires_grad_()

    gaps = {
        "all_gather_v": adjoint_gap(
            t, lambda x: mpidp.all_gather_v(x, spec, 1, group=t), leaf((2, spec[me]), 80)
        ),
        "all_gather_v_replicated": adjoint_gap(
            t,
            lambda x: mpidp.all_gather_v_replicated(x, spec, 1, group=t),
            leaf((2, spec[me]), 81),
            replicated_out=True,
        ),
        "reduce_scatter_v": adjoint_gap(
            t, lambda x: mpidp.reduce_scatter_v(x, spec, 0, group=t), leaf((n, 2), 82)
        ),
        "scatter_v": adjoint_gap(
            t,
            lambda x: mpidp.scatter_v(x, spec, 0, src, t),
            leaf((n, 3), 83) if me == src else None,
        ),
        "gather_v": adjoint_gap(
            t, lambda x: mpidp.gather_v(x, spec, -1, src, t), leaf((3, spec[me]), 84)
        ),
        "all_to_all_v": adjoint_gap(
            t,
            lambda x: mpidp.all_to_all_v(x, spec, ShardSpec.balanced(p, p), 0, 1, group=t),
            leaf((n, 1, 2), 85),
        ),
        "repartition": adjoint_gap(
            t,
            lambda x: mpidp.repartition(x, spec, _moved(spec), 0, group=t),
            leaf((spec[me], 3), 91),
        ),
        "all_reduce": adjoint_gap(t, lambda x: mpidp.all_reduce(x, group=t), leaf((4,), 86)),
        "reduce_from": adjoint_gap(
            t, lambda x: mpidp.reduce_from(x, group=t), leaf((4,), 87), replicated_out=True
        ),
        "shard_tensor": adjoint_gap(
            t,
            lambda x: mpidp.shard_tensor(x, 0, spec=spec, group=t),
            rand((n, 2), 88).requires_grad_(),  # the same on every rank
            replicated_in=True,
        ),
        "copy_to": adjoint_gap(
            t,
            lambda x: mpidp.copy_to(x, group=t),
            rand((3,), 89).requires_grad_(),
            replicated_in=True,
        ),
    }
    bad = {k: v for k, v in gaps.items() if v > 1e-12}
    assert not bad, f"adjoint identity violated: {bad}"


# -- repartition ------------------------------------------------------------------------------


def _moved(spec: ShardSpec) -> ShardSpec:
    """Another cut of the same length: the reversed sizes, or every row on the last rank."""
    rev = ShardSpec.from_sizes(list(spec)[::-1])
    if rev != spec:
        return rev
    return ShardSpec.from_sizes([0] * (spec.parts - 1) + [spec.total])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dim", [0, -1])
def test_repartition(t, case, dim):
    """Rows move to another cut: the result is the new cut's band of the same global tensor; the
    traffic is only the rows that change owner."""
    spec = size_cases(t.size)[case]
    new = _moved(spec)
    full = rand(shape_with(spec.total, dim), 92)
    out = mpidp.repartition(band(full, spec, dim), spec, new, dim, group=t)
    assert torch.equal(out, band(full, new, dim))
    # and back, through the backward: the gradient of the moved rows lands on their old owner
    x = band(full, spec, dim).clone().requires_grad_()
    mpidp.repartition(x, spec, new, dim, group=t).mul(band(full, new, dim)).sum().backward()
    assert torch.equal(x.grad, band(full, spec, dim))


def test_repartition_moves_only_the_rows_that_change_owner(manager):
    from mpidp.testing import count_traffic

    p, me = manager.domain_world_size, manager.domain_rank
    old = ShardSpec.balanced(4 * p + 1, p)  # 5, 4, 4, ...: the extra row moves one rank down
    new = ShardSpec.from_sizes([4] * (p - 1) + [5]) if p > 1 else old
    x = torch.zeros(old[me], 3, dtype=torch.float64)
    with count_traffic(manager) as traffic:
        mpidp.repartition(x, old, new, 0, group=manager)
    calls, nbytes = traffic.ops.get("all_to_all_v", [0, 0])
    moved = sum(hi - lo for r, lo, hi in new.overlaps(old.start(me), old.stop(me)) if r != me)
    assert moved == (1 if 0 < me < p - 1 or (me == 0 and p > 1) else 0)  # one row per boundary
    assert (calls, nbytes) == ((1, moved * 3 * 8) if p > 1 else (0, 0))
    with pytest.raises(mpidp.CommError, match="both must cut one length"):
        mpidp.repartition(x, old, ShardSpec.balanced(old.total + 1, p), 0, group=manager)


def test_gradcheck_repartition(t):
    spec = tiny(t.size)["uneven"]
    gradcheck_global(
        t,
        [(s, 2) for s in spec],
        lambda x: mpidp.repartition(x, spec, _moved(spec), 0, group=t),
        second=True,
    )


# -- dtypes, layouts, defaults ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision(t, dtype):
    spec = ShardSpec.balanced(13, t.size)
    full = rand((2, 13, 3), 90, dtype)
    assert torch.equal(mpidp.all_gather_v(band(full, spec, 1), spec, 1, group=t), full)
    assert torch.equal(mpidp.scatter_v(full, spec, 1, 0, t), band(full, spec, 1))
    # bfloat16 sums accumulate in float32: 256 + 1 + ... is exact there, not in bfloat16.
    parts = [torch.full((13, 2), 256.0 if r == 0 else 1.0, dtype=dtype) for r in range(t.size)]
    want = torch.stack([p.float() for p in parts]).sum(0).to(dtype)
    got = mpidp.reduce_scatter_v(parts[t.rank], spec, 0, group=t)
    assert torch.equal(got, band(want, spec, 0))
    assert torch.equal(mpidp.all_reduce(parts[t.rank], group=t), want)


def test_non_contiguous(t):
    spec = ShardSpec.balanced(13, t.size)
    full = rand((13, 5, 4), 91)
    local = band(full, spec, 0).transpose(0, 2)  # (4, 5, rows), not contiguous
    assert not local.is_contiguous() or spec[t.rank] <= 1
    out = mpidp.all_gather_v(local, spec, -1, group=t)
    assert torch.equal(out, full.transpose(0, 2))
    half = full[:, ::2]  # strided view
    assert torch.equal(mpidp.scatter_v(half, spec, 0, 0, t), band(half, spec, 0))
    split = ShardSpec.balanced(4, t.size, allow_empty=True)
    out = mpidp.all_to_all_v(local, split, spec, 0, 2, group=t)
    assert torch.equal(out, band(full.transpose(0, 2), split, 0))


def test_default_group_and_manager(manager):
    """group=None and the manager itself pick the manager's transport (MPI here, for CPU)."""
    spec = manager.spec(721)
    assert spec == ShardSpec.balanced(721, WORLD)
    full = rand((1, 2, 721, 4), 92)
    x = mpidp.shard_tensor(full, manager=manager)
    assert torch.equal(x, band(full, spec, -2, manager.domain_rank))
    assert torch.equal(mpidp.gather_tensor(x, manager=manager), full)
    assert torch.equal(mpidp.all_gather_v(x, spec, -2, group=manager), full)


def test_shard_batch(manager):
    batch = {
        "x": rand((2, 3, 13, 8), 93),
        "y": rand((2, 3, 4, 13, 8), 94),
        "lat": rand((13,), 95),
        "meta": "kept",
        "pair": (rand((1, 1, 13, 2), 96), 7),
    }
    out = mpidp.shard_batch(batch, manager=manager)
    spec = ShardSpec.balanced(13, WORLD)
    me = manager.domain_rank
    assert torch.equal(out["x"], band(batch["x"], spec, -2, me))
    assert torch.equal(out["y"], band(batch["y"], spec, -2, me))
    assert out["lat"] is batch["lat"] and out["meta"] == "kept" and out["pair"][1] == 7
    assert torch.equal(out["pair"][0], band(batch["pair"][0], spec, -2, me))


def test_weighted_policy_shard_and_gather_grad():
    """A weighted partition through the manager; gradients of shard -> gather are exact."""
    weights = tuple(range(1, WORLD + 1))
    with mpidp.DistributedManager(WORLD, partition=mpidp.Weighted(weights)) as m:
        spec = m.spec(29)
        assert spec == ShardSpec.from_weights(weights, 29)
        full = rand((2, 29, 3), 97).requires_grad_()
        x = mpidp.shard_tensor(full, -2, m)
        assert x.shape[-2] == spec[m.domain_rank]
        y = mpidp.gather_tensor(x**2, -2, m)
        y.sum().backward()
        torch.testing.assert_close(full.grad, 2 * full.detach(), rtol=0, atol=0)


# -- debug check ----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_debug_mismatched_sizes(t):
    spec = list(ShardSpec.balanced(13, t.size))
    mine = list(spec)
    if t.rank == 1:
        mine[0], mine[1] = mine[0] + 1, mine[1] - 1  # rank 1 believes in another partition
    x = torch.zeros(2, spec[t.rank])
    with pytest.raises(mpidp.CommError, match="debug check") as err:
        mpidp.all_gather_v(x, mine, 1, group=t, debug=True)
    text = str(err.value)
    assert f"rank {t.rank}:" in text and "rank 1: sizes=" in text and "rank 0 passed" in text


@pytest.mark.mpi(min_size=2)
def test_debug_wrong_local_extent_on_one_rank(t, monkeypatch):
    """One rank's tensor does not match its size: every rank raises, through MPIDP_DEBUG."""
    monkeypatch.setenv("MPIDP_DEBUG", "1")
    spec = ShardSpec.balanced(13, t.size)
    last = t.size - 1
    rows = spec[t.rank] + (1 if t.rank == last else 0)
    with pytest.raises(mpidp.CommError, match=rf"rank {last}: shape \(2, {spec[last] + 1}\)"):
        mpidp.gather_v(torch.zeros(2, rows), spec, 1, group=t)
    with pytest.raises(mpidp.CommError, match="debug check"):
        full = torch.zeros(spec.total + (1 if t.rank == 0 else 0), 2)
        mpidp.scatter_v(full if t.rank == 0 else None, spec, 0, 0, t)
    # The group is still usable afterwards: nothing was left half-sent.
    assert torch.equal(mpidp.all_reduce(torch.ones(1), group=t), torch.full((1,), t.size * 1.0))


@pytest.mark.mpi(min_size=2)
def test_debug_all_to_all_counts_must_pair_up(t):
    send = [1] * t.size
    recv = [1] * t.size
    if t.rank == 0:
        recv[1] = 2  # rank 1 sends rank 0 one row, rank 0 waits for two
    with pytest.raises(mpidp.CommError, match="rank 1: sends 1 rows to rank 0, which expects 2"):
        mpidp.all_to_all_v(torch.zeros(t.size, 2), send, recv, group=t, debug=True)
