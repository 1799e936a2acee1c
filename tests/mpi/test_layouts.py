"""Layouts that follow the band through a model's reshapes (issue 34): the batch rule (a
function that does not read across the sharded dim runs on each rank's part), and blocks (dims
merged before the band: windows folded into the batch, (Z, H, W) tokens).

Every case against the serial function, float64, uneven bands (and an empty one at 4 ranks):
output, input gradient, every parameter gradient; window transformers and 3-D token models
through both front ends (conversion and ShardedTensor); mutations that show it can fail."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.sharded import ShardedTensor, UnsupportedOp, shard
from mpidp.testing import assert_matches_serial
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


# -- the batch rule, one function at a time, on bands (dim 0) and on blocks ---------------------

W4 = rand((4, 3, 3, 3), 11).requires_grad_()
B4 = rand((4,), 12).requires_grad_()
LN = rand((6,), 13).requires_grad_()

CALLS = {
    "conv2d": lambda x: F.conv2d(x, W4[:, :3], B4, padding=1),
    "conv2d_1x1": lambda x: F.conv2d(x, W4[:, :3, :1, :1], B4),
    "conv2d_kernel_1_along_h": lambda x: F.conv2d(x, W4[:, :3, :1], B4, padding=(0, 1)),
    "conv_transpose2d": lambda x: F.conv_transpose2d(x, W4.transpose(0, 1)[:3], stride=2),
    "max_pool2d": lambda x: F.max_pool2d(x, 2),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 3, 1, 1),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, 2),
    "interpolate": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    "layer_norm": lambda x: F.layer_norm(x, (6,), LN),
    "group_norm": lambda x: F.group_norm(x, 3, LN[:3]),
    "normalize": lambda x: F.normalize(x, dim=1),
    "softmax": lambda x: torch.softmax(x, -1),
    "cumsum": lambda x: torch.cumsum(x, dim=-1),
    "sort": lambda x: torch.sort(x, -1)[0],
    "topk": lambda x: x.topk(2, -2)[0],
    "argmax": lambda x: x[..., 0] * torch.argmax(x, dim=-1),
    "flip": lambda x: x.flip(-1, -2),
    "roll": lambda x: torch.roll(x, 2, -1),
    "pad_reflect": lambda x: F.pad(x, (1, 1, 2, 2), mode="reflect"),
    "pixel_unshuffle": lambda x: F.pixel_unshuffle(x, 2),
    "unfold": lambda x: F.unfold(x, 3, padding=1),
    "rfft2": lambda x: torch.view_as_real(torch.fft.rfft2(x)),
    "linear": lambda x: F.linear(x, LN[:6].reshape(1, 6).expand(2, 6)),
    "sdpa": lambda x: F.scaled_dot_product_attention(x, x * 0.5, x.flip(-1)),
}


@pytest.mark.parametrize("name", ["conv2d_1x1", "conv2d_kernel_1_along_h"])
def test_a_convolution_that_maps_rows_to_themselves_runs_on_two_rows_at_any_p(m, name):
    """Kernel 1, stride 1, no padding along the band: each row is its own; 2 rows at 3-4
    ranks (empty bands) need no partition of the output (CrossFormer's 1x1 projections)."""
    from mpidp.runtime.partition import ShardSpec

    call = CALLS[name]
    full = rand((2, 3, 2, 6), 1)
    sizes = [1, 1] + [0] * (WORLD - 2) if WORLD > 1 else [2]
    x = shard(full, 2, m, spec=ShardSpec(tuple(sizes))).requires_grad_()
    torch.testing.assert_close(call(x).full_tensor().as_subclass(torch.Tensor), call(full))


@pytest.mark.parametrize("name", list(CALLS))
def test_a_function_that_treats_the_sharded_dim_as_a_batch_equals_serial(m, name):
    """Sharded along dim 0 (13 samples: uneven, empty parts at 4 ranks past 13 rows)."""
    call = CALLS[name]
    check_sharded(m, call, rand((13, 3, 6, 6), 1), dim=0, **TOL)


@pytest.mark.parametrize("k", [-1, 1, 2, 3])
def test_rot90_equals_serial(m, k):
    """A quarter turn carries the band to the other dim; a conv then runs on it there."""

    def fn(x):
        return F.conv2d(torch.rot90(x, k, (2, 3)), W4[:, :3], B4, padding=1)

    check_sharded(m, fn, rand((2, 3, 13, 7), 4), dim=2, **TOL)


@pytest.mark.parametrize(
    "pad", [(0, 0, 0, 12), (0, 0, 9, 2), (1, 2, 7, 7)], ids=["past", "before", "both"]
)
def test_a_pad_wider_than_the_field_equals_serial(m, pad):
    """FNO pads a small spectral dim past its whole size: zero rows from no rank."""
    check_sharded(m, lambda x: F.pad(x, pad), rand((2, 3, 5, 4), 3), dim=2, **TOL)


@pytest.mark.parametrize("name", ["conv2d", "layer_norm", "softmax", "sdpa", "interpolate"])
def test_the_batch_rule_on_blocks_equals_serial(m, name):
    """The sharded dim holds 2 blocks (a (2, 13) pair of dims merged into 26)."""
    call = CALLS[name]

    def fn(x):
        y = call(x.reshape(26, 3, 6, 6))
        return y.reshape(2, 13, *y.shape[1:])

    check_sharded(m, fn, rand((2, 13, 3, 6, 6), 2), dim=1, **TOL)


@pytest.mark.mpi(min_size=2)  # one rank holds every row: no halo to forget
def test_a_rule_that_claims_too_little_fails_the_comparison(m, monkeypatch):
    """Mutation: the convolution's rule forgets the spatial dims; a band along H then
    convolves without its halo, and the comparison sees it."""
    from mpidp.sharded import batch

    monkeypatch.setitem(batch.READS, F.conv2d, (lambda a, k, nd: ({1}, ()), ()))
    with pytest.raises(AssertionError):
        check_sharded(m, CALLS["conv2d"], rand((2, 3, 13, 6), 1), dim=2, **TOL)


def test_blocks_rows_of_a_plain_tensor_are_the_strided_ones(m, monkeypatch):
    """Mutation: a plain tensor of the global length cut as if the dim were one band gives
    other rows than serial, and the comparison sees it."""
    full, weight = rand((2, 13, 4), 1), rand((26, 1), 2)

    def fn(x):
        return (x.reshape(26, 4) * weight).reshape(2, 13, 4)

    check_sharded(m, fn, full, dim=1, **TOL)
    if WORLD == 1:
        return
    monkeypatch.setattr(
        ShardedTensor,
        "rows_of",
        lambda self, t, d: t.narrow(d, self.start * self.blocks, self.local.size(self.shard_dim)),
    )
    with pytest.raises(AssertionError):
        check_sharded(m, fn, full, dim=1, **TOL)


@pytest.mark.mpi(min_size=2)  # one rank: every reshape is its own layout
def test_a_reshape_with_no_band_layout_is_refused_on_every_rank(m):
    x = shard(rand((2, 13, 4), 1), 1, m)
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: .*no rank's part"):
        x.reshape(13, 2, 4)


@pytest.mark.mpi(min_size=2)  # one rank: no blocks
def test_a_function_that_reads_across_blocks_is_refused(m):
    x = shard(rand((2, 13, 4), 1), 1, m).reshape(26, 4)
    assert x.blocks == 2
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: .*in 2 blocks.*holds blocks"):
        x.sum(0)
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: torch.cumsum"):
        torch.cumsum(x, 0)


# -- window transformers and 3-D tokens, unchanged models --------------------------------------


def window_partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, c)


