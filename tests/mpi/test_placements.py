"""ShardedTensor in DTensor's vocabulary (mpidp/sharded/placements.py, tensor.py):
``from_local`` with placements and ShardTensor's ``sharding_shapes``, ``to_local``,
``placements``, ``device_mesh``, ``offsets``, ``redistribute`` to placements, ``full_tensor``,
``mpidp.scatter_tensor``, handlers registered by operator overload and by a custom op's name,
and PhysicsNeMo's ``ShardTensor`` names over them -- against serial torch, float64, uneven
(11 rows over 2-4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.distributed.tensor import Partial, Replicate, Shard

import mpidp
from mpidp.compat.physicsnemo.domain_parallel import ShardTensor
from mpidp.compat.physicsnemo.domain_parallel import scatter_tensor as pnm_scatter
from mpidp.errors import ConfigError
from mpidp.sharded import Replicated, ShardedTensor, UnsupportedOp, dispatch, register, shard
from tests.mpi.helpers import rand

WORLD = MPI.COMM_WORLD.Get_size()
TOL = {"rtol": 1e-10, "atol": 1e-12}
H, W = 11, 6


@pytest.fixture(scope="module")
def m():
    with mpidp.init(domain_parallel_size=WORLD) as manager:  # the default: meshes name it
        yield manager


@pytest.fixture
def own_handlers():
    """Handlers a test registers are gone after it (the registry is global; the silent-hunt
    test checks every registered function)."""
    saved = dict(dispatch._HANDLERS)
    yield
    dispatch._HANDLERS.clear()
    dispatch._HANDLERS.update(saved)


def band_of(full, m, dim=2):
    return shard(full, dim, m).local


@pytest.mark.parametrize("shapes", ["infer", "dict", "chunk"])
def test_from_local_with_placements_is_the_band_and_runs_exact(m, shapes):
    full = rand((1, 2, H, W), 1)
    weight = rand((3, 2, 3, 3), 2).requires_grad_()
    spec = m.spec(H) if shapes != "chunk" else mpidp.sharded.tensor.chunk_spec(H, WORLD)
    r = m.domain_rank
    band = full[:, :, spec.start(r) : spec.start(r) + spec.sizes[r]].clone().requires_grad_()
    kwargs = {}
    if shapes == "dict":
        kwargs = {"sharding_shapes": {0: [(1, 2, n, W) for n in spec.sizes]}}
    elif shapes == "chunk":
        kwargs = {"sharding_shapes": "chunk", "global_shape": (1, 2, H, W)}
    x = ShardedTensor.from_local(band, m.mesh["domain"], [Shard(2)], **kwargs)
    assert x.placements == (Shard(2),) and x.device_mesh == m.mesh["domain"]
    assert x.offsets() == [spec.start(r)] and x.offsets(0) == spec.start(r)
    assert x.spec == spec and x.to_local() is band
    y = F.conv2d(x, weight, padding=1).full_tensor()
    xr = full.clone().requires_grad_()
    yr = F.conv2d(xr, weight, padding=1)
    torch.testing.assert_close(y.as_subclass(torch.Tensor), yr.detach(), **TOL)
    (y * y).sum().backward()
    want = torch.autograd.grad((yr * yr).sum(), xr)[0]
    torch.testing.assert_close(
        band.grad, want[:, :, spec.start(r) : spec.start(r) + spec.sizes[r]], **TOL
    )


def test_chunk_without_global_shape_checks_the_cut(m):
    spec = m.spec(H)
    band = torch.zeros(1, spec.sizes[m.domain_rank], W)
    if spec == mpidp.sharded.tensor.chunk_spec(H, WORLD):
        assert ShardedTensor.from_local(band, None, [Shard(1)], "chunk").spec == spec
    else:
        with pytest.raises(ConfigError, match=r"torch\.chunk"):
            ShardedTensor.from_local(band, None, [Shard(1)], "chunk")


def test_replicate_and_partial_placements(m):
    full = rand((2, H), 3)
    x = ShardedTensor.from_local(full, placements=[Replicate()])
    assert isinstance(x, Replicated)
    torch.testing.assert_close(x.as_subclass(torch.Tensor), full)
    # each rank holds an uneven share of the value: Partial sums them
    share = (full * (m.domain_rank + 1) / (WORLD * (WORLD + 1) / 2)).requires_grad_()
    value = ShardedTensor.from_local(share, placements=[Partial()])
    assert isinstance(value, Replicated)
    torch.testing.assert_close(value.as_subclass(torch.Tensor), full, **TOL)
    (value * full).sum().backward()  # the gradient of the value reaches every summand
    torch.testing.assert_close(share.grad, full, **TOL)
    with pytest.raises(ConfigError, match="one placement"):
        ShardedTensor.from_local(full, placements=[Shard(0), Shard(1)])
    with pytest.raises(ConfigError, match="dim="):
        ShardedTensor.from_local(full, 1)


def test_redistribute_to_placements(m):
    full = rand((1, 2, H, W + 1), 4)
    x = shard(full, 2, m)
    y = x.redistribute(placements=[Shard(3)])
    assert y.shard_dim == 3 and y.spec == m.spec(W + 1)
    torch.testing.assert_close(y.local, band_of(full, m, 3))
    z = x.redistribute(x.device_mesh, [Replicate()])
    torch.testing.assert_close(z.as_subclass(torch.Tensor), full)
    with pytest.raises(ConfigError, match="Partial"):
        x.redistribute(placements=[Partial()])


@pytest.mark.parametrize("src", [0, WORLD - 1])
def test_scatter_tensor_from_one_rank(m, src):
    full = rand((1, 2, H, W), 5)
    mine = full if m.rank == src else None
    x = mpidp.scatter_tensor(mine, src, m.mesh["domain"], [Shard(2)], requires_grad=True)
    assert isinstance(x, ShardedTensor) and x.local.is_leaf and x.local.requires_grad
    torch.testing.assert_close(x.local, band_of(full, m))
    y = pnm_scatter(mine, src, None, (Replicate(),), global_shape=(1, 2, H, W), dtype=torch.float64)
    torch.testing.assert_close(y.as_subclass(torch.Tensor), full)
    with pytest.raises(ConfigError, match="not in this domain group"):
        mpidp.scatter_tensor(mine, WORLD, None, [Shard(2)])


@torch.library.custom_op("mpidp_test::rowsum", mutates_args=())
def rowsum(x: torch.Tensor) -> torch.Tensor:
    """A custom op that sums each row over W: local on a band along H."""
    return x.sum(-1)


@rowsum.register_fake
def _(x):
    return x.new_empty(x.shape[:-1])


def test_handlers_by_operator_and_by_custom_op_name(m, own_handlers):
    full = rand((1, 2, H, W), 6)
    x = shard(full, 2, m)
    with pytest.raises(UnsupportedOp):  # the mutation: no handler, no silent local run
        rowsum(x)
    calls = []

    def local(f, args, kwargs):
        calls.append(f)
        return args[0].like(f(args[0].local))

    register("mpidp_test::rowsum")(local)
    torch.testing.assert_close(rowsum(x).full_tensor().as_subclass(torch.Tensor), full.sum(-1))
    assert calls
    ShardTensor.register_dispatch_handler(
        torch.ops.mpidp_test.rowsum.default, lambda t: t.like(rowsum(t.local) * 2)
    )
    got = rowsum(x).full_tensor().as_subclass(torch.Tensor)
    torch.testing.assert_close(got, 2 * full.sum(-1))


def test_shard_tensor_names(m, own_handlers):
    full = rand((2, 3), 7)
    assert isinstance(ShardTensor.from_local(full), Replicated)  # ShardTensor's default
    x = ShardTensor.from_local(band_of(rand((1, 2, H, W), 8), m), None, [Shard(2)])
    assert isinstance(x, ShardTensor) and ShardTensor.patches_enabled()
    seen = []
    ShardTensor.register_function_handler(
        torch.special.erfcx, lambda f, types, args, kwargs: seen.append(types) or args[0]
    )
    assert torch.special.erfcx(x) is x and seen == [(ShardedTensor,)]


def test_an_aten_handler_runs_for_every_public_form(m, own_handlers):
    """PhysicsNeMo's handler by operator overload sees torch.sigmoid(x) too (its dispatch is
    below the public function); so does mpidp's: every public form of the op, not only a
    direct aten call."""
    x = shard(rand((1, 2, H, W), 9), 2, m)
    calls = []

    def doubled(t):
        calls.append(1)
        return t.like(torch.sigmoid(t.local) * 2)

    ShardTensor.register_dispatch_handler(torch.ops.aten.sigmoid.default, doubled)
    for form in (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, torch.ops.aten.sigmoid.default):
        torch.testing.assert_close(form(x).local, 2 * torch.sigmoid(x.local))
    assert len(calls) == 4
