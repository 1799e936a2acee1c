"""Drop-in under each project's own set-up, with no mpidp call in between: anemoi's functions
on groups from its own ``dist.new_group`` (torch.distributed initialised by the user, mpidp
never initialised), PhysicsNeMo's ShardTensor recipe under its own ``DistributedManager`` and
mesh (``initialize_mesh``, torch's ``init_device_mesh``, a named axis of a 2-D mesh), against
serial torch in float64, uneven (13 rows over 2-4 ranks): outputs, input gradients and every
parameter gradient, whole on every rank as PhysicsNeMo gives them. A band is never taken as
the whole tensor: without a mesh to take, ``from_local`` is refused on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from test_compat_anemoi import NODES
from test_compat_anemoi import run as anemoi_run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import mpidp
from mpidp.compat.physicsnemo.distributed import DistributedManager
from mpidp.compat.physicsnemo.domain_parallel import ShardTensor, scatter_tensor
from mpidp.errors import ConfigError
from tests.mpi.helpers import own_process_group, rand

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()
TOL = {"rtol": 1e-10, "atol": 1e-12}
H, W = 13, 6


@pytest.fixture
def own_torch():
    """The user's own torch.distributed set-up, as a torchrun script makes it (no mpidp)."""
    with own_process_group():
        yield


def _model_groups():
    """anemoi's model groups: ranks in runs of ``size``, every rank making every group."""
    size = 2 if WORLD == 4 else WORLD
    mine = None
    for first in range(0, WORLD, size):
        g = dist.new_group(list(range(first, first + size)))
        mine = g if first <= ME < first + size else mine
    return mine


@pytest.mark.parametrize("n", NODES)
def test_anemoi_on_its_own_new_group_without_mpidp_init(own_torch, n):
    group = _model_groups()
    names = ["output", "energy", "x.grad", "edge_attr.grad", "w1", "we", "wq", "w2"]
    for name, got, want in zip(names, anemoi_run(n, group), anemoi_run(n, None), strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=name: f"{k}: {m}")
    assert not mpidp.is_initialized()  # nothing was initialised behind the user's back


@pytest.fixture
def pnm():
    """PhysicsNeMo's own set-up: its manager, then its mesh."""
    assert not mpidp.is_initialized()
    DistributedManager.initialize()
    yield DistributedManager()
    DistributedManager.cleanup()


def _mesh(dm, kind):
    if kind == "initialize_mesh":
        return dm.initialize_mesh((-1,), ("spatial",))
    if kind == "init_device_mesh":
        return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("spatial",))
    return dm.initialize_mesh((WORLD // 2, -1), ("ddp", "spatial"))["spatial"]


def _serial():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    head = torch.nn.Linear(W, 2).double()
    return conv, head


def _recipe(x, conv, head, w):
    """PhysicsNeMo's sharded-conv recipe and a head on the gathered field."""
    y = conv(x)
    full = y.full_tensor() if isinstance(y, ShardTensor) else y
    return (y * w).mean() + head(full).pow(2).sum(), full


MESHES = ["initialize_mesh", "init_device_mesh"] + (["axis of a 2-D mesh"] if WORLD == 4 else [])


@pytest.mark.parametrize("rows", [H, 5])  # 5 rows: torch.chunk leaves the last of 4 empty
@pytest.mark.parametrize("kind", MESHES)
def test_physicsnemo_shardtensor_recipe_under_its_own_manager_and_mesh(pnm, kind, rows):
    mesh = _mesh(pnm, kind)
    x, w = rand((1, 3, rows, W), 1), rand((1, 4, rows, W), 2)
    conv, head = _serial()
    xr = x.clone().requires_grad_()
    loss, want = _recipe(xr, conv, head, w)
    loss.backward()
    grads = [p.grad.clone() for p in [*conv.parameters(), *head.parameters()]]

    conv, head = _serial()
    src = int(mesh.mesh.flatten()[0])  # the mesh's first rank holds the sample
    xs = scatter_tensor(x, src, mesh, (Shard(2),), requires_grad=True)
    ws = scatter_tensor(w, src, mesh, (Shard(2),))
    p = mesh.size()
    chunk = -(-rows // p)
    assert xs.to_local().shape[2] == max(0, min(chunk, rows - mesh.get_local_rank() * chunk))
    loss, got = _recipe(xs, conv, head, ws)
    loss.backward()
    torch.testing.assert_close(got, want.detach(), **TOL)
    torch.testing.assert_close(xs.grad.full_tensor(), xr.grad, **TOL)
    for q, g in zip([*conv.parameters(), *head.parameters()], grads, strict=True):
        torch.testing.assert_close(q.grad, g, **TOL)  # whole on every rank, no sync


def test_full_tensor_and_replicate_answer_as_physicsnemo(pnm):
    mesh = _mesh(pnm, "initialize_mesh")
    x = rand((1, 3, H, W), 3)
    xs = scatter_tensor(x, 0, mesh, (Shard(2),), requires_grad=True)
    for whole in (xs.full_tensor(), xs.redistribute(mesh, [Replicate()])):
        assert whole.placements == (Replicate(),)
        assert type(whole.to_local()) is torch.Tensor
        torch.testing.assert_close(whole.to_local(), x, **TOL)
        torch.testing.assert_close(whole.full_tensor(), x, **TOL)
    dt = distribute_tensor(x, mesh, [Shard(2)])  # a DTensor on PhysicsNeMo's mesh
    st = ShardTensor.from_dtensor(dt)
    assert st.to_local().shape == dt.to_local().shape  # torch.chunk's cut, no rows moved
    torch.testing.assert_close(st.full_tensor(), x, **TOL)
    # a plain parameter used after full_tensor(): its whole gradient on every rank
    a = rand((W,), 4).requires_grad_()
    (xs.full_tensor() * a).sum().backward()
    torch.testing.assert_close(a.grad, x.sum(dim=(0, 1, 2)), **TOL)


def test_from_local_takes_the_mesh_physicsnemo_would(pnm):
    x = rand((1, 3, H, W), 5)
    if WORLD > 1:  # no mesh to take: refused on every rank, never this rank's band as whole
        with pytest.raises(ConfigError, match=r"rank \d+: ShardTensor without a device mesh"):
            ShardTensor.from_local(x[:, :, :2], None, [Shard(2)])
    mesh = init_device_mesh("cpu", (WORLD,))
    band = scatter_tensor(x, 0, mesh, (Shard(2),)).to_local()
    with mesh:
        inside = ShardTensor.from_local(band, None, [Shard(2)])
    assert tuple(inside.shape) == (1, 3, H, W)
    torch.testing.assert_close(inside.full_tensor(), x, **TOL)
    held = pnm.initialize_mesh((-1,), ("spatial",))  # now PhysicsNeMo's manager holds one
    taken = ShardTensor.from_local(band, None, [Shard(2)])
    assert tuple(taken.shape) == (1, 3, H, W) and taken.device_mesh.size() == held.size()
