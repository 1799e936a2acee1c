"""PhysicsNeMo's documented usage with only the import changed, against serial torch (float64).

mpidp is initialised with a domain group of ONE rank, so a ``group=None`` that resolved to
mpidp's domain group instead of PhysicsNeMo's world would give wrong results at 2+ ranks.
Sizes are uneven (an empty part too) wherever the call takes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.compat.physicsnemo.distributed import (
    DistributedManager,
    PhysicsNeMoUndefinedGroupError,
    all_gather_v,
    gather_v,
    indexed_all_to_all_v,
    mappings,
    mark_module_as_shared,
    reduce_loss,
    scatter_v,
    utils,
)
from mpidp.compat.physicsnemo.distributed.autograd import AllGatherVAutograd
from mpidp.compat.physicsnemo.distributed.fft import DistributedIRFFT2, DistributedRFFT2
from mpidp.compat.physicsnemo.distributed.manager import transport_for

F64 = torch.float64
P = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()


@pytest.fixture(scope="module", autouse=True)
def pnm() -> Iterator[DistributedManager]:
    """mpidp already initialised (domain of one rank), then PhysicsNeMo's set-up."""
    core = mpidp.init(domain_parallel_size=1)
    DistributedManager.initialize()
    DistributedManager.create_process_subgroup("spatial_parallel", P)
    yield DistributedManager()
    DistributedManager.cleanup()
    core.shutdown()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to 1e-10 relative to the largest entry of ``want``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(float(want.abs().max()), 1e-300) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= 1e-10 * scale, f"rank {ME}: max error {err:.3g} vs scale {scale:.3g}"


def uneven(p: int = P) -> list[int]:
    """Uneven sizes with an empty part: [2], [2, 0], [2, 0, 3], [2, 0, 3, 1]."""
    return [(3 * r + 2) % 5 if r else 2 for r in range(p)]


def part(x: torch.Tensor, sizes: list[int], dim: int, r: int = ME) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[:r]), sizes[r])


