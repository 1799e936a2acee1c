"""The probe of unknown modules and the conversion verdicts (pure: no MPI).

Row-local custom modules are left as they are ("probed local"); custom modules that roll,
average or transform rows, or that depend on a row's position, are refused with what they mix
and never with a ``safe=`` hint; what the probe cannot run is refused with the ways out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpidp
from mpidp.parallel.convert import explain_conversion
from mpidp.parallel.probe import probe_band_locality


class Roll(nn.Module):
    def forward(self, x):
        return torch.roll(x, 1, -2)


class CentreRows(nn.Module):
    def forward(self, x):
        return x - x.mean(-2, keepdim=True)


class RowEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 1, 7, 1))

    def forward(self, x):
        return x + self.table[:, :, : x.shape[-2]]


class Spectral(nn.Module):
    """A low-pass filter written with torch.fft (the FNO blocks' pattern)."""

    def forward(self, x):
        X = torch.fft.rfft2(x)
        ky = torch.fft.fftfreq(x.shape[-2]).abs().view(-1, 1)
        return torch.fft.irfft2(X * torch.exp(-4 * ky), s=x.shape[-2:])


class Gate(nn.Module):
    def __init__(self, channels=4):
        super().__init__()
        self.in_channels = channels
        self.scale = nn.Parameter(torch.randn(channels))

    def forward(self, x):
        return x * self.scale.view(1, -1, 1, 1).sigmoid() + torch.tanh(x)


class DropPath(nn.Module):
    def forward(self, x):
        if not self.training:
            return x
        keep = (torch.rand(x.shape[0], 1, 1, 1) > 0.3).to(x.dtype)
        return x * keep / 0.7


class LayerNorm2d(nn.Module):
    def __init__(self, channels=6):
        super().__init__()
        self.num_channels = channels
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x):
        mean = x.mean(1, keepdim=True)
        var = (x - mean).square().mean(1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-6) * self.weight[:, None, None]


class TokenMixer(nn.Module):
    """Channels-last (B, H, W, C): mixes H, leaves W alone (a W-only check would pass it)."""

    def __init__(self, dim=8):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return x + x.cumsum(1)


class NeedsGrid(nn.Module):
    def forward(self, x):
        if x.shape[-2:] != (91, 180):
            raise ValueError("wrong grid")
        return x


LOCAL = [Gate(), DropPath(), LayerNorm2d(), nn.Softmax(dim=-1), nn.Identity()]
MIXING = [Roll(), CentreRows(), RowEmbedding(), Spectral(), nn.Softmax(dim=-2), TokenMixer()]


@pytest.mark.parametrize("module", LOCAL, ids=lambda m: type(m).__name__)
def test_row_local_modules_are_found_local(module):
    result = probe_band_locality(module)
    assert result.local is True, result.detail


@pytest.mark.parametrize("module", MIXING, ids=lambda m: type(m).__name__)
def test_row_mixing_modules_are_found_mixing(module):
    result = probe_band_locality(module)
    assert result.local is False, result.detail


def test_the_probe_names_what_mixes():
    assert "output rows [1] change when input row 0 changes" in probe_band_locality(Roll()).detail
    assert "position" in probe_band_locality(RowEmbedding()).detail


class BandForward(nn.Sequential):
    """A model whose forward is written for bands: its children see plain bands."""

    _mpidp_band_forward = True


def test_conversion_leaves_probed_local_modules_and_runs_mixing_ones_op_by_op():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Gate(), LayerNorm2d(4), DropPath())
    verdicts = {v.path: v for v in explain_conversion(model)}
    assert verdicts["0"].action == "converted" and verdicts["0"].into == "DomainParallelConv2d"
    for path in ("1", "2", "3"):
        assert verdicts[path].action == "left" and "probed local" in verdicts[path].why
    converted = mpidp.convert_to_domain_parallel(model)
    assert type(converted[1]) is Gate

    # in a forward that runs on ShardedTensors, a mixing module runs its own forward on them
    mixing = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Roll(), CentreRows())
    verdicts = {v.path: v for v in explain_conversion(mixing)}
    for path in ("1", "2"):
        assert verdicts[path].action == "left", verdicts[path]
        assert "runs op by op on ShardedTensors (probed: it mixes rows" in verdicts[path].why

    # in a forward written for bands it would see a plain band: refused, nothing changed
    bad = BandForward(nn.Conv2d(3, 4, 3, padding=1), Roll(), CentreRows())
    with pytest.raises(mpidp.ConfigError) as err:
        mpidp.convert_to_domain_parallel(bad)
    text = str(err.value)
    assert "1 (Roll): probed: it mixes rows" in text and "2 (CentreRows)" in text
    assert "safe=" not in text  # a mixing module is never waved through
    assert type(bad[0]) is nn.Conv2d  # nothing changed


def test_what_the_probe_cannot_run_runs_op_by_op_or_is_refused_with_the_ways_out():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), NeedsGrid())
    (verdict,) = [v for v in explain_conversion(model) if v.path == "1"]
    assert verdict.action == "left" and "op by op" in verdict.why
    (verdict,) = [v for v in explain_conversion(BandForward(*model)) if v.path == "1"]
    assert verdict.action == "refused" and "the probe could not run it" in verdict.why
    assert "safe=" in verdict.why  # the user may vouch for what cannot be run
    assert explain_conversion(model, safe=[NeedsGrid])[1].action == "left"


def test_example_inputs_give_the_probe_the_real_shape():
    """A module that needs its real input (7 channels-last features) is probed on it."""

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(7, 7))

        def forward(self, x):
            return x @ self.weight

    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), Head())
    x = torch.randn(1, 3, 11, 7)
    (before,) = [v for v in explain_conversion(model) if v.path == "1"]
    (after,) = [v for v in explain_conversion(model, example_inputs=(x,)) if v.path == "1"]
    assert after.action == "left" and "(1, 3, 7, 7)" in after.why, after
    assert before.action in ("left", "refused")


def test_int_kernel_pools_convert():
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.MaxPool2d(2), nn.AvgPool2d(3, 2, 1))
    actions = [v.action for v in explain_conversion(model)]
    assert actions == ["converted", "converted", "converted"]


def test_embeddings_of_indices_are_left_as_they_are():
    """nn.Embedding takes integer indices, which the probe cannot feed it; a lookup per index
    reads no neighbour, so it is known safe (a diffusion model's time-step embedding)."""

    class TimeConditioned(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 3)
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x, t):
            return self.conv(x) + self.embed(t)[:, :, None, None]

    verdicts = {v.path: v for v in explain_conversion(TimeConditioned())}
    assert verdicts["embed"].action == "left" and verdicts["conv"].action == "converted"
