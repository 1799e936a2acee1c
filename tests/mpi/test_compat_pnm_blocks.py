"""PhysicsNeMo's 2-D domain-parallel recipe through the compat import (issue 46): a ShardTensor
on a 2-D device mesh with placements ``(Shard(2), Shard(3))``, made by PhysicsNeMo's own
set-up (its ``DistributedManager``, then ``initialize_mesh`` or torch's ``init_device_mesh``),
is a grid of latitude x longitude blocks, uneven in both dims (H = 13, W = 20).

A conv net (zero and circular padding, GroupNorm, a stride-2 conv) run on it equals serial
torch on the full field in float64: the output, the input gradient and every parameter
gradient, whole on every rank as PhysicsNeMo gives them (no gradient sync), at every grid
that fits the world (2 x 2, 1 x 4, 4 x 1 at 4 ranks; 2 x 3, 3 x 2 at 6). ``from_local`` with
PhysicsNeMo's ``sharding_shapes``, ``full_tensor`` and ``redistribute`` between the 2-D
placements agree with the field; the domain of a ``(dp, lat, lon)`` mesh is its
``mesh["lat", "lon"]``, and the 3-D mesh itself is refused on every rank. Checks are asserted
after every collective of a test.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GRIDS, WORLD, agreed, grid_id, rand, refusal
from mpi4py import MPI
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import mpidp
from mpidp.compat.physicsnemo.distributed import DistributedManager
from mpidp.compat.physicsnemo.domain_parallel import ShardTensor, scatter_tensor
from mpidp.sharded.layout import chunk_spec

pytestmark = pytest.mark.mpi

H, W = 13, 20  # uneven over every grid above
TOL = 1e-10


@pytest.fixture(scope="module")
def pnm():
    """PhysicsNeMo's own set-up: its manager (mpidp underneath, a domain of one rank)."""
    assert not mpidp.is_initialized()
    DistributedManager.initialize()
    yield DistributedManager()
    DistributedManager.cleanup()


@pytest.fixture(scope="module", params=GRIDS, ids=grid_id)
def mesh(request, pnm):
    """The 2-D mesh of the recipe: PhysicsNeMo's initialize_mesh on the first grid, torch's
    init_device_mesh on the others (both paths taken at 4 and 6 ranks)."""
    if request.param == GRIDS[0]:
        return pnm.initialize_mesh(request.param, ("lat", "lon"))
    return init_device_mesh("cpu", request.param, mesh_dim_names=("lat", "lon"))


