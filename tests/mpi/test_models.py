"""Whole models converted with convert_to_domain_parallel: output and every gradient equal the
serial model's; state_dicts move between the serial and the converted model; what cannot be
converted is refused with its path."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.models import PatchEmbedRecover, PeriodicResBlock, WeatherUNet
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


def rand(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=F64)


def converted(serial, manager):
    return mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)


def randomise(model, seed):
    """Non-trivial weights everywhere (GroupNorm's identity init would hide affine errors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model


@pytest.mark.parametrize("h", [37, 45])
def test_unet(manager, h):
    serial = randomise(WeatherUNet(3, 2, (h, 12), width=4).to(F64), 1)
    dist = converted(serial, manager)
    assert isinstance(dist.down1[0], mpidp.DomainParallelPeriodicConv2d)  # across the poles
    assert isinstance(dist.up1[0].up, mpidp.DomainParallelInterpolate)  # longitude wrapped
    assert type(dist.head) is nn.Conv2d  # 1x1: left alone
    assert_matches_serial(
        serial, dist, [rand((2, 3, h, 12), h)], manager=manager, modules=(serial, dist)
    )


@pytest.mark.parametrize("pole", ["polar", "polar_half", "reflect"])
def test_periodic_block(manager, pole):
    serial = randomise(PeriodicResBlock(4, pole=pole).to(F64), 2)
    dist = converted(serial, manager)
    assert isinstance(dist.conv1, mpidp.DomainParallelPeriodicConv2d)
    assert_matches_serial(
        serial, dist, [rand((2, 4, 2 * WORLD + 11, 8), 3)], manager=manager, modules=(serial, dist)
    )


@pytest.mark.parametrize("h", [37, 45])
def test_patch_embedding_and_recovery(manager, h):
    serial = randomise(PatchEmbedRecover(3, 8, (h, 16), patch=4).to(F64), 4)
    dist = converted(serial, manager)
    assert_matches_serial(
        serial, dist, [rand((2, 3, h, 16), 5)], manager=manager, modules=(serial, dist)
    )


def test_state_dict_moves_between_serial_and_converted(manager):
    serial = randomise(WeatherUNet(2, 2, (37, 8), width=4).to(F64), 6)
    dist = converted(serial, manager)
    assert list(dist.state_dict()) == list(serial.state_dict())
    fresh = WeatherUNet(2, 2, (37, 8), width=4).to(F64)
    fresh.load_state_dict(dist.state_dict())  # a converted checkpoint into the serial model
    back = converted(WeatherUNet(2, 2, (37, 8), width=4).to(F64), manager)
    back.load_state_dict(serial.state_dict())  # and the reverse
    for a, b in zip(fresh.state_dict().values(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.TransformerEncoderLayer(4, 1, dim_feedforward=8)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)


class Odd(nn.Module):
    def forward(self, x):
        return torch.fft.rfft2(x).real


class BandSequential(nn.Sequential):
    """A container whose forward is written for bands (its children see plain bands)."""

    _mpidp_band_forward = True


def test_unsupported_modules_listed_with_paths(manager):
    """In a forward written for bands, modules with no band form are refused, listed with
    their paths; in a forward that runs on ShardedTensors (every other model) they run their
    own forward op by op."""
    parts = (nn.Conv2d(2, 4, 3, padding=1), Attention(), nn.Flatten(), Odd())
    verdicts = {v.path: v for v in mpidp.explain_conversion(nn.Sequential(*parts), manager)}
    for path in ("1.attn", "2", "3"):
        assert verdicts[path].action == "left" and "op by op" in verdicts[path].why, path
    model = BandSequential(*parts)
    before = copy.deepcopy(model)
    with pytest.raises(mpidp.ConfigError) as err:
        mpidp.convert_to_domain_parallel(model, manager)
    text = str(err.value)
    assert text.startswith(f"rank {manager.rank}: convert_to_domain_parallel: 3 module(s)")
    for path in ("1.attn (TransformerEncoderLayer)", "2 (Flatten)", "3 (Odd)"):
        assert path in text, text
    assert "custom_converters" in text
    assert type(model[0]) is nn.Conv2d  # nothing changed on refusal
    assert list(model.state_dict()) == list(before.state_dict())


def test_custom_converter_and_safe(manager):
    seen = []

    def convert_attention(module, m):
        seen.append((type(module).__name__, m))
        return module

    model = nn.Sequential(Attention(), Odd(), nn.Conv2d(2, 2, 3, padding=1))
    mpidp.convert_to_domain_parallel(
        model, manager, custom_converters={Attention: convert_attention}, safe=["1"]
    )
    assert seen == [("Attention", manager)]
    assert type(model[0].conv) is nn.Conv2d  # children of a converted module are not visited
    assert isinstance(model[2], mpidp.DomainParallelConv2d)


def test_deepcopy_of_a_converted_model_shares_the_manager(manager):
    """EMA copies and the dry run deep-copy converted models: the copy computes the same and
    uses the same communicators (found by the docs' own example)."""
    m = manager
    model = mpidp.convert_to_domain_parallel(WeatherUNet(2, 2, (13, 8)), m)
    twin = copy.deepcopy(model)
    assert twin.inc[0].dp_manager is model.inc[0].dp_manager
    full = torch.randn(1, 2, 13, 8, generator=torch.Generator().manual_seed(4))
    band = full[..., m.spec(13).slice(m.domain_rank), :]
    assert torch.equal(twin(band), model(band))  # the copy computes the same
    report = mpidp.validate_sharding_constraints(model, (1, 2, 13, 8), m)
    assert report.ok and len(report.layers) == 15


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv2d(2, 3, 3, padding=1),
        lambda: nn.GroupNorm(1, 2),
        lambda: nn.Upsample(size=(25, 16), mode="bilinear"),
    ],
    ids=["conv", "groupnorm", "upsample"],
)
def test_a_bare_layer_is_converted_as_a_whole(manager, make):
    """convert_to_domain_parallel(nn.Conv2d(...)) returns the wrapper (it cannot replace the
    root in place); the result matches the serial layer (found by the docs' own example)."""
    torch.manual_seed(0)
    serial = make().double()
    dp = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    assert dp is not serial
    x = torch.randn(2, 2, 13, 8, dtype=torch.float64)
    assert_matches_serial(serial, dp, [x], manager=manager, modules=(serial, dp))


