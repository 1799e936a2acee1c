"""One exact front end: nine models whose own ``forward`` makes one shape- or neighbour-
dependent torch call (the calls that made conversion silently wrong) run through BOTH entry
points, ``convert_to_domain_parallel`` (plain bands in and out) and ``mpidp.shard`` input
(ShardedTensor), float64, H = 13 (uneven bands), and equal the serial model: output, input
gradient and every parameter gradient, 1e-10 relative. A user's ``torch.autograd.Function``
(a straight-through estimator, and one whose backward is not its forward's autograd) keeps
its gradients on ShardedTensors; one that calls numpy is refused on every rank, naming
where. A refusal names the module path. A broken handler makes the comparison fail."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.sharded import UnsupportedOp, shard
from mpidp.testing import assert_matches_serial
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64
H, W = 13, 8


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)


class InterpolateToSkip(Base):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 3, 3, stride=2, padding=1)

    def forward(self, x):
        h = self.down(x)
        return self.conv(F.interpolate(h, size=x.shape[-2:], mode="bilinear") + x)


class UpsampleCatSkip(Base):
    def __init__(self) -> None:
        super().__init__()
        self.merge = nn.Conv2d(6, 3, 3, padding=1)

    def forward(self, x):
        d = F.avg_pool2d(self.conv(x), 2)
        u = F.interpolate(d, scale_factor=2, mode="nearest")
        return self.merge(torch.cat([u, x[..., : u.shape[-2], :]], dim=1))


class MeanGate(Base):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        g = torch.sigmoid(self.lin(x.mean((-2, -1))))
        return self.conv(x) * g[..., None, None]


class ReflectPad(Base):
    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 2, 2), mode="reflect"), self.conv.weight, padding=0)


class Roll(Base):
    def forward(self, x):
        return self.conv(torch.roll(x, 3, -2)) + torch.roll(x, -2, -1)


class PoleRow(Base):
    def forward(self, x):
        return self.conv(x) + x[..., 0, :].unsqueeze(-2)


class SoftmaxOverGrid(Base):
    def forward(self, x):
        h = self.conv(x)
        return torch.softmax(h.flatten(-2), dim=-1).view_as(h)


class FunctionalConv(Base):
    def forward(self, x):
        return F.conv2d(torch.tanh(self.conv(x)), self.conv.weight, self.conv.bias, padding=1)


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding: the backward is not the forward's autograd (zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(4 * x) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledSquare(torch.autograd.Function):
    """y = s * x**2 with s a parameter: saves tensors, a band input and a plain one."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return s * x * x

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return 2 * s * x * g, (g * x * x).sum().reshape(s.shape)


class UserFunctions(Base):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor([0.7]))

    def forward(self, x):
        return ScaledSquare.apply(self.conv(RoundSTE.apply(x) + x), self.s)


PATTERNS = {
    "interpolate_to_skip_size": InterpolateToSkip,
    "nearest_x2_then_cat_skip": UpsampleCatSkip,
    "spatial_mean_gate": MeanGate,
    "reflect_pad_functional": ReflectPad,
    "roll_lat_and_lon": Roll,
    "pole_row": PoleRow,
    "softmax_over_grid": SoftmaxOverGrid,
    "functional_conv2d": FunctionalConv,
    "autograd_function": UserFunctions,
}


def build(name):
    torch.manual_seed(7)
    return PATTERNS[name]().to(F64)


