"""PhysicsNeMo's 2-D recipe exactly as its users set it up (issue 46): torch.distributed
initialised by the user (gloo, as PhysicsNeMo's examples do; mpidp never initialised), torch's
own ``init_device_mesh("cpu", (P_lat, P_lon), mesh_dim_names=("lat", "lon"))``, then
``ShardTensor`` from the compat import with placements ``(Shard(2), Shard(3))``.

A conv net (zero and circular padding, GroupNorm, a stride-2 conv, a head on the gathered
field) equals serial torch on the full field in float64 on uneven blocks (H = 13, W = 20):
the output, the input gradient and every parameter gradient, whole on every rank as
PhysicsNeMo gives them (no gradient sync). Blocks come three ways: ``from_local`` of blocks
no policy gives (the cut learned from the ranks' sizes), ``scatter_tensor``, and
``from_dtensor`` of a DTensor on the user's mesh (both torch.chunk's cut). Every grid that
fits the world: 2 x 2, 1 x 4, 4 x 1 at 4 ranks; 2 x 3 at 6. Nothing initialises mpidp behind
the user's back. Checks are asserted after every collective.
"""

from __future__ import annotations

import pytest
import test_compat_pnm_blocks as blocks_test
import torch
from helpers import own_process_group
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import mpidp
from mpidp.compat.physicsnemo.domain_parallel import ShardTensor, scatter_tensor

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
WORLD, ME = COMM.Get_size(), COMM.Get_rank()
ALL_GRIDS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (1, 3), (3, 1), (2, 3)]
GRIDS = [g for g in ALL_GRIDS if g[0] * g[1] == WORLD]
H, W = 13, 20
TOL = 1e-10
# the net, its serial run (a fixture) and the checks of tests/mpi/test_compat_pnm_blocks.py
Net, recipe, rel, uneven = blocks_test.Net, blocks_test.recipe, blocks_test.rel, blocks_test.uneven
serial = blocks_test.serial


@pytest.fixture(scope="module")
def own_torch():
    """The user's own torch.distributed set-up, as PhysicsNeMo's examples make it (no mpidp)."""
    with own_process_group():
        yield


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def mesh(request, own_torch):
    """torch's own 2-D mesh of the recipe."""
    return init_device_mesh("cpu", request.param, mesh_dim_names=("lat", "lon"))


def agreed(failed):
    """Every rank's failed checks (asserted by the caller on every rank alike)."""
    return [f for fs in COMM.allgather(failed) for f in fs]


@pytest.mark.parametrize("made", ["from_local", "scatter_tensor", "from_dtensor"])
def test_conv_net_on_torch_mesh_equals_serial(mesh, serial, made):
    x, w, want, want_dx, want_grads = serial
    net = Net().double()
    if made == "from_local":  # blocks no policy gives, the cut learned from the ranks' sizes
        lat, lon = uneven(H, mesh.size(0)), uneven(W, mesh.size(1))
        i, j = mesh.get_coordinate()
        rows = slice(sum(lat[:i]), sum(lat[: i + 1]))
        cols = slice(sum(lon[:j]), sum(lon[: j + 1]))
        leaf = x[:, :, rows, cols].clone().requires_grad_()
        xs = ShardTensor.from_local(leaf, mesh, (Shard(2), Shard(3)))
    elif made == "scatter_tensor":
        xs = leaf = scatter_tensor(x, 0, mesh, (Shard(2), Shard(3)), requires_grad=True)
    else:  # a DTensor on the user's mesh: torch.chunk's cut, taken as it is
        leaf = distribute_tensor(x, mesh, (Shard(2), Shard(3))).requires_grad_()
        xs = ShardTensor.from_dtensor(leaf)
    loss, got = recipe(xs, net, w)
    loss.backward()
    if made == "from_local":  # the leaf's gradient is this rank's block of the input's
        dx = torch.zeros_like(x)
        dx[:, :, rows, cols] = leaf.grad
        dx = torch.from_numpy(COMM.allreduce(dx.numpy()))
    else:
        dx = leaf.grad.full_tensor()
    failed = [f"rank {ME}: {name} {r:.3g}" for name, r in [
        ("output", rel(got.detach(), want)),
        ("input gradient", rel(dx, want_dx)),
        *[(f"grad {n}", rel(p.grad, g))
          for (n, p), g in zip(net.named_parameters(), want_grads, strict=True)],
    ] if not r <= TOL]  # fmt: skip
    cut = None if xs.grid is None else xs.grid.grid  # None: a band (the mesh (P, 1))
    if cut != tuple(mesh.shape) and (cut is not None or mesh.size(1) > 1):
        failed.append(f"rank {ME}: cut {xs.grid!r} on the mesh {tuple(mesh.shape)}")
    if mpidp.is_initialized():
        failed.append(f"rank {ME}: mpidp was initialised behind the user's back")
    assert agreed(failed) == []