def window_reverse(windows: torch.Tensor, ws: int, h: int, w: int) -> torch.Tensor:
    b = int(windows.shape[0] / (h * w / ws / ws))
    x = windows.view(b, h // ws, w // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, -1)


class WindowBlock(nn.Module):
    """A Swin block as timm and PhysicsNeMo write it: shifted windows folded into the batch,
    a relative bias, the shift mask, cosine attention (F.normalize), a convolution on each
    window (the batch rule on dim 0), the residual."""

    def __init__(self, c: int, hw: tuple[int, int], ws: int, shift: int, heads: int = 2) -> None:
        super().__init__()
        self.c, self.hw, self.ws, self.shift, self.heads = c, hw, ws, shift, heads
        self.norm = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.local_conv = nn.Conv2d(c, c, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(heads, ws * ws, ws * ws) * 0.1)
        self.scale = nn.Parameter(torch.ones(heads, 1, 1) * 3.0)
        h, w = hw
        mask = torch.zeros(1, h, w, 1)
        if shift:
            cuts = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
            for i, (hs, wsl) in enumerate((a, b) for a in cuts for b in cuts):
                mask[:, hs, wsl, :] = i
        win = window_partition(mask, ws).view(-1, ws * ws)
        diff = win.unsqueeze(1) - win.unsqueeze(2)
        self.register_buffer("mask", diff.ne(0).double() * -100.0, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        _, c, h, w = x.shape
        assert (h, w) == self.hw, (h, w)
        t = x.permute(0, 2, 3, 1)
        shortcut = t
        t = self.norm(t)
        if self.shift:
            t = torch.roll(t, (-self.shift, -self.shift), dims=(1, 2))
        win = window_partition(t, self.ws)  # (B*nW, ws, ws, C)
        win = win + self.local_conv(win.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        n = self.ws * self.ws
        tokens = win.view(-1, n, c)
        qkv = self.qkv(tokens).reshape(-1, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * self.scale + self.bias.unsqueeze(0)
        nw = self.mask.shape[0]
        attn = attn.view(-1, nw, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, n, n).softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(-1, n, c)
        out = self.proj(out).view(-1, self.ws, self.ws, c)
        t = window_reverse(out, self.ws, h, w)
        if self.shift:
            t = torch.roll(t, (self.shift, self.shift), dims=(1, 2))
        return (shortcut + t).permute(0, 3, 1, 2)


class Swin(nn.Module):
    def __init__(self, hw: tuple[int, int]) -> None:
        super().__init__()
        self.embed = nn.Conv2d(2, 4, 3, padding=1)
        self.blocks = nn.Sequential(WindowBlock(4, hw, 4, 0), WindowBlock(4, hw, 4, 2))
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


class Tokens3D(nn.Module):
    """Pangu/FengWu style: (B, C, Z, H, W) fields flattened to (B, Z*H*W, C) tokens, a
    token MLP and norm, back to the field, a 3-D convolution across the bands."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv3d(2, c, 1)
        self.norm = nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.mix = nn.Conv3d(c, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, z, h, w = x.shape
        f = self.embed(x).permute(0, 2, 3, 4, 1)  # (B, Z, H, W, C)
        tokens = f.reshape(b, z * h * w, -1)
        tokens = tokens + self.mlp(self.norm(tokens))
        f = tokens.reshape(b, z, h, w, -1).permute(0, 4, 1, 2, 3)
        return self.mix(f)


MODELS = {
    "swin_20": (lambda: Swin((20, 8)), (2, 2, 20, 8)),
    "swin_12": (lambda: Swin((12, 8)), (2, 2, 12, 8)),  # 3 window rows: an empty band at 4
    "tokens_3d": (lambda: Tokens3D(), (2, 2, 3, 13, 6)),
}


def _build(name: str) -> tuple[nn.Module, torch.Tensor]:
    make, shape = MODELS[name]
    torch.manual_seed(5)
    return make().to(F64), rand(shape, 7)


@pytest.mark.parametrize("name", list(MODELS))
def test_an_unchanged_model_on_sharded_tensors_equals_serial(m, name):
    model, full = _build(name)
    check_sharded(m, model, full, dim=full.dim() - 2, module=model, **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_an_unchanged_model_through_conversion_equals_serial(m, name):
    serial, full = _build(name)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert_matches_serial(serial, dist, [full], manager=m, modules=(serial, dist), **TOL)


def test_einsum_of_operands_sharded_along_different_letters_equals_serial(m):
    """CrossFormer's long-range attention: q and k both cut along their tokens; the scores
    keep q's rows and gather k, the values are gathered for the contraction."""
    full = rand((2, 2, 13, 4), 8)

    def attention(x):
        q, k, v = x, x * 0.5 + 1.0, x.flip(-1)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k).softmax(-1)
        return torch.einsum("b h i j, b h j d -> b h i d", sim, v)

    check_sharded(m, attention, full, dim=2, **TOL)


def test_a_plain_tensor_expanded_as_a_band_equals_serial(m):
    """torch_geometric's scatter: ``src.view(size).expand_as(ref)`` with the band second."""
    weight = rand((1, 3, 13, 1), 9)

    def fn(x):
        return x * weight.expand_as(x) + rand((1, 1, 1, 4), 10).expand_as(x)

    check_sharded(m, fn, rand((2, 3, 13, 4), 8), dim=2, **TOL)


class Windows(nn.Module):
    """Windows of 4 rows folded into the batch, a token map, back, the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):  # (B, H, W, C)
        _, h, w, _ = x.shape
        return x + window_reverse(self.lin(window_partition(x, 4)), 4, h, w)


def test_windows_move_only_the_rows_that_straddle_the_bands(m):
    """Per step, each rank sends the rows of its band that lie in another rank's windows
    (to the window-aligned cut: every boundary at the nearest multiple of 4) and receives
    the rows of its windows held elsewhere; the residual moves them back, the backward both
    ways again: 2 * (sent + received) rows, nothing else."""
    from mpidp.testing import count_traffic

    b, h, w, c = 2, 21, 8, 3
    torch.manual_seed(0)
    model = Windows().to(F64)
    full = rand((b, h, w, c), 1)[:, :20]  # 5 window rows
    spec = m.spec(20)
    cuts = [0, *[min(max((o + 2) // 4 * 4, 0), 20) for o in spec.offsets[1:]], 20]
    aligned = [(cuts[r], cuts[r + 1]) for r in range(WORLD)]
    mine = set(range(spec.start(m.rank), spec.stop(m.rank)))
    window_rows = set(range(*aligned[m.rank]))
    rows = 2 * (len(mine - window_rows) + len(window_rows - mine))
    x = shard(full, 1, m).requires_grad_()
    with count_traffic(m) as traffic:
        y = model(x)
        y.backward(shard(rand(tuple(full.shape), 2), 1, m))
    moved = traffic.ops.get("all_to_all_v", [0, 0])[1]
    assert moved == rows * b * w * c * 8, (traffic.ops, rows)
    assert set(traffic.ops) <= {"all_to_all_v"}, traffic.ops


def test_indexing_other_dims_of_blocks_equals_serial(m):
    """Pangu's attention: qkv = linear(windows).reshape(...).permute(3, 0, ...) puts the
    blocks in dim 3; qkv[0], qkv[1] index the dim before them."""
    weight = rand((24, 8), 4)

    def fn(x):  # (B, Pl, Lat, N, C): Pl and Lat windows merged, the band in Lat
        b, pl, lat, n, c = x.shape
        t = F.linear(x.reshape(b, pl * lat, n, c), weight)
        qkv = t.reshape(b, pl * lat, n, 3, 2, 4).permute(3, 0, 4, 1, 2, 5)
        q, k = qkv[0], qkv[1, :, :]
        attn = (q @ k.transpose(-2, -1)).softmax(-1)
        return (attn @ qkv[2]).reshape(b, 2, pl, lat, n, 4)

    check_sharded(m, fn, rand((2, 3, 7, 5, 8), 5), dim=2, **TOL)


def test_bands_cut_along_different_dims_meet_through_the_transpose(m):
    """DLWP's cubed-sphere padding: a rotated face (its band now along W) joins and is added
    to faces cut along H: the rotated one is transposed back to H's cut."""

    def fn(x):
        turned = torch.rot90(x, 1, (2, 3))  # (B, C, 13, 13): the band along W now
        strip = torch.rot90(x[..., -1:], 1, (2, 3))  # one row: the band along W of 13
        halo = torch.cat([strip, x, strip.flip(-1)], dim=-2)  # DLWP's face-edge padding
        mixed = torch.cat([x, turned], dim=-2) * 2.0 + torch.cat([turned, x], dim=-1).mT
        return torch.cat([mixed, halo], dim=-2)

    check_sharded(m, fn, rand((2, 3, 13, 13), 6), dim=2, **TOL)


def test_a_sharded_dim_of_one_row_reshapes(m):
    """The deepest level of a multi-scale model: one row left (on one rank), reshaped as the
    windows of the upper levels were (CrossFormer's last stage)."""
    from mpidp.runtime.partition import ShardSpec

    full = rand((2, 6, 1, 2), 3)
    sizes = (1,) + (0,) * (WORLD - 1)

    def fn(x):
        return (x.reshape(2, 6, 1, 1, 2, 1) * 2.0).reshape(2, 6, 1, 2)

    x = shard(full, 2, m, spec=ShardSpec(sizes)).requires_grad_()
    y = fn(x)
    torch.testing.assert_close(y.full_tensor().as_subclass(torch.Tensor), fn(full))
    (y * 3.0).sum().backward()
    torch.testing.assert_close(x.grad.local, torch.full_like(x.local, 6.0))


@pytest.mark.parametrize(
    "name, shape",
    [("shuffle", (2, 8, 3, 13)), ("unshuffle", (2, 2, 4, 14)), ("unshuffle_odd", (1, 2, 2, 22))],
)
def test_a_pixel_shuffle_of_bands_along_w_equals_serial(m, name, shape):
    """Bands along W (WXFormer's and CAMulator's deepest level, after the band moved to W):
    a shuffle is local; an unshuffle first moves its boundary columns to a cut on a multiple
    of the factor (14 over 3 ranks: 5, 5, 4 -> 6, 4, 4)."""
    call = F.pixel_shuffle if name == "shuffle" else F.pixel_unshuffle
    y = check_sharded(m, lambda x: call(x, 2), rand(shape, 1), dim=3, **TOL)
    assert y.shard_dim == 3


@pytest.mark.parametrize("call", [F.pixel_shuffle, F.pixel_unshuffle])
def test_a_pixel_shuffle_of_an_empty_band_keeps_its_gradient_shape(m, call):
    """torch's own backward of an empty pixel shuffle returns the gradient unchanged (the
    wrong shape): an empty band would fail its backward while the other ranks wait."""
    from mpidp.runtime.partition import ShardSpec

    full = rand((1, 8, 2, 4), 1)
    sizes = (2,) if WORLD == 1 else (2, 0) + (0,) * (WORLD - 2)
    x = shard(full, 2, m, spec=ShardSpec(sizes)).requires_grad_()
    w = rand(tuple(call(full, 2).shape), 5)
    y = call(x, 2)
    (y * w).sum().backward()
    xr = full.clone().requires_grad_()
    (call(xr, 2) * w).sum().backward()
    torch.testing.assert_close(y.full_tensor().as_subclass(torch.Tensor), call(full, 2))
    s = x.spec
    torch.testing.assert_close(x.grad.local, xr.grad.narrow(2, s.start(x.rank), s.sizes[x.rank]))