def converted_matches_serial(m, serial):
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert_matches_serial(
        serial,
        dist,
        [rand((2, 3, H, W), 3)],
        manager=m,
        modules=(serial, dist),
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_through_conversion_equals_serial(m, name):
    converted_matches_serial(m, build(name))


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_on_sharded_tensors_equals_serial(m, name):
    model = build(name)
    check_sharded(m, model, rand((2, 3, H, W), 3), dim=2, module=model, rtol=1e-10, atol=1e-12)


def test_a_broken_handler_fails_the_comparison(m, monkeypatch):
    """Mutation: torch.roll's handler rolls the band alone (at one rank, where that is the
    serial roll, it does not roll at all); the conversion test sees it."""
    from mpidp.sharded import dispatch

    def band_roll(func, args, kwargs):
        x = args[0]
        local = torch.roll(x.local, *args[1:], **kwargs) if WORLD > 1 else x.local
        return mpidp.ShardedTensor(local, x.spec, x.shard_dim, x.manager)

    monkeypatch.setitem(dispatch._HANDLERS, dispatch.key(torch.roll), band_roll)
    with pytest.raises(AssertionError, match="output"):
        test_pattern_through_conversion_equals_serial(m, "roll_lat_and_lon")


class NumpyFilter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(np.cumsum(x.detach().numpy(), axis=-2))

    @staticmethod
    def backward(ctx, g):
        return g


class CallsNumpy(Base):
    def forward(self, x):
        return NumpyFilter.apply(self.conv(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Sequential(nn.Conv2d(3, 3, 1), CumsumBlock())

    def forward(self, x):
        return self.decoder(x)


class CumsumBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return torch.cumsum(self.conv(x), dim=-2)


def test_non_torch_code_in_a_function_is_refused_on_every_rank(m):
    torch.manual_seed(0)
    model = mpidp.convert_to_domain_parallel(CallsNumpy().to(F64), m)
    band = shard(rand((1, 3, H, W), 1), 2, m).local
    where = "in autograd.Function NumpyFilter.forward, in CallsNumpy.forward"
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: {where}: Tensor.numpy"):
        model(band)


def test_a_refusal_names_the_module_path(m):
    torch.manual_seed(0)
    model = mpidp.convert_to_domain_parallel(Nested().to(F64), m)
    band = shard(rand((1, 3, H, W), 1), 2, m).local
    where = r"in module decoder\.1 \(CumsumBlock\) of Nested: torch\.cumsum"
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: {where}"):
        model(band)
    with pytest.raises(UnsupportedOp, match=rf"rank {m.rank}: {where}"):
        Nested().to(F64)(shard(rand((1, 3, H, W), 1), 2, m))


def test_inputs_that_are_not_bands_pass_unchanged_and_replicated_outputs_come_back(m):
    """A condition vector passes as it is; a pooled output is the same on every rank."""

    class Conditioned(Base):
        def forward(self, x, cond):
            h = self.conv(x) * cond[:, :, None, None]
            return h, h.mean((-2, -1))

    torch.manual_seed(3)
    serial = Conditioned().to(F64)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    full, cond = rand((2, 3, H, W), 4), rand((2, 3), 5)
    y, pooled = serial(full, cond)
    s = m.partition.spec(H, m.domain_world_size)
    band = full.narrow(2, s.start(m.domain_rank), s.sizes[m.domain_rank])
    yb, pb = dist(band, cond)
    assert type(yb) is torch.Tensor
    torch.testing.assert_close(yb, y.narrow(2, s.start(m.domain_rank), s.sizes[m.domain_rank]))
    assert isinstance(pb, mpidp.Replicated)
    torch.testing.assert_close(pb.as_subclass(torch.Tensor), pooled, rtol=1e-12, atol=1e-13)


class MergeList(nn.Module):
    """FPN's merge block (segmentation-models): a list of maps, each resized to the first."""

    def forward(self, xs):
        return sum(F.interpolate(x, size=xs[0].shape[-2:], mode="nearest") for x in xs)


class RollRows(nn.Module):
    def forward(self, x):
        return torch.roll(x, 2, -2)


class Pyramid(Base):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 3, 3, stride=2, padding=1)
        self.merge = MergeList()
        self.roll = RollRows()

    def forward(self, x):
        a = self.conv(x)
        return self.roll(self.merge([a, self.down(a)]))


def test_leaf_modules_mpidp_does_not_know_run_op_by_op(m):
    """A module taking a list, and one that mixes rows, are neither band layers nor refused:
    their own forward runs on ShardedTensors, exact."""
    torch.manual_seed(0)
    serial = Pyramid().to(F64)
    verdicts = {v.path: v for v in mpidp.explain_conversion(serial, m)}
    assert verdicts["merge"].action == verdicts["roll"].action == "left"
    converted_matches_serial(m, serial)


def test_channel_dropout_drops_the_same_channels_on_every_band(m):
    """Dropout2d in training: one mask per (sample, channel) for the whole field, the serial
    draw (every rank's generator in step: the converted model checks it)."""

    class Drop(Base):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout2d(0.5)

        def forward(self, x):
            return self.drop(self.conv(x))

    torch.manual_seed(0)
    serial = Drop().to(F64)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    full = rand((4, 3, H, W), 3)
    torch.manual_seed(7)
    want = serial(full)
    torch.manual_seed(7)
    band = shard(full, 2, m).local
    got = mpidp.gather_tensor(dist(band), manager=m)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    dropped = (want.abs().sum((-2, -1)) == 0).sum().item()
    assert 0 < dropped < 12, dropped  # the mask really drops some channels and keeps others


class _SizedUp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 3, 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x, output_size=[2 * x.shape[-2], 2 * x.shape[-1]])


@pytest.mark.mpi(min_size=2)  # one rank: the layer is torch's own
def test_a_layers_own_error_names_the_module_path(m):
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), _SizedUp())
    model = mpidp.convert_to_domain_parallel(model.to(F64), m)
    where = r"in module 1\.up \(DomainParallelConvTranspose2d\) of Sequential: .*output_size"
    with pytest.raises(mpidp.ConfigError, match=rf"rank {m.rank}: {where}"):
        model(shard(rand((1, 3, 6, 8), 1), 2, m).local)


