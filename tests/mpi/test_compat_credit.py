"""CREDIT's ``credit.domain_parallel`` and ``credit.parallel`` usage with only the import
changed (mpidp.compat.credit), against serial torch: float64, uneven bands (11 rows over 2-4
ranks), forward, input and parameter gradients; CREDIT's training loop (local-mean loss,
``sync_domain_gradients``) gives the serial gradient where CREDIT's own is off on uneven
bands, and a mutation that drops the row weights shows the test can fail."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.compat.credit import domain_parallel as dp
from mpidp.compat.credit import parallel as cp
from mpidp.compat.credit.domain_parallel import (
    DomainParallelPeriodicConv2d,
    convert_to_domain_parallel,
    gather_tensor,
    initialize_domain_parallel,
    shard_tensor,
)
from mpidp.compat.credit.parallel import sync_domain_gradients
from mpidp.errors import ConfigError
from tests.mpi.helpers import rand

WORLD = MPI.COMM_WORLD.Get_size()
TOL = {"rtol": 1e-10, "atol": 1e-12}
H, W = 11, 8


@pytest.fixture(scope="module")
def manager():
    with mpidp.init(domain_parallel_size=WORLD):
        yield initialize_domain_parallel(WORLD, WORLD)


class PeriodicConv2d(nn.Module):
    """CREDIT's (credit.models.unet_diffusion): circular along W, reflect along H."""

    def __init__(self, dim_in, dim_out, kernel_size, padding=1):
        super().__init__()
        self.padding = padding
        self.conv = nn.Conv2d(dim_in, dim_out, kernel_size, padding=0)

    def forward(self, x):
        x = F.pad(x, (self.padding, self.padding, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, self.padding, self.padding), mode="reflect")
        return self.conv(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = PeriodicConv2d(2, 4, 3)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.up = nn.ConvTranspose2d(4, 4, 4, stride=2, padding=1)
        self.out = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        h = self.inp(x)
        d = F.gelu(self.norm(self.down(h)))
        u = self.up(d)[..., : h.shape[-2], :]
        return self.out(h + u)


def serial_net():
    torch.manual_seed(0)
    return Net().double()


def test_credit_training_loop_gives_the_serial_gradients(manager):
    x, y = rand((2, 2, H, W), 1), rand((2, 2, H, W), 2)
    ref = serial_net()
    F.mse_loss(ref(x), y).backward()

    model = convert_to_domain_parallel(
        serial_net(),
        manager,
        custom_converters={PeriodicConv2d: lambda m: DomainParallelPeriodicConv2d(m)},
    )
    out = model(shard_tensor(x))
    torch.testing.assert_close(gather_tensor(out), ref(x).detach(), **TOL)
    F.mse_loss(out, shard_tensor(y)).backward()  # each rank: the mean over its own rows
    sync_domain_gradients(model, manager)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in ref.named_parameters()}
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=n)


@pytest.mark.mpi(min_size=2)
def test_the_loop_without_row_weights_is_off_on_uneven_bands(manager, monkeypatch):
    """The mutation: CREDIT's rule (a plain average of local-mean gradients) fails here."""
    monkeypatch.setattr(dp.convert, "track", lambda band, dim, m: band)
    x, y = rand((2, 2, H, W), 1), rand((2, 2, H, W), 2)
    ref = serial_net()
    F.mse_loss(ref(x), y).backward()
    model = convert_to_domain_parallel(serial_net(), manager)
    F.mse_loss(model(shard_tensor(x)), shard_tensor(y)).backward()
    sync_domain_gradients(model, manager)
    off = max(
        float((p.grad - q.grad).abs().max() / q.grad.abs().max())
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    assert off > 1e-3


def test_sync_refuses_a_model_converted_without_row_weights(manager):
    model = mpidp.convert_to_domain_parallel(serial_net(), manager.manager)
    F.mse_loss(
        model(shard_tensor(rand((1, 2, H, W), 1))), shard_tensor(rand((1, 2, H, W), 2))
    ).backward()
    if WORLD == 1:
        sync_domain_gradients(model, manager)  # nothing to average
        return
    with pytest.raises(ConfigError, match=r"mpidp\.compat\.credit\.domain_parallel"):
        sync_domain_gradients(model, manager)


def _band_grads(layer, full, out_fn, dim=-2):
    """The wrapper on bands against ``out_fn`` on the whole tensor: output, input gradient,
    parameter gradients (summed over the domain, mpidp's shares rule)."""
    xr = full.clone().requires_grad_()
    yr = out_fn(xr)
    w = rand(tuple(yr.shape), 5)
    (yr * w).sum().backward()
    refs = list(out_fn.parameters()) if isinstance(out_fn, nn.Module) else []
    x = shard_tensor(full, dim).requires_grad_()
    y = layer(x)
    torch.testing.assert_close(gather_tensor(y, dim), yr.detach(), **TOL)
    (y * shard_tensor(w, dim)).sum().backward()
    torch.testing.assert_close(x.grad, shard_tensor(xr.grad, dim), **TOL)
    mpidp.sync_gradients(layer)
    named = list(layer.named_parameters())  # in the serial module's order
    return {n: (p.grad, q.grad) for (n, p), q in zip(named, refs, strict=True)}


CONVS = {
    "conv2d_3x3": (lambda: nn.Conv2d(2, 3, 3, padding=1), dp.DomainParallelConv2d, {}, 4),
    "conv2d_strided": (
        lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1),
        dp.DomainParallelConv2d,
        {},
        4,
    ),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), dp.DomainParallelConv3d, {"shard_dim": 3}, 5),
    "convtranspose2d": (
        lambda: nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1),
        dp.DomainParallelConvTranspose2d,
        {},
        4,
    ),
    "convtranspose3d": (
        lambda: nn.ConvTranspose3d(2, 3, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1)),
        dp.DomainParallelConvTranspose3d,
        {"shard_dim": 3},
        5,
    ),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_layer_wrappers_take_the_module_and_equal_it(manager, name):
    make, wrapper, kwargs, ndim = CONVS[name]
    torch.manual_seed(1)
    conv = make().double()
    serial = copy.deepcopy(conv)
    layer = wrapper(conv, **kwargs)
    assert layer.weight is layer.conv.weight and {n for n, _ in layer.named_parameters()} == {
        "conv.weight",
        "conv.bias",
    }
    shape = (1, 2, H, W) if ndim == 4 else (1, 2, 2, H, W)
    for n, (got, want) in _band_grads(layer, rand(shape, 3), serial).items():
        torch.testing.assert_close(got, want, **TOL, msg=n)