def _saved_bytes(model, x):
    """Bytes of the storages autograd saves in model(x), each counted once, parameters and
    buffers left out (model state, not activations; what bench/memory.py measures)."""
    state = [*model.parameters(), *model.buffers()]
    params = {p.untyped_storage().data_ptr() for p in state}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values())


@pytest.mark.parametrize(
    "name, h, within",
    [("unet", 46, 0.05), ("afno", 48, 0.10), ("swin", 44, 0.05)],
)
def test_plan_predicts_the_bytes_saved_for_backward(manager, name, h, within):
    """mpidp plan's activation bytes for this rank against what autograd really saves on it
    (issue 23 asks for 10%): the U-Net to 5% (the estimate follows every halo-extended band;
    it misses a few KB of the converted norms' statistics, 2-3% of this small grid, 0.05% of
    184 x 360 in bench/memory.py), the AFNO model (spectra in the transposed layout, by W
    modes) to 10%, the Swin-style model (whole windows inside the attention; 11 token rows, so
    windows straddle the bands) to 5%. At one rank, exactly the serial model's."""
    from mpidp.models import AFNONet, SwinNet
    from mpidp.preflight.plan import plan_model

    torch.manual_seed(0)
    grid = (h, 24)
    make = {
        "unet": lambda: WeatherUNet(3, 3, grid, width=4),
        "afno": lambda: AFNONet(3, 3, grid, patch=4, embed_dim=16, depth=2),
        "swin": lambda: SwinNet(3, 3, grid, patch=4, embed_dim=16, heads=2, window=(4, 3)),
    }[name]
    serial = make()
    dist = converted(serial, manager)
    spec = manager.spec(h)
    x = torch.randn(1, 3, spec.sizes[manager.domain_rank], grid[1])
    got = _saved_bytes(dist, x)
    want = plan_model(make(), (1, 3, *grid), WORLD).ranks[manager.domain_rank].activation_bytes
    assert abs(got - want) <= within * got, (got, want)
    if WORLD == 1:
        assert got == want == _saved_bytes(serial, x)


# Once, at 3 ranks (first and last bands and an interior one; the quick tier's count): what
# dynamo compiles does not depend on the rank count (the layers are opaque to it), and each
# run compiles on every rank: the slowest test of the 3-rank stage (178 s of its 1531 s, at a
# load of 25). At one rank the layers are their torch modules.
@pytest.mark.skipif(WORLD != 3, reason="torch.compile is checked at 3 ranks")
def test_torch_compile_runs_and_matches_serial(manager):
    """torch.compile of a converted model (dynamo and AOT autograd; the domain-parallel layers
    are opaque to dynamo, the code between them is compiled): output and every gradient equal
    the serial model's. The aot_eager backend traces what inductor would compile without a C++
    build (bench/compile.py runs inductor on the U-Net)."""
    torch._dynamo.reset()
    serial = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 2, 3, 2, 1)
    )
    serial = randomise(serial.to(F64), 5)
    dist = converted(serial, manager)
    comp = torch.compile(dist, backend="aot_eager")
    x = rand((2, 2, 13, 8), 6)
    assert_matches_serial(serial, comp, [x], manager=manager, modules=(serial, dist))
