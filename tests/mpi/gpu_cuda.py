"""The CUDA/NCCL subset, run only by scripts/test-gpu.sh (named so that the CPU suite does not
collect it: there it could only skip): the manager on a GPU, every collective, the halo,
the FFT, converted models (U-Net, AFNO, Swin, graph) against the serial model, and a bf16
training step, all on device tensors. One GPU: world 1 on NCCL (the layers run torch's CUDA
kernels); several: one rank per GPU, every collective through NCCL. ``MPIDP_TEST_DEVICE=cpu``
runs the same checks on CPU tensors (the script's dry run)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.models import AFNONet, GraphCastNet, SwinNet, WeatherUNet

pytestmark = pytest.mark.mpi
DEVICE = os.environ.get("MPIDP_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError(
        f"MPIDP_TEST_DEVICE=cuda but torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
        "no GPU; run scripts/test-gpu.sh on a machine with one, or --cpu for a dry run"
    )
BACKEND = os.environ.get("MPIDP_TEST_BACKEND")  # unset: the manager's own choice (NCCL on a GPU)
WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()


@pytest.fixture(scope="module")
def m():
    # the default: collectives take its group. MPIDP_TEST_BACKEND=gloo with several ranks on one
    # GPU runs the device paths of the layers at P > 1 where NCCL refuses two ranks per GPU
    manager = mpidp.init(
        domain_parallel_size=WORLD, backend=BACKEND, device=DEVICE if BACKEND else None
    )
    yield manager
    manager.shutdown()


def rand(shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def test_manager_is_on_the_device(m):
    assert m.device.type == DEVICE
    if DEVICE == "cuda":
        assert (
            m.backend == (BACKEND or "nccl")
            and m.device.index == m.local_rank % torch.cuda.device_count()
        )
        assert m.transport().name == "torch"  # CUDA tensors go through NCCL


def test_every_collective_on_device_tensors(m):
    sizes = list(mpidp.ShardSpec.balanced(2 * WORLD + 1, WORLD).sizes)
    lo = sum(sizes[:ME])
    full = rand((3, sum(sizes), 4), 1)
    mine = full[:, lo : lo + sizes[ME]].contiguous()
    got = mpidp.all_gather_v(mine, sizes, 1)
    assert got.device.type == DEVICE and torch.equal(got, full)
    total = mpidp.reduce_scatter_v(full, sizes, 1)
    torch.testing.assert_close(total, WORLD * mine)
    assert torch.equal(mpidp.scatter_v(full if ME == 0 else None, sizes, 1), mine)
    gathered = mpidp.gather_v(mine, sizes, 1)
    assert ME != 0 or torch.equal(gathered, full)
    torch.testing.assert_close(mpidp.all_reduce(mine.sum(1)), full.sum(1))
    # transpose: bands of dim 1 -> bands of dim 2 (4 columns over the ranks)
    cols = list(mpidp.ShardSpec.balanced(4, WORLD, allow_empty=True).sizes)
    moved = mpidp.all_to_all_v(mine, cols, sizes, 2, 1)
    c0 = sum(cols[:ME])
    assert torch.equal(moved, full[:, :, c0 : c0 + cols[ME]])
    idx = [torch.arange(min(1, sizes[ME]), device=DEVICE) for _ in range(WORLD)]
    picked = mpidp.indexed_all_to_all_v(mine, idx, dim=1)
    assert picked.shape[1] == sum(min(1, s) for s in sizes)


def test_halo_exchange_on_device(m):
    spec = m.spec(4 * WORLD + 3)
    full = rand((2, 3, spec.total, 5), 2)
    band = full.narrow(2, spec.start(ME), spec[ME])
    ext = mpidp.halo_exchange(band, 2, 1, -2, spec, m, "zeros")
    pad = torch.nn.functional.pad(full, (0, 0, 2, 1))
    assert torch.equal(ext, pad.narrow(2, spec.start(ME), spec[ME] + 3))


def test_fft_round_trip_on_device(m):
    spec = m.spec(18)
    full = rand((2, 3, 18, 16), 3)
    band = full.narrow(2, spec.start(ME), spec[ME])
    modes = mpidp.ops.fft.rfft2(band)
    back = mpidp.ops.fft.irfft2(modes, s=(18, 16))
    torch.testing.assert_close(back, band, rtol=1e-5, atol=1e-5)


MODELS = {
    "unet": lambda: WeatherUNet(2, 2, (19, 16), width=4),
    "afno": lambda: AFNONet(2, 2, (24, 16), patch=4, embed_dim=8, depth=2, num_blocks=2),
    "swin": lambda: SwinNet(2, 2, (24, 16), patch=4, embed_dim=8, depth=2, heads=2, window=(4, 2)),
    "graph": lambda: GraphCastNet(2, 2, (19, 16), mesh_nodes=40, hidden=8),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_models_equal_serial_on_device(m, name):
    """float64 on the device (a float32 check would measure TF32 and summation order, not
    mpidp): output, input gradient and every parameter gradient; a parameter gradient is held
    to the scale of all of them (one that is zero in exact arithmetic is rounding noise)."""
    f64 = torch.float64
    torch.manual_seed(0)
    serial = MODELS[name]().to(DEVICE, f64)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    h = 24 if name in ("afno", "swin") else 19
    x = rand((2, 2, h, 16), 4, f64)
    spec = m.spec(h)
    band = x.narrow(2, spec.start(ME), spec[ME]).clone().requires_grad_()
    xs = x.clone().requires_grad_()
    w = rand((2, 2, h, 16), 5, f64)
    ys = serial(xs)
    (ys * w).sum().backward()
    yd = dist(band)
    (yd * w.narrow(2, spec.start(ME), spec[ME])).sum().backward()
    mpidp.sync_gradients(dist, m)
    whole = mpidp.all_gather_v(yd.detach(), list(spec), 2)
    torch.testing.assert_close(whole, ys.detach())
    torch.testing.assert_close(band.grad, xs.grad.narrow(2, spec.start(ME), spec[ME]))
    scale = max(float(q.grad.abs().max()) for q in serial.parameters())
    for (n, p), q in zip(dist.named_parameters(), serial.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-10 * scale, msg=n)


def test_bf16_training_step(m):
    """A U-Net step under bf16 autocast on the device: the loss and every gradient finite, and
    the loss within bf16's precision of float32's."""
    torch.manual_seed(0)
    dist = mpidp.convert_to_domain_parallel(WeatherUNet(2, 2, (19, 16), width=4).to(DEVICE), m)
    spec = m.spec(19)
    x = rand((2, 2, 19, 16), 6).narrow(2, spec.start(ME), spec[ME])
    y = rand((2, 2, 19, 16), 7).narrow(2, spec.start(ME), spec[ME])
    losses = []
    for dtype in (torch.float32, torch.bfloat16):
        dist.zero_grad()
        with torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32):
            loss = mpidp.global_mean((dist(x).float() - y).square(), manager=m)
        loss.backward()
        mpidp.sync_gradients(dist, m)
        assert all(torch.isfinite(p.grad).all() for p in dist.parameters())
        losses.append(float(loss))
    assert abs(losses[1] - losses[0]) <= 0.05 * abs(losses[0]), losses