def test_group_norm_and_periodic_conv_keep_credits_state_dict_keys(manager):
    torch.manual_seed(2)
    norm = nn.GroupNorm(2, 4).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    serial = copy.deepcopy(norm)
    layer = dp.DomainParallelGroupNorm(norm)
    assert set(layer.state_dict()) == {"weight", "bias"} and layer.weight is norm.weight
    for n, (got, want) in _band_grads(layer, rand((2, 4, H, W), 4), serial).items():
        torch.testing.assert_close(got, want, **TOL, msg=n)
    pconv = PeriodicConv2d(4, 3, 3).double()
    serial = copy.deepcopy(pconv)
    layer = DomainParallelPeriodicConv2d(pconv)
    assert set(layer.state_dict()) == {"conv.weight", "conv.bias"} and layer.padding == 1
    for n, (got, want) in _band_grads(layer, rand((1, 4, H, W), 6), serial).items():
        torch.testing.assert_close(got, want, **TOL, msg=n)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_interpolate_size_is_one_even_band(manager, mode):
    layer = dp.DomainParallelInterpolate((5, 12), mode)  # CREDIT's size: one rank's band
    corners = False if mode == "bilinear" else None
    full = rand((1, 2, 2 * H, W), 7)
    assert not _band_grads(
        layer,
        full,
        lambda x: F.interpolate(x, size=(5 * WORLD, 12), mode=mode, align_corners=corners),
    )


@pytest.mark.parametrize("width", [1, 3])
def test_halo_exchange_pads_with_the_neighbours_rows_and_zeros_beyond(manager, width):
    halo = dp.HaloExchange(width)
    full = rand((1, 2, H, W), 8)
    padded = F.pad(full, (0, 0, width, width))
    s = manager.manager.spec(H)
    r = manager.domain_rank
    got = halo(shard_tensor(full))
    torch.testing.assert_close(
        got, padded[..., s.start(r) : s.start(r) + s.sizes[r] + 2 * width, :]
    )
    torch.testing.assert_close(dp.HaloExchange.trim(got, width, width), shard_tensor(full))


def test_shard_batch_cuts_4d_and_5d_entries_and_leaves_the_rest(manager):
    batch = {"x": rand((1, 2, 3, H, W), 1), "y": rand((1, 2, H, W), 2), "t": torch.tensor(3)}
    out = dp.shard_batch(batch, spatial_dims_5d=-2, spatial_dims_4d=-1)
    torch.testing.assert_close(out["x"], shard_tensor(batch["x"], -2))
    torch.testing.assert_close(out["y"], shard_tensor(batch["y"], -1))
    assert out["t"] is batch["t"]


def test_validate_sharding_constraints_has_no_window_constraint(manager):
    assert dp.validate_sharding_constraints(serial_net(), 3, [4, (8, 8)]) == []
    with pytest.raises(ConfigError):
        dp.validate_sharding_constraints(serial_net(), 3, [0])


def test_manager_properties_are_credits(manager):
    m = manager.manager
    assert (manager.domain_world_size, manager.dp_world_size) == (WORLD, 1)
    assert manager.domain_rank == m.domain_rank and manager.dp_rank == 0
    assert manager.is_first_domain_rank == (m.domain_rank == 0)
    assert manager.is_last_domain_rank == (m.domain_rank == WORLD - 1)
    assert tuple(manager.neighbor_ranks()) == tuple(m.neighbor_ranks())
    assert dp.get_domain_parallel_manager() is manager
    with pytest.raises(ConfigError, match="domain groups of"):
        dp.DomainParallelManager(WORLD * 2, WORLD * 2)


@pytest.mark.parametrize("five_d", [False, True])
def test_unpad_shard_interp_returns_the_partition_band(manager, five_d):
    pad = types.SimpleNamespace(pad_NS=(2, 1), pad_WE=(1, 2))
    full = rand((1, 2, H, W), 9)
    padded = F.pad(full, (1, 2, 2, 1))
    band = shard_tensor(padded.unsqueeze(2) if five_d else padded)
    got = cp.unpad_shard_interp(band, pad, manager, H, W)
    want = shard_tensor(full)
    torch.testing.assert_close(got, want.unsqueeze(2) if five_d else want)
    with pytest.raises(ConfigError, match="check padding_opt"):
        cp.unpad_shard_interp(band, pad, manager, H + 1, W)


def test_raw_model_and_domain_manager_lookups(manager):
    model = cp.apply_domain_parallel(serial_net(), manager.manager)
    assert (
        cp.get_domain_manager(types.SimpleNamespace(module=model)) is model._domain_parallel_manager
    )
    assert (
        cp.get_raw_model(types.SimpleNamespace(module=types.SimpleNamespace(module=model))) is model
    )
    torch.testing.assert_close(
        cp.shard_spatial(rand((1, 1, H, W), 1), manager), shard_tensor(rand((1, 1, H, W), 1))
    )
