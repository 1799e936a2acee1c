"""Silent holes found in the last session (issues 46 / 47), each against serial torch in float64
at every rank count (uneven: H = 13, W = 19):

* the user's own 1-D device mesh or ``dist.new_group`` group is bands, also where a manager of
  blocks over the same ranks exists: a PhysicsNeMo ShardTensor convolution on the mesh and a
  CREDIT ``apply_domain_parallel`` convolution on the group equal serial (first in the file:
  the user's own torch.distributed set-up, before any manager of this module);
* the plain (unconverted) :class:`mpidp.models.SpectralConv2d` on ShardedTensors, bands and
  blocks: forward, input gradient, every parameter gradient;
* ``mpidp.ops.fft.rfft2`` / ``irfft2`` given a band on a manager of blocks: a ConfigError on
  every rank naming what was given and the fix (never a TypeError or a hang), and the band
  transform over the domain group when the group is named;
* a pad wider than the field on empty and one-row bands.

Checks are asserted only after every collective of a test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import own_process_group, rand, refusal
from mpi4py import MPI
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import mpidp
from mpidp.models import SpectralConv2d
from mpidp.ops import fft as mfft
from mpidp.runtime.adopt import manager_for
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import ShardedTensor, shard

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()
H, W = 13, 19
TOL = {"rtol": 1e-10, "atol": 1e-12}


def close(a, b):
    return tuple(a.shape) == tuple(b.shape) and bool(torch.allclose(a, b, **TOL))


def same_grads(model, serial):
    pairs = zip(model.parameters(), serial.parameters(), strict=True)
    return [close(p.grad, q.grad) for p, q in pairs]


# -- a 1-D mesh or group of the user's is bands --------------------------------------------------


@pytest.fixture
def own_then_blocks():
    """The user's own torch.distributed (gloo, no mpidp.init first), then a manager of blocks
    over the same ranks, the grid (1, P): what a 1-D mesh or group must not be taken for."""
    assert not dist.is_initialized()
    with own_process_group(), mpidp.init(domain_parallel_size=(1, WORLD)) as m:
        yield m


def _conv():
    torch.manual_seed(0)
    return nn.Conv2d(3, 4, 3, padding=1).double()


@pytest.mark.mpi(min_size=2)  # one rank: the grid (1, 1) is bands
def test_a_1d_mesh_and_group_of_the_users_are_bands_beside_blocks(own_then_blocks):
    from mpidp.compat.physicsnemo.domain_parallel import scatter_tensor
    from mpidp.parallel import apply_domain_parallel, build_device_mesh

    m = own_then_blocks
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("spatial",))
    group = dist.new_group(list(range(WORLD)))
    grids = [manager_for(mesh).grid, manager_for(group).grid]
    built = build_device_mesh({"data": "none", "tensor": 1, "domain": (1, WORLD)})["domain"]
    own = [manager_for(x) is m for x in (m.domain_group, m.domain_mesh, built)]

    x, w = rand((1, 3, H, W), 1), rand((1, 4, H, W), 2)
    xr = x.clone().requires_grad_()
    serial = _conv()
    want = serial(xr)
    (want * w).sum().backward()

    # PhysicsNeMo: a ShardTensor on the user's mesh (its cut: torch.chunk's)
    conv = _conv()
    xs = scatter_tensor(x, 0, mesh, (Shard(2),), requires_grad=True)
    ws = scatter_tensor(w, 0, mesh, (Shard(2),))
    y = conv(xs)
    got = y.full_tensor()
    (y * ws).sum().backward()
    pnm = [close(got, want.detach()), close(xs.grad.full_tensor(), xr.grad)]
    pnm += same_grads(conv, serial)

    # CREDIT's apply_domain_parallel (mpidp.parallel's): the model converted over the user's
    # group takes bands (the policy's rows)
    model = apply_domain_parallel(_conv(), group)
    rows = ShardSpec.balanced(H, WORLD).slice(ME)
    xb = x[..., rows, :].clone().requires_grad_()
    yb = model(xb)
    (yb * w[..., rows, :]).sum().backward()
    mpidp.sync_gradients(model, manager_for(group))
    credit = [close(yb, want.detach()[..., rows, :]), close(xb.grad, xr.grad[..., rows, :])]
    credit += same_grads(model, serial)

    assert grids == [(WORLD, 1), (WORLD, 1)] and m.grid == (1, WORLD)
    assert own == [True] * 3  # mpidp's own domain group and meshes keep their manager
    assert all(pnm), pnm
    assert all(credit), credit


# -- the plain SpectralConv2d on ShardedTensors ------------------------------------------------

#: bands, and a grid of blocks at this rank count ((1, P); (2, 2) on 4 ranks)
GRIDS = [(WORLD, 1)] + ([(2, 2) if WORLD == 4 else (1, WORLD)] if WORLD > 1 else [])


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def gm(request):
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


def test_plain_spectral_conv_on_sharded_tensors_equals_serial(gm):
    """modes2 = 4 of the 10 W modes: over 4 ranks some hold no kept mode."""
    m = gm
    torch.manual_seed(1)
    serial = SpectralConv2d(3, 2, modes1=3, modes2=4).double()
    model = copy.deepcopy(serial)
    full, dims = rand((2, 3, H, W), 3), ((2, 3) if m.grid[1] > 1 else 2)
    x = shard(full, dims, m).requires_grad_()
    y = model(x)
    got = y.full_tensor().as_subclass(torch.Tensor)
    fr = full.clone().requires_grad_()
    want = serial(fr)
    w = rand(tuple(want.shape), 4)
    (y * w).sum().backward()
    (want * w).sum().backward()
    mpidp.sync_gradients(model, m)
    mine = x.grad.full_tensor().as_subclass(torch.Tensor)
    checks = [("forward", close(got, want.detach())), ("input grad", close(mine, fr.grad))]
    pairs = zip(model.named_parameters(), serial.named_parameters(), strict=True)
    checks += [(f"grad {n}", close(p.grad, q.grad)) for (n, p), (_, q) in pairs]
    assert isinstance(y, ShardedTensor)
    assert all(ok for _, ok in checks), checks


# -- mpidp.ops.fft given a band on a manager of blocks --------------------------------------------


def test_rfft2_of_a_band_on_blocks_is_refused_or_run_over_the_named_group(gm):
    if gm.grid[1] == 1:
        pytest.skip("blocks")
    m = gm
    full = rand((2, 3, H, W), 5)
    cut = ShardSpec.balanced(H, WORLD)
    band = full[..., cut.slice(m.domain_rank), :]
    spectrum = torch.fft.rfft2(full, norm="ortho")
    kept = spectrum[..., mfft.modes(W // 2 + 1, manager=m)]  # this rank's modes
    given = {
        "spec": refusal(lambda: mfft.rfft2(band, manager=m, spec=cut)),
        "sizes": refusal(lambda: mfft.rfft2(band, manager=m, spec=list(cut.sizes))),
        "learned": refusal(lambda: mfft.rfft2(band, manager=m)),
        "out_spec": refusal(lambda: mfft.irfft2(kept, s=(H, W), manager=m, out_spec=cut)),
    }
    X = mfft.rfft2(band, norm="ortho", manager=m, group=m.transport())  # the band transform
    ok = close(X, spectrum[..., mfft.modes(X)])
    for what in ("spec", "sizes", "out_spec"):
        assert (
            given[what] is not None
            and "is not the blocks of a latitude x longitude" in (given[what])
        ), (what, given[what])
        assert "group=manager.transport()" in given[what]
    assert given["learned"] is not None and "not the blocks of the grid" in given["learned"]
    assert ok


# -- a pad wider than the field on empty and one-row bands ---------------------------------------


@pytest.mark.parametrize("rows", [max(WORLD - 1, 1), WORLD + 1])  # an empty band; one-row bands
def test_a_pad_wider_than_the_field_on_thin_bands_equals_serial(gm, rows):
    if gm.grid[1] > 1:
        pytest.skip("bands")  # (on blocks: a band is refused, above)
    full = rand((2, 3, rows, 4), 6)
    pad = (1, 2, 7, rows + 2)
    cut = ShardSpec.balanced(rows, WORLD, allow_empty=True)
    xr = full.clone().requires_grad_()
    want = F.pad(xr, pad)
    w = rand(tuple(want.shape), 7)
    (want * w).sum().backward()
    x = shard(full, 2, gm, spec=cut).requires_grad_()
    y = F.pad(x, pad)
    got = y.full_tensor().as_subclass(torch.Tensor)
    (y * w).sum().backward()
    mine = xr.grad.narrow(2, cut.start(ME), cut.sizes[ME])
    assert close(got, want.detach()) and close(x.grad.local, mine)