@pytest.mark.mpi(min_size=3)  # two output rows: fewer than the ranks
def test_a_layer_with_fewer_output_rows_than_ranks_gives_empty_bands(m):
    """A stride-4 convolution of 6 rows gives 2: the first two ranks hold one each, the rest
    none (the policy's rule for lengths the model derives), and the result is the serial one."""
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Sequential(nn.Conv2d(3, 3, 3, 4, 1)))
    model = model.to(F64)
    twin = copy.deepcopy(model)
    y = check_sharded(m, twin, rand((1, 3, 6, 8), 1), module=twin)
    assert y.spec.sizes == (1, 1) + (0,) * (WORLD - 2)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(model), m)
    assert_matches_serial(
        model, dist, [rand((1, 3, 6, 8), 1)], manager=m, modules=(model, dist), rtol=1e-10
    )


@pytest.mark.parametrize(
    "func, shape, dim",
    [
        (F.dropout1d, (3, 13), 1),  # unbatched (C, L)
        (F.dropout1d, (2, 3, 13), 2),
        (F.dropout2d, (4, 3, 13), 2),  # torch reads a 3-D input as (N, C, L)
        (F.dropout2d, (2, 3, 13, 8), 2),
        (F.dropout3d, (3, 2, 13, 8), 2),  # unbatched (C, D, H, W)
        (F.dropout3d, (2, 3, 2, 13, 8), 3),
    ],
    ids=["1d-unbatched", "1d", "2d-on-3d", "2d", "3d-unbatched", "3d"],
)
def test_channel_dropout_draws_the_serial_mask(m, func, shape, dim):
    full = rand(shape, 9)
    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = func(full, 0.5, True)
        torch.manual_seed(11 + 100 * m.rank)  # only rank 0's generator may matter
        got = func(shard(full, dim, m), 0.5, True).full_tensor()
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=0, atol=0)


class BiasDropout(Base):
    """Dropout on a band and on a value every rank holds (a position-bias MLP's dropout, as
    CREDIT's Swin V2 has): the second must be the same draw on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Sequential(nn.Linear(2, 3), nn.Dropout(0.25))

    def forward(self, x):
        b = self.bias(torch.ones(2, dtype=x.dtype))
        return F.dropout(self.conv(x), 0.25) + b[None, :, None, None]


@pytest.mark.mpi(min_size=2)  # one rank: one generator
def test_generators_out_of_step_are_an_error_on_every_rank(m):
    torch.manual_seed(0)
    model = mpidp.convert_to_domain_parallel(BiasDropout().to(F64), m)
    band = shard(rand((2, 3, H, W), 1), 2, m).local
    torch.manual_seed(5 + m.rank)
    with pytest.raises(mpidp.ConfigError, match=rf"rank {m.rank}: .*not in step.*manual_seed"):
        model(band)
    model.eval()  # nothing random: the generators may be apart (each rank's own random data)
    model(band)
    model.train()
    loss = torch.zeros(()).requires_grad_()
    torch.manual_seed(5)
    (model(band).sum() + loss).backward()
    torch.manual_seed(5 + m.rank)
    with pytest.raises(mpidp.ConfigError, match=rf"rank {m.rank}: sync_gradients.*not in step"):
        mpidp.sync_gradients(model, m)


@pytest.mark.mpi(min_size=2)  # one rank: nothing to keep in step
def test_dropout_on_uneven_bands_keeps_the_generators_in_step(m, monkeypatch):
    """Bands of 7 and 6 rows (5, 4, 4 at three ranks) draw different numbers of values: from
    each rank's own stream, the default generators stay in step over steps; drawn from the
    default generator itself (the mutation), the second step is refused."""
    from mpidp.sharded import pointwise

    torch.manual_seed(0)
    model = mpidp.convert_to_domain_parallel(BiasDropout().to(F64), m)
    band = shard(rand((2, 3, H, W), 1), 2, m).local
    torch.manual_seed(5)
    for _ in range(3):
        model(band)
    monkeypatch.setattr(pointwise, "RANDOM", set())
    model(band)
    with pytest.raises(mpidp.ConfigError, match="not in step"):
        model(band)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: F.dropout(t, 0.0),
        lambda t: F.dropout(t, 0.5, training=False),
        lambda t: torch.dropout(t, 0.3, False),
        lambda t: F.alpha_dropout(t, 0.5),
        lambda t: F.rrelu(t),
        lambda t: F.dropout(t, 0.5),  # draws: the generator moves, as in torch
    ],
    ids=["p0", "eval", "torch_eval", "alpha_default_eval", "rrelu_eval", "draws"],
)
def test_a_call_that_draws_nothing_leaves_the_generator_where_torch_does(m, call):
    """Serial torch draws nothing for a dropout with p 0 or out of training, so a draw on a
    value every rank holds after it (CREDIT Swin's position-bias MLP) is the serial one only
    if the band's call does not advance the generator either."""
    full = rand((2, 3, H, W), 1)
    torch.manual_seed(3)
    call(full)
    want = torch.rand(4)
    torch.manual_seed(3)
    call(shard(full, 2, m))
    moved = torch.rand(4)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    call(full)
    draws = not torch.equal(before, torch.get_rng_state())
    assert torch.equal(moved, want) != draws  # the same place exactly when torch draws none