def per_rank(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """One weight tensor per rank, the same list on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=F64) for _ in range(P)]


# -- the manager ------------------------------------------------------------------------------


def test_borg_needs_no_communication(pnm, monkeypatch):
    """After initialize(), DistributedManager() on one rank alone returns the shared state."""
    core = mpidp.get_manager()

    def refuse(*args, **kwargs):
        raise AssertionError("DistributedManager() communicated")

    monkeypatch.setattr(mpidp.runtime.manager.DistributedManager, "__init__", refuse)
    monkeypatch.setattr(mpidp.runtime.manager, "init", refuse)
    monkeypatch.setattr(torch.distributed, "new_group", refuse)
    if ME == 0:  # one rank alone: a collective here would hang the others' next test
        again = DistributedManager()
        assert again.__dict__ is pnm.__dict__
        assert (again.rank, again.world_size, again.local_rank) == (0, P, core.local_rank)
        assert again.device == core.device and again.distributed
        assert again.group() is None and again.group_size() == P
        assert list(again.group_names) == ["spatial_parallel"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DistributedManager.initialize()
        assert "already initialized" in str(caught[0].message)
    assert DistributedManager.is_initialized()
    with pytest.raises(PhysicsNeMoUndefinedGroupError, match="create_process_subgroup"):
        pnm.group("model_parallel")
    pnm.find_unused_parameters = False
    assert not pnm.broadcast_buffers and not pnm.find_unused_parameters


def test_subgroups_and_orthogonal(pnm):
    size = 2 if P % 2 == 0 else 1
    DistributedManager.create_process_subgroup("pairs", size)
    DistributedManager.create_orthogonal_process_group("across", "pairs")
    assert pnm.group_size("pairs") == size and pnm.group_rank("pairs") == ME % size
    assert pnm.group_size("across") == P // size and pnm.group_rank("across") == ME // size
    assert pnm.group_name(pnm.group("across")) == "across"
    # a named group works in the collectives: gather this rank's across-group peers' rows
    x = torch.arange(3.0, dtype=F64).repeat(P, 1) + 10 * torch.arange(P, dtype=F64)[:, None]
    members = [r * size + ME % size for r in range(P // size)]
    out = utils.all_gather_v_wrapper(x[ME : ME + 1], [1] * (P // size), 0, pnm.group("across"))
    close(out, x[members])


def test_initialize_mesh(pnm):
    mesh = pnm.initialize_mesh((-1,), ("world",))
    assert pnm.mesh_dims == {"world": P} and pnm.mesh("world").size() == P
    assert pnm.mesh() is mesh and pnm.global_mesh is mesh
    group = pnm.get_mesh_group(mesh)
    assert torch.distributed.get_world_size(group) == P


# -- the v-collectives, differentiable --------------------------------------------------------


def test_all_gather_v_sums_gradients_over_the_world():
    sizes, dim = uneven(), 1
    full = torch.randn(3, sum(sizes), 4, dtype=F64)
    weights = per_rank(tuple(full.shape), 1)
    x = part(full, sizes, dim).clone().requires_grad_()
    out = all_gather_v(x, sizes, dim)
    close(out.detach(), full)
    (out * weights[ME]).sum().backward()
    close(x.grad, part(sum(weights), sizes, dim))
    again = AllGatherVAutograd.apply(x.detach(), sizes, dim, True, None)
    close(again, full)


def test_gather_v_to_the_last_rank():
    sizes, dim, dst = uneven(), 0, P - 1
    full = torch.randn(sum(sizes), 5, dtype=F64)
    w = torch.randn_like(full)
    x = part(full, sizes, dim).clone().requires_grad_()
    out = gather_v(x, sizes, dim, dst)
    if ME == dst:
        close(out.detach(), full)
        (out * w).sum().backward()
    else:
        out.sum().backward()
    close(x.grad, part(w, sizes, dim))


def test_scatter_v_from_rank_0():
    sizes, dim = uneven(), -1
    full = torch.randn(2, sum(sizes), dtype=F64, requires_grad=True)
    w = torch.randn(2, sum(sizes), dtype=F64)
    out = scatter_v(full, sizes, dim, 0)
    close(out.detach(), part(full.detach(), sizes, 1))
    (out * part(w, sizes, 1)).sum().backward()
    if ME == 0:
        close(full.grad, w)


def _routes(seed: int) -> tuple[list[int], list[list[torch.Tensor]]]:
    """Rows per rank and, for every rank i, the indices it sends to each rank j (repeats)."""
    g = torch.Generator().manual_seed(seed)
    rows = [2 + r % 3 for r in range(P)]
    idx = [
        [
            torch.randint(0, rows[i], (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
            for _ in range(P)
        ]
        for i in range(P)
    ]
    return rows, idx


def test_indexed_all_to_all_v_and_its_backward():
    rows, idx = _routes(3)
    sizes = [[int(i.numel()) for i in idx[r]] for r in range(P)]
    locals_ = [
        torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(r))
        for r, n in enumerate(rows)
    ]
    # serial: every rank's result and the gradient of the sum of their losses
    leaves = [t.clone().requires_grad_() for t in locals_]
    outs = [torch.cat([leaves[i][idx[i][j]] for i in range(P)]) for j in range(P)]
    weights = [torch.randn_like(o) for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
    x = locals_[ME].clone().requires_grad_()
    out = indexed_all_to_all_v(x, idx[ME], sizes, True, 0, None)
    close(out.detach(), outs[ME].detach())
    (out * weights[ME]).sum().backward()
    close(x.grad, leaves[ME].grad)
    fwd = utils.indexed_all_to_all_v_wrapper(locals_[ME], idx[ME], sizes, 0, None)
    close(fwd, outs[ME].detach())
    bwd = utils.indexed_all_to_all_v_wrapper_bwd(weights[ME], idx[ME], sizes, rows[ME])
    close(bwd, leaves[ME].grad)


# -- the wrappers (no autograd) ---------------------------------------------------------------


def test_wrappers_take_physicsnemo_arguments():
    sizes, dim = uneven(), 0
    full = torch.randn(sum(sizes), 3, dtype=F64)
    mine = part(full, sizes, dim)
    close(utils.all_gather_v_wrapper(mine, sizes, dim), full)
    close(utils.all_gather_v_wrapper(mine, None, dim), full)  # sizes learned
    shapes = [[s, 3] for s in sizes]  # full shapes per rank are accepted too
    close(utils.all_gather_v_wrapper(mine, shapes, dim), full)
    everyone = per_rank(tuple(full.shape), 4)
    close(utils.all_gather_v_bwd_wrapper(everyone[ME], sizes, dim), part(sum(everyone), sizes, 0))
    got = utils.gather_v_wrapper(mine, sizes, dim, 0)
    if ME == 0:
        close(got, full)
    close(utils.scatter_v_wrapper(full if ME == 0 else mine, sizes, dim, 0), mine)


def test_distributed_transpose_uneven():
    rows, cols = 7, uneven()
    full = torch.randn(2, rows, sum(cols), dtype=F64)
    recv, req = utils.distributed_transpose(part(full, cols, 2), 1, 2)
    assert req.wait()
    split = utils.compute_split_shapes(rows, P)
    close(torch.cat(recv, dim=2), part(full, split, 1))


def test_reduce_loss():
    got = reduce_loss(float(ME + 1), dst_rank=P - 1, mean=True)
    assert (got is None) == (ME != P - 1)
    if got is not None:
        assert abs(got - (P + 1) / 2) < 1e-12
    total = reduce_loss(float(ME + 1), 0, False)
    assert total is None or abs(total - P * (P + 1) / 2) < 1e-12


def test_mark_module_as_shared_sums_gradients():
    layer = torch.nn.Linear(3, 2, dtype=F64)
    inputs = per_rank((4, 3), 5)
    mark_module_as_shared(layer, None)
    layer(inputs[ME]).sum().backward()
    serial = torch.nn.Linear(3, 2, dtype=F64)
    serial.load_state_dict(layer.state_dict())
    sum(serial(x).sum() for x in inputs).backward()
    close(layer.weight.grad, serial.weight.grad)
    utils.unmark_module_as_shared(layer)


# -- mappings (group names) -------------------------------------------------------------------


def test_mappings_copy_and_reduce():
    weights = per_rank((3, 2), 6)
    x = torch.randn(3, 2, dtype=F64, generator=torch.Generator().manual_seed(7))
    a = x.clone().requires_grad_()
    (mappings.copy_to_parallel_region(a, "spatial_parallel") * weights[ME]).sum().backward()
    close(a.grad, sum(weights))
    b = weights[ME].clone().requires_grad_()
    out = mappings.reduce_from_parallel_region(b, None)
    close(out.detach(), sum(weights))
    (out * x).sum().backward()  # every rank computes the same from the sum
    close(b.grad, x)


def test_mappings_scatter_and_gather():
    n, dim = 9, 1
    full = torch.randn(2, n, dtype=F64, generator=torch.Generator().manual_seed(8))
    w = torch.randn(2, n, dtype=F64, generator=torch.Generator().manual_seed(9))
    split = utils.compute_split_shapes(n, P)
    x = full.clone().requires_grad_()
    out = mappings.scatter_to_parallel_region(x, dim, "spatial_parallel")
    close(out.detach(), part(full, split, dim))
    (out * part(w, split, dim)).sum().backward()
    close(x.grad, w)
    sizes = uneven()
    g = torch.randn(2, sum(sizes), dtype=F64)
    mine = part(g, sizes, dim).clone().requires_grad_()
    whole = mappings.gather_from_parallel_region(mine, dim, sizes, "spatial_parallel")
    close(whole.detach(), g)
    wg = torch.randn_like(g)  # the same on every rank: the loss counted once
    (whole * wg).sum().backward()
    close(mine.grad, part(wg, sizes, dim))


# -- FFT in PhysicsNeMo's layout --------------------------------------------------------------


@pytest.mark.parametrize(("h", "w", "given_s"), [(7, 10, True), (6, 9, False)])
def test_rfft2_cut_along_the_halved_dim(h, w, given_s):
    """In: real field cut along dim[1] (W, uneven); out: spectrum cut along dim[0] (H)."""
    s = (h, w) if given_s else None
    dims = (-2, -1)
    cols = uneven() if P > 1 else [w]
    cols[-1] += w - sum(cols)
    full = torch.randn(2, h, w, dtype=F64)
    x = part(full, cols, 2).clone().requires_grad_()
    X = DistributedRFFT2.apply(x, s, dims, "ortho")
    rows = mpidp.ops.fft.layout(X).modes
    serial_in = full.clone().requires_grad_()
    serial = torch.fft.rfft2(serial_in, s=s, dim=dims, norm="ortho")
    close(X.detach(), serial.detach()[:, rows])
    wr, wi = torch.randn(serial.shape, dtype=F64), torch.randn(serial.shape, dtype=F64)
    ((X.real * wr[:, rows]).sum() + (X.imag * wi[:, rows]).sum()).backward()
    ((serial.real * wr).sum() + (serial.imag * wi).sum()).backward()
    close(x.grad, part(serial_in.grad, cols, 2))
    # the way back: any spectrum (not only a Hermitian one), cut along dim[0]
    Z = torch.complex(torch.randn(serial.shape, dtype=F64), torch.randn(serial.shape, dtype=F64))
    z = Z[:, rows].clone().requires_grad_()
    y = DistributedIRFFT2.apply(z, s, dims, "ortho")
    serial_z = Z.clone().requires_grad_()
    want = torch.fft.irfft2(serial_z, s=s, dim=dims, norm="ortho")
    spatial = transport_for(DistributedManager().group("spatial_parallel"), "cpu")
    out_cols = mpidp.ops.fft.mode_spec(want.shape[-1], group=spatial)
    close(y.detach(), want.detach()[..., out_cols.slice(ME)])
    wy = torch.randn(want.shape, dtype=F64)
    (y * wy[..., out_cols.slice(ME)]).sum().backward()
    (want * wy).sum().backward()
    close(z.grad, serial_z.grad[:, rows])
    back = DistributedIRFFT2.apply(X.detach(), (h, w), dims, "ortho")
    close(back, full[..., mpidp.ops.fft.mode_spec(w, group=spatial).slice(ME)])
