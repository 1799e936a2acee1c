"""Models written as third-party weather models are written (tests/mpi/zoo_models.py), run
unchanged on ShardedTensor input: output, the input's gradient and every parameter's gradient
equal the serial model's, float64, 1-4 ranks; an op that would mix rows raises everywhere;
and a 2 x 2 (dp x domain) training fed ShardedTensors reproduces the serial losses."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp import models as M
from mpidp.sharded import UnsupportedOp, shard
from tests.mpi import zoo_models as zoo
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64
H = 4 * WORLD + 6  # a multiple of 2 (pools, patches) and 4 (two pools), uneven bands


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


MODELS = {
    "unet_interpolate_to_skip": (lambda: zoo.UNet((H, 12)), (2, 3, H, 12), 2),
    "unet3d_maxpool3d_trilinear": (lambda: zoo.UNet3D(), (1, 2, 4, H, 6), 3),
    "resnet_reflection_pad": (lambda: zoo.ResNet(), (2, 3, H, 10), 2),
    "patch_embedding_pos_embed_einops": (lambda: zoo.PatchMixer((H, 12)), (2, 3, H, 12), 2),
    "global_mean_film": (lambda: zoo.FiLMNet(), (2, 3, H, 8), 2),
    "afno_plain_fft": (lambda: zoo.AFNO((H, 12)), (2, 3, H, 12), 2),
    "fno_zeros_then_setitem": (lambda: zoo.FNOSpectral(), (2, 3, H, 12), 2),
    "mpidp_weather_unet": (lambda: M.WeatherUNet(3, 2, (H, 12), width=4), (1, 3, H, 12), 2),
    "mpidp_afnonet": (
        lambda: M.AFNONet(3, 2, (H, 12), patch=2, embed_dim=8, depth=1, num_blocks=2),
        (1, 3, H, 12),
        2,
    ),
    "mpidp_periodic_resblock_polar": (lambda: M.PeriodicResBlock(4), (1, 4, H, 12), 2),
    "swin_shifted_windows": (
        lambda: nn.Sequential(
            zoo.SwinBlock(8, 2, 4, 0, 4 * (WORLD + 2), 8),
            zoo.SwinBlock(8, 2, 4, 2, 4 * (WORLD + 2), 8),
        ),
        (1, 4 * (WORLD + 2), 8, 8),
        1,
    ),
    "superres_pixelshuffle": (lambda: zoo.SuperRes(), (1, 3, H, 6), 2),
}


def build(name):
    torch.manual_seed(11)  # the same weights on every rank
    return MODELS[name][0]().to(F64)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_runs_unchanged_and_equals_serial(m, name):
    model = build(name)
    _, shape, dim = MODELS[name]
    check_sharded(m, model, rand(shape, 3), dim=dim, module=model, rtol=1e-9, atol=1e-11)


def test_a_row_mixing_op_inside_a_model_raises_on_every_rank(m):
    class Cumulative(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(torch.relu(x), dim=2)

    x = shard(rand((1, 2, H, 4), 1), 2, m)
    where = r"in Cumulative.forward: torch.cumsum\(ShardedTensor"
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: {where}"):
        Cumulative()(x)


def test_training_dp_by_domain_reproduces_the_serial_losses():
    """10 SGD steps of the U-Net, 2 x 2 at 4 ranks (domain only at 1-3): every step's loss
    equals the serial model's on the whole batch to 1e-10."""
    dp = 2 if WORLD == 4 else 1
    domain = WORLD // dp
    steps, b, shape = 10, 2, (3, H, 12)
    data = rand((steps, dp * b, *shape), 21)
    target = rand((steps, dp * b, 2, H, 12), 22)
    lat = rand((H, 1), 23).abs()

    torch.manual_seed(5)
    serial = zoo.UNet((H, 12)).to(F64)
    opt = torch.optim.SGD(serial.parameters(), lr=0.05)
    want = []
    for s in range(steps):
        opt.zero_grad()
        loss = ((serial(data[s]) - target[s]) ** 2 * lat).mean()
        loss.backward()
        opt.step()
        want.append(loss.item())

    with mpidp.DistributedManager(domain_parallel_size=domain) as m:
        torch.manual_seed(5)
        model = zoo.UNet((H, 12)).to(F64)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mine = slice(m.dp_rank * b, (m.dp_rank + 1) * b)
        got = []
        for s in range(steps):
            opt.zero_grad()
            x, y = shard(data[s, mine], -2, m), shard(target[s, mine], -2, m)
            loss = ((model(x) - y) ** 2 * lat).mean()
            loss.backward()
            mpidp.sync_gradients(model, m)
            opt.step()
            got.append(
                float(m.transport("dp").all_reduce(loss.detach().as_subclass(torch.Tensor), "avg"))
            )
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-10, (got, want)


def test_the_spec_travels_no_all_gather_after_the_first_step(m):
    """A converted layer learns its input partition in an all-gather at every call, and its
    halo exchange agrees on its arguments at every call; with a ShardedTensor the partition
    travels with the tensor and the halo agrees once per distinct call: the second step of the
    U-Net sends no all-gather of ints at all."""
    from mpidp.testing import count_traffic

    model = build("unet_interpolate_to_skip")
    full = rand((2, 3, H, 12), 3)

    def step():
        y = model(shard(full, 2, m))
        (y * y).mean().backward()

    with count_traffic(m) as traffic:
        step()
        first = {k: list(v) for k, v in traffic.ops.items()}
        step()
    second = {k: traffic.ops[k][0] - first.get(k, [0])[0] for k in traffic.ops}
    assert second.get("all_gather_ints", 0) == 0, second
    if WORLD > 1:  # (one rank runs torch's own layers: nothing to agree on)
        assert first["all_gather_ints"][0] > 0, first
        assert second["exchange"] == first["exchange"][0]  # the halo traffic itself