class Net(nn.Module):
    """Zero and circular padding, GroupNorm, a stride-2 conv (13 x 20 -> 7 x 10), and a head
    on the gathered field (a parameter used on a value every rank holds)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.zero = nn.Conv2d(2, 4, 3, padding=1)
        self.circ = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.norm = nn.GroupNorm(2, 4)
        self.down = nn.Conv2d(4, 3, 3, stride=2, padding=1)
        self.head = nn.Linear(10, 2)

    def forward(self, x):
        return self.down(torch.tanh(self.norm(self.circ(self.zero(x)))))


def recipe(x, net, w):
    """The sharded forward, a weighted loss on the blocks and one on the gathered field."""
    y = net(x)
    full = y.full_tensor() if isinstance(y, ShardTensor) else y
    return (y * w).mean() + net.head(full).pow(2).sum() / 7, full


@pytest.fixture(scope="module")
def serial():
    """Output, input gradient and parameter gradients of the serial net on the full field."""
    net = Net().double()
    x, w = rand((2, 2, H, W), 1).requires_grad_(), rand((2, 3, 7, 10), 2)
    loss, out = recipe(x, net, w)
    loss.backward()
    return x.detach(), w, out.detach(), x.grad, [p.grad for p in net.parameters()]


def uneven(n, parts):
    """Sizes no policy gives: 13 over 4 is 3, 4, 1, 5; 20 over 3 is 3, 4, 13."""
    sizes = [1 + (5 * r + 2) % 4 for r in range(parts - 1)]
    return [*sizes, n - sum(sizes)]


def rel(a, b):
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def test_conv_net_on_blocks_equals_serial(mesh, serial):
    x, w, want, want_dx, want_grads = serial
    net = Net().double()
    xs = scatter_tensor(x, 0, mesh, (Shard(2), Shard(3)), requires_grad=True)
    loss, got = recipe(xs, net, w)
    loss.backward()
    dx = xs.grad.full_tensor()
    failed = [f"rank {MPI.COMM_WORLD.Get_rank()}: {name} {r:.3g}" for name, r in [
        ("output", rel(got.detach(), want)),
        ("input gradient", rel(dx, want_dx)),
        *[(f"grad {n}", rel(p.grad, g))
          for (n, p), g in zip(net.named_parameters(), want_grads, strict=True)],
    ] if not r <= TOL]  # fmt: skip
    rows, cols = xs.to_local().shape[2:]
    i, j = mesh.get_coordinate()
    chunk_h, chunk_w = -(-H // mesh.size(0)), -(-W // mesh.size(1))
    if (rows, cols) != (min(chunk_h, H - i * chunk_h), min(chunk_w, W - j * chunk_w)):
        failed.append(f"block {(rows, cols)} is not torch.chunk's at {(i, j)}")
    assert agreed(failed) == []


def test_from_local_sizes_full_tensor_and_redistribute(mesh, serial):
    x = serial[0]
    lat, lon = uneven(H, mesh.size(0)), uneven(W, mesh.size(1))
    i, j = mesh.get_coordinate()
    block = x[:, :, sum(lat[:i]) : sum(lat[: i + 1]), sum(lon[:j]) : sum(lon[: j + 1])]
    shapes = {0: [(2, 2, r, lon[j]) for r in lat], 1: [(2, 2, lat[i], c) for c in lon]}
    told = ShardTensor.from_local(block, mesh, (Shard(2), Shard(3)), sharding_shapes=shapes)
    learned = ShardTensor.from_local(block.clone().requires_grad_(), mesh, (Shard(2), Shard(3)))
    ch, cw = chunk_spec(H, mesh.size(0)), chunk_spec(W, mesh.size(1))
    piece = x[:, :, ch.slice(i), cw.slice(j)]  # torch.chunk's block: "chunk" needs no message
    chunked = ShardTensor.from_local(piece, mesh, (Shard(2), Shard(3)), "chunk", x.shape)
    band = learned.redistribute(mesh, (Shard(2), Replicate()))
    strip = learned.redistribute(mesh, (Replicate(), Shard(3)))
    whole = learned.redistribute(mesh, (Replicate(), Replicate()))
    back = band.redistribute(mesh, (Shard(2), Shard(3)))  # the columns cut again, balanced
    up = strip.redistribute(mesh, (Shard(2), Shard(3)))
    sums = [band.full_tensor(), strip.full_tensor(), whole, back.full_tensor(), up.full_tensor()]
    sum(k * s.sum() for k, s in enumerate(sums, 1)).backward()
    failed = [
        name
        for name, ok in [
            ("shape", tuple(told.shape) == tuple(x.shape)),
            ("rows", told.spec.sizes == tuple(lat)),  # a band on the mesh (P, 1)
            ("columns", told.grid is None or told.grid.lon.sizes == tuple(lon)),
            ("told", rel(told.full_tensor(), x) == 0),
            ("learned", rel(learned.full_tensor(), x) == 0),
            ("chunk", rel(chunked.full_tensor(), x) == 0),
            ("band", rel(band.to_local(), x[:, :, sum(lat[:i]) : sum(lat[: i + 1])]) == 0),
            ("strip", rel(strip.to_local(), x[..., sum(lon[:j]) : sum(lon[: j + 1])]) == 0),
            ("whole", rel(whole.to_local(), x) == 0),
            ("back", rel(sums[3], x) == 0 and rel(sums[4], x) == 0),
            ("back cut", back.placements == learned.placements and up.shape == x.shape),
            ("placements", learned.placements in [(Shard(2), Shard(3)), (Shard(2), Replicate())]),
            ("offsets", told.offsets() == [sum(lat[:i]), sum(lon[:j])]),
            ("gradient", rel(learned.to_local().grad, torch.full_like(block, 15.0)) == 0),
        ]
        if not ok
    ]
    assert agreed(failed) == []


@pytest.mark.skipif(WORLD != 4, reason="a (dp 2, lat, lon) mesh at 4 ranks")
def test_domain_of_a_dp_lat_lon_mesh(pnm, serial):
    """Two replicas, each a 1 x 2 grid with its own sample; the 3-D mesh is refused."""
    mesh = pnm.initialize_mesh((2, 1, 2), ("ddp", "lat", "lon"))
    dp = mesh.get_coordinate()[0]
    x = rand((2, 2, H, W), 1 + dp)
    net = Net().double()
    want, _ = recipe(x, net, serial[1])
    domain = mesh["lat", "lon"]
    xs = scatter_tensor(x, int(domain.mesh.flatten()[0]), domain, (Shard(2), Shard(3)))
    got, _ = recipe(xs, net, serial[1])
    three = refusal(lambda: scatter_tensor(x, 0, mesh, (Replicate(), Shard(2), Shard(3))))
    failed = [] if rel(got.detach(), want.detach()) <= TOL else [f"replica {dp} differs"]
    if three is None or "mesh['lat', 'lon']" not in three:
        failed.append(f"3-D mesh: {three}")
    assert agreed(failed) == []


def test_placements_it_cannot_take_are_refused_on_every_rank(mesh, serial):
    x = serial[0]
    told = [
        refusal(lambda p=p: scatter_tensor(x, 0, mesh, p))
        for p in [(Shard(3), Shard(2)), (Shard(2), Shard(2)), (Shard(2),)]
    ]
    failed = [f"not refused: {i}" for i, t in enumerate(told) if t is None or "2-D mesh" not in t]
    assert agreed(failed) == []
