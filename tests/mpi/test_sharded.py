"""ShardedTensor: every handled op against serial torch, float64, forward, the input's gradient
and every parameter's gradient (after sync_gradients), on balanced, weighted, thin and
empty-first partitions, over the MPI transport and (a subset) torch.distributed's gloo.

Each case is ``op(x)`` for a function written as for one process: ``op(shard(full))`` must
report the serial shape, hold the serial values (``full_tensor()``), and a loss ``(y * w).sum()``
with a plain weight ``w`` of the global shape (cut to the bands by the broadcasting rule) must
give every rank the serial loss and the serial gradient of its rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.sharded import ShardedTensor, UnsupportedOp, shard
from tests.mpi.helpers import check_sharded as check
from tests.mpi.helpers import rand

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()
F64 = torch.float64


def cuts(p: int) -> dict[str, mpidp.PartitionPolicy]:
    if p == 1:
        return {"balanced": mpidp.Balanced()}
    return {
        "balanced": mpidp.Balanced(),
        "weighted": mpidp.Weighted(tuple(range(p, 0, -1))),
        "thin": mpidp.Weighted((1,) * (p - 1) + (3 * p,)),
    }


@pytest.fixture(scope="module")
def managers():
    """One manager per transport: MPI, and torch.distributed (gloo)."""
    with (
        mpidp.DistributedManager(domain_parallel_size=WORLD, transport="mpi") as by_mpi,
        mpidp.DistributedManager(domain_parallel_size=WORLD, transport="torch") as by_gloo,
    ):
        yield {"mpi": by_mpi, "gloo": by_gloo}


# every cut over MPI; gloo (the partitions are the transport's clients) the balanced one
CASES = [("mpi", c) for c in cuts(WORLD)] + [("gloo", "balanced")]


@pytest.fixture(params=CASES, ids=[f"{t}-transport-{c}" for t, c in CASES])
def m(request, managers):
    """A manager whose partition policy is one of the cuts (inputs and every op's output)."""
    transport, cut = request.param
    sm = managers[transport]
    old, sm.partition = sm.partition, cuts(WORLD)[cut]
    yield sm
    sm.partition = old


def _layer(make):
    torch.manual_seed(3)
    return make().to(F64)


H = 2 * WORLD + 5  # uneven at every rank count; thin cuts give single rows


def field(shape=(2, 3, H, 8), seed=1):
    return rand(shape, seed)


# -- element-wise ---------------------------------------------------------------------------------

LAT = rand((H, 1), 11)
CHAN = rand((3, 1, 1), 12)

POINTWISE = {
    "affine": lambda x: x * 2 + 1,
    "tanh_gelu": lambda x: F.gelu(torch.tanh(x)),
    "latitude_weights": lambda x: x * LAT,
    "channel_bias": lambda x: x + CHAN,
    "where": lambda x: torch.where(x > 0, x, 0.1 * x),
    "clamp_pow": lambda x: x.clamp(-0.5, 0.5).pow(3) + x / (1 + x**2),
    "two_bands": lambda x: torch.maximum(x, x.sin()) * x.exp(),
    "in_place": lambda x: (x * 1).mul_(2).add_(LAT),
    "rsub_rdiv": lambda x: 1 - 2 / (3 + x * x),
    "lerp_complex": lambda x: torch.lerp(x, x.cos(), 0.3) + torch.complex(x, x.sin()).abs(),
}


@pytest.mark.parametrize("name", list(POINTWISE))
def test_pointwise(m, name):
    check(m, POINTWISE[name], field())


def test_a_wrong_length_along_the_sharded_dim_is_refused(m):
    x = shard(field(), 2, m)
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: .*has {H - 1} entries along"):
        x * rand((H - 1, 1), 3)


# -- reductions -----------------------------------------------------------------------------------

REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "mean": lambda x: x.mean(),
    "sum_h": lambda x: x.sum(dim=2),
    "nansum_nanmean": lambda x: x.nansum((1, 2)) + x.nanmean(),
    "mean_hw_keepdim": lambda x: x.mean((2, 3), keepdim=True),
    "sum_local": lambda x: x.sum(dim=1),
    "mean_local": lambda x: x.mean(-1, keepdim=True),
    "amax": lambda x: x.amax(),
    "amin_h": lambda x: x.amin(dim=2),
    "max": lambda x: torch.max(x),
    "max_local_dim": lambda x: x.max(dim=3).values,
    "var": lambda x: x.var(),
    "std_hw": lambda x: x.std(dim=(2, 3), correction=0),
    "norm": lambda x: x.norm(),
    "norm_p1_h": lambda x: torch.norm(x, p=1, dim=2),
    "vector_norm_inf": lambda x: torch.linalg.vector_norm(x, float("inf"), dim=(2, 3)),
    "logsumexp": lambda x: x.logsumexp((2, 3)),
    "softmax_h": lambda x: F.softmax(x, dim=2),
    "log_softmax_w": lambda x: x.log_softmax(dim=3),
    "latitude_weighted_mse": lambda x: ((x - 0.5) ** 2 * LAT).mean(),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions(m, name):
    check(m, REDUCTIONS[name], field())


def test_ties_share_the_gradient_as_torch_does(m):
    """amax over entries equal on several ranks: torch splits the gradient evenly."""
    full = torch.zeros(1, 1, H, 2, dtype=F64)
    full[0, 0, ::2, 0] = 3.0
    check(m, lambda x: x.amax() * 2, full)


def test_all_any_count(m):
    full = field()
    x = shard(full, 2, m)
    assert bool((x > 2.5).any()) == bool((full > 2.5).any())
    assert bool((x > -9).all())
    assert int(torch.count_nonzero(x > 0)) == int(torch.count_nonzero(full > 0))


# -- shapes ---------------------------------------------------------------------------------------

B, C, W = 2, 3, 8
IDX = torch.tensor([H - 1, 0, 3, 3, 1, H // 2])
SHAPES = {
    "flatten_tokens": lambda x: x.flatten(2).transpose(1, 2),
    "view_merge": lambda x: x.view(B, C, H * W) * 2,
    "unsqueeze_permute": lambda x: x.unsqueeze(2).permute(0, 3, 2, 4, 1),
    "movedim_T": lambda x: x[0, 0].T.movedim(0, 1),
    "slice": lambda x: x[..., 2:-1, :],
    "slice_step": lambda x: x[:, :, 1::2, 1:5],
    "int_row": lambda x: x[:, :, 3] * 2,
    "narrow": lambda x: x.narrow(2, 1, H - 3),
    "select": lambda x: x.select(2, H - 1),
    "roll_h": lambda x: x.roll(3, 2),
    "roll_both": lambda x: torch.roll(x, (-2, 1), (2, 3)),
    "flip": lambda x: x.flip(2, 3),
    "index_select": lambda x: x.index_select(2, IDX),
    "cat_stack": lambda x: torch.stack([torch.cat([x, x * 2], 1), torch.cat([x.flip(2), x], 1)], 1),
    "chunk_split": lambda x: (
        torch.cat(x.chunk(2, dim=3)[::-1], 3) + x.split([1, 2], dim=1)[1].sum(1, keepdim=True)
    ),
    "expand_repeat": lambda x: x[:, :1].expand(B, 4, H, W) + x.repeat(1, 2, 1, 1)[:, :4],
    "squeeze": lambda x: x[:, :1].squeeze(1).unsqueeze(0).squeeze(),
    "tensor_split_unbind": lambda x: torch.stack(x.unbind(1), 3).tensor_split(2, dim=3)[1],
    "unflatten": lambda x: (
        x.flatten(2, 3).unflatten(2, (H, W)) + x.flatten(0, 1).unflatten(0, (B, C))
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(m, name):
    check(m, SHAPES[name], field())


def test_patch_reshape_moves_only_to_an_aligned_partition(m):
    """H = 4 * k rows split as (H/4, 4) patches: local when the band boundaries are multiples
    of 4, after a move to the nearest such partition otherwise; and back."""
    h = 4 * (WORLD + 2)
    full = rand((2, 3, h, 8), 4)

    def patches(x):
        p = x.reshape(2, 3, h // 4, 4, 4, 2).permute(0, 2, 4, 1, 3, 5)
        return p.reshape(2, h // 4, 4, 24).flatten(1, 2) * 1.5

    y = check(m, patches, full)
    assert y.shard_dim == 1

    def back(x):
        p = patches(x).reshape(2, h // 4, 4, 3, 4, 2).permute(0, 3, 1, 4, 2, 5)
        return p.reshape(2, 3, h, 8)

    check(m, back, full)


# -- products -------------------------------------------------------------------------------------

WC = rand((C, 4), 13)
WH = rand((H,), 14)
WLIN = None  # made per test, the same on every rank (see test_products)
PRODUCTS = {
    "linear_last_dim": lambda x: WLIN(x),
    "matmul": lambda x: x @ rand((W, 4), 15),
    "matmul_rows": lambda x: rand((4, C), 16) @ x.transpose(1, 2),
    "einsum_channels": lambda x: torch.einsum("bchw,cd->bdhw", x, WC),
    "einsum_contracts_h": lambda x: torch.einsum("bchw,h->bcw", x, WH),
    "gram_over_tokens": lambda x: x.flatten(2) @ x.flatten(2).transpose(1, 2),
    "attention_written_out": lambda x: _attention(x, explicit=True),
    "sdpa": lambda x: _attention(x),
    "sdpa_causal": lambda x: _attention(x, is_causal=True),
    "sdpa_additive_mask": lambda x: _attention(x, mask=rand((H * W, H * W), 20)),
    "sdpa_ulysses_uneven_heads": lambda x: _attention(x, heads=WORLD + 3),
    "sdpa_ulysses_causal_per_head_mask": lambda x: _attention(
        x, heads=WORLD + 1, is_causal=False, mask=rand((1, WORLD + 1, H * W, H * W), 22)
    ),
}


def _attention(x, explicit=False, heads=2, **kw):
    """Global attention over the tokens of a field (ViT / ClimaX style): tokens cut by rows.
    With at least as many heads as ranks SDPA runs Ulysses-style (heads moved, uneven), with
    fewer it gathers the keys and values."""
    t = x.flatten(2).transpose(1, 2)  # (B, H * W, C)
    wqkv = rand((C, 3 * 2 * heads), 21)
    q, k, v = (t @ wqkv).reshape(B, H * W, 3, heads, 2).permute(2, 0, 3, 1, 4)  # (B, h, N, 2)
    if explicit:
        y = (q @ k.transpose(-2, -1) * 0.7).softmax(-1) @ v
    else:
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=kw.get("mask"), is_causal=kw.get("is_causal", False)
        )
    return y.transpose(1, 2).reshape(B, H * W, 2 * heads)


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_products(m, name):
    global WLIN
    WLIN = _layer(lambda: nn.Linear(W, 5))
    check(m, PRODUCTS[name], field(), module=WLIN if name == "linear_last_dim" else None)


def test_a_product_of_bands_cut_along_unrelated_dims_is_refused(m):
    """Two bands whose product would be cut along two dims at once: refused, never guessed.
    (Contracting the sharded dim of both is the global sum: test_products' gram case.)"""
    x = shard(field(), 2, m)
    with pytest.raises(UnsupportedOp, match="a product that contracts the sharded dim"):
        x.transpose(2, 3) @ x.movedim(2, 0)


def test_products_check_the_plain_operands_batch_dims(m):
    """A plain operand's batch dim beside the bands must be the global length (cut to the
    rows) or 1: a length that happens to fit a band would otherwise pass silently."""
    full = field()
    check(m, lambda x: rand((1, C, H, 2, W), 17) @ x.unsqueeze(-1), full)
    x = shard(full, 2, m)
    with pytest.raises(UnsupportedOp, match=rf"has {H - 1} entries along the batch dim"):
        rand((1, C, H - 1, 2, W), 18) @ x.unsqueeze(-1)


def test_prelu_along_the_channels_is_refused(m):
    """PReLU's weight runs along the channels: bands cut along them are refused."""
    full = rand((2, 8, H, 4), 19)
    x = shard(full, 1, m, spec=mpidp.ShardSpec.balanced(8, WORLD))
    with pytest.raises(UnsupportedOp, match="bands along the channel dim"):
        F.prelu(x, torch.full((8,), 0.2, dtype=F64))


# -- layers ---------------------------------------------------------------------------------------


LAYERS = {
    "conv": (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, H, 8)),
    "conv_strided_dilated": (
        lambda: nn.Conv2d(3, 2, 3, stride=2, dilation=2, padding=2),
        (2, 3, H, 8),
    ),
    "conv_circular": (lambda: nn.Conv2d(3, 2, 3, padding=1, padding_mode="circular"), (2, 3, H, 8)),
    "conv_reflect_same": (
        lambda: nn.Conv2d(3, 2, 4, padding="same", padding_mode="reflect"),
        (2, 3, H, 8),
    ),
    "conv_transpose": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
        (2, 3, H, 8),
    ),
    "conv1d": (lambda: nn.Conv1d(3, 2, 5, padding=2), (2, 3, 3 * H)),
    "conv_transpose1d_pools1d": (
        lambda: nn.Sequential(
            nn.ConvTranspose1d(3, 2, 4, stride=2),
            nn.MaxPool1d(3, 2),
            nn.AvgPool1d(2),
            nn.AdaptiveAvgPool1d(H),
        ),
        (2, 3, 3 * H),
    ),
    "conv3d": (lambda: nn.Conv3d(3, 2, 3, padding=1), (1, 3, 3, H, 6)),
    "reflection_pad": (lambda: nn.ReflectionPad2d((1, 2, 2, 1)), (2, 3, H, 8)),
    "replication_pad": (lambda: nn.ReplicationPad2d(2), (2, 3, H, 8)),
    "constant_pad": (lambda: nn.ConstantPad2d((0, 1, 3, 1), 0.5), (2, 3, H, 8)),
    "maxpool": (lambda: nn.MaxPool2d(2), (2, 3, H, 8)),
    "avgpool_ceil": (lambda: nn.AvgPool2d(3, 2, padding=1, ceil_mode=True), (2, 3, H, 8)),
    "maxpool3d": (lambda: nn.MaxPool3d(2), (1, 2, 4, H, 6)),
    "adaptive_avg": (lambda: nn.AdaptiveAvgPool2d((H // 2, 3)), (2, 3, H, 8)),
    "adaptive_avg_global": (lambda: nn.AdaptiveAvgPool2d(1), (2, 3, H, 8)),
    "adaptive_max_few": (lambda: nn.AdaptiveMaxPool2d((1, 2)), (2, 3, H, 8)),
    "groupnorm": (lambda: nn.GroupNorm(3, 3), (2, 3, H, 8)),
    "instancenorm": (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, H, 8)),
    "batchnorm": (lambda: nn.BatchNorm2d(3), (2, 3, H, 8)),
    "layernorm_hw": (lambda: nn.LayerNorm((H, 8)), (2, 3, H, 8)),
    "layernorm_w": (lambda: nn.LayerNorm(8), (2, 3, H, 8)),
    "upsample_nearest": (lambda: nn.Upsample(scale_factor=2), (2, 3, H, 8)),
    "upsample_bilinear": (lambda: nn.Upsample(size=(2 * H + 1, 9), mode="bilinear"), (2, 3, H, 8)),
    "upsample_trilinear": (lambda: nn.Upsample(scale_factor=2, mode="trilinear"), (1, 2, 2, H, 4)),
    "pixel_shuffle": (lambda: nn.Sequential(nn.Conv2d(3, 8, 1), nn.PixelShuffle(2)), (2, 3, H, 8)),
    "pixel_unshuffle": (lambda: nn.PixelUnshuffle(2), (2, 3, 2 * H, 8)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers(m, name):
    make, shape = LAYERS[name]
    layer = _layer(make)
    dim = len(shape) - 1 if len(shape) == 3 else len(shape) - 2
    check(m, layer, rand(shape, 2), dim=dim, module=layer)


def test_pad_of_more_dims_than_the_layers_have(m):
    """F.pad of four dims of channels-last (B, Z, H, W, C) tokens, H sharded (Pangu pads Z,
    H and W): the pads of the dims before H are local, H's go through the pad layer."""
    check(m, lambda z: F.pad(z, [0, 0, 1, 0, 0, 2, 1, 1]), rand((1, 3, H, 6, 2), 3), dim=2)


def test_batchnorm_running_statistics(m):
    bn, ref = _layer(lambda: nn.BatchNorm2d(3)), _layer(lambda: nn.BatchNorm2d(3))
    full = field()
    bn(shard(full, 2, m))
    ref(full)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-12, atol=1e-14)


FFTS = {
    "rfft2_filter_irfft2": lambda x: torch.fft.irfft2(
        torch.fft.rfft2(x, norm="ortho") * (1 + 0.5j), s=(H, 8), norm="ortho"
    ),
    "fft2_abs": lambda x: torch.fft.fft2(x).abs(),
    "rfft_w_local": lambda x: torch.fft.rfft(x, dim=-1).real,
    "fft_along_h": lambda x: torch.fft.fft(x, dim=2).imag,
}


@pytest.mark.parametrize("name", list(FFTS))
def test_ffts(m, name):
    check(m, FFTS[name], field())


# -- the rules ------------------------------------------------------------------------------------


class FiLM(nn.Module):
    """A replicated value used on the band and on itself, a parameter used in both places."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        g = self.lin(x.mean(dim=(-2, -1)))
        y = self.conv(x) * g[..., None, None]
        return y + self.lin.bias.view(1, 3, 1, 1) + g.sum() * 0.1


def test_replicated_values_and_mixed_parameters(m):
    film = _layer(FiLM)
    check(m, film, field(), module=film)


def test_from_local_learns_the_spec_and_keeps_the_leaf(m):
    full = field()
    spec = m.spec(H)
    band = full[:, :, spec.slice(m.domain_rank)].clone().requires_grad_()
    x = ShardedTensor.from_local(band, dim=2, manager=m)
    assert x.spec == spec and tuple(x.shape) == tuple(full.shape)
    (x * LAT).sum().backward()
    assert band.grad is not None and x.grad.local is band.grad
    torch.testing.assert_close(band.grad, LAT[spec.slice(m.domain_rank)].expand_as(band))


def test_redistribute_moves_rows_and_dims(m):
    full = field()
    x = shard(full, 2, m).requires_grad_()
    sizes = [0] * WORLD
    sizes[-1] = H
    y = x.redistribute(spec=sizes)
    assert y.spec.sizes == tuple(sizes)
    z = y.redistribute(dim=3)
    assert z.shard_dim == 3
    torch.testing.assert_close(z.full_tensor().as_subclass(torch.Tensor), full)
    (z * 2).sum().backward()
    torch.testing.assert_close(x.grad.local, torch.full_like(x.local, 2.0))


def test_unhandled_ops_raise_everywhere_and_the_fallback_gathers(m):
    x = shard(field(), 2, m)
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: torch.cumsum\(ShardedTensor"):
        torch.cumsum(x, 2)
    mpidp.sharded.allow_fallback()
    try:
        with pytest.warns(UserWarning, match="no band form; gathering"):
            check(m, lambda t: torch.cumsum(t, 2), field())
    finally:
        mpidp.sharded.allow_fallback(False)


def test_dtensor_round_trip_on_torch_chunk_sizes(m):
    """to_dtensor moves the rows to DTensor's own (torch.chunk) cut first: full_tensor of the
    DTensor is the field; from_dtensor comes back to the manager's cut; gradients flow."""
    from torch.distributed.tensor import Shard

    full = field()
    x = shard(full, 2, m).requires_grad_()
    dt = x.to_dtensor()
    assert dt.placements == (Shard(2),) and tuple(dt.shape) == tuple(full.shape)
    assert dt.to_local().shape[2] == min(-(-H // WORLD), max(0, H - m.domain_rank * -(-H // WORLD)))
    torch.testing.assert_close(dt.full_tensor(), full)
    back = ShardedTensor.from_dtensor(dt * 3, m)
    assert back.spec == m.spec(H)
    (back * LAT).sum().backward()
    torch.testing.assert_close(
        x.grad.local, (3 * LAT).expand_as(full)[:, :, m.spec(H).slice(m.domain_rank)]
    )


def test_attention_moves_heads_when_there_are_enough_and_gathers_otherwise(m):
    """Ulysses when heads >= ranks: four all-to-alls (q, k, v there, the result back), no
    gather; with fewer heads the keys and values are gathered (two all-gathers)."""
    from mpidp.testing import count_traffic

    x = shard(field(), 2, m)
    with count_traffic(m) as traffic:
        _attention(x, heads=WORLD + 1)
    moved = dict(traffic.ops)
    with count_traffic(m) as traffic:
        _attention(x, heads=1)
    gathered = dict(traffic.ops)
    if WORLD > 1:
        assert moved.get("all_to_all_v", [0])[0] == 4 and "all_gather_v" not in moved, moved
        assert gathered.get("all_gather_v", [0])[0] == 2, gathered
    else:  # one rank: nothing to move
        assert moved.get("all_to_all_v", [0, 0])[1] == 0, moved
