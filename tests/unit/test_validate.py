"""validate_sharding_constraints: a dry run by shape arithmetic (meta tensors), no MPI needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpidp
from mpidp.models import PeriodicResBlock, WeatherUNet


def test_unet_rows_and_halos_per_layer():
    report = mpidp.validate_sharding_constraints(
        WeatherUNet(3, 2, (37, 16), width=4), (1, 3, 37, 16), parts=4, partition=mpidp.Balanced()
    )
    assert report.ok, report.problems
    by_path = {layer.path: layer for layer in report.layers}
    down = by_path["down1.0"]  # 3x3 stride 2 pad 1: 37 rows -> 19
    assert down.rows_in == (10, 9, 9, 9) and down.rows_out == (5, 5, 5, 4)
    # rank r needs input rows [2 * first - 1, 2 * last + 2): [-1, 10), [9, 20), [19, 30), [29, 38)
    assert (down.halo_before, down.halo_after) == ((1, 1, 0, -1), (0, 1, 2, 1))
    assert by_path["up1.0.up"].rows_out == (10, 9, 9, 9)
    assert "down1.0" in str(report)


def test_problems_are_listed():
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten())
    report = mpidp.validate_sharding_constraints(
        model, (1, 1, 3, 8), parts=4, partition=mpidp.Balanced()
    )
    assert not report.ok
    text = "\n".join(report.problems)
    assert "the inputs cut along dim -2 over 4 ranks: cannot split 3 rows over 4" in text
    assert "1 (Flatten)" not in text  # runs op by op on ShardedTensors: no problem to list


def test_a_layer_output_of_fewer_rows_than_ranks_leaves_the_last_ranks_empty():
    """The policy's rule for lengths the model derives: 9 rows, stride 4, 3 rows over 4."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3, stride=4, padding=1))
    report = mpidp.validate_sharding_constraints(
        model, (1, 1, 9, 8), parts=4, partition=mpidp.Balanced()
    )
    assert report.ok, report.problems
    assert report.layers[0].rows_out == (1, 1, 1, 0)


def test_odd_longitude_with_polar_padding():
    report = mpidp.validate_sharding_constraints(
        PeriodicResBlock(2, 1, pole="polar"), (1, 2, 13, 9), parts=2, partition=mpidp.Balanced()
    )
    assert any("even W" in p for p in report.problems)


class _WithStatic(nn.Module):
    """A forward of two inputs: the state and static fields (orography, land-sea mask)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3 + 2, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x, static):
        return self.pool(self.conv(torch.cat([x, static.expand(x.shape[0], -1, -1, -1)], 1)))


def test_several_inputs_and_five_d_inputs():
    report = mpidp.validate_sharding_constraints(
        _WithStatic(),
        parts=3,
        partition=mpidp.Balanced(),
        example_inputs=[(2, 3, 20, 8), torch.zeros(1, 2, 20, 8)],
    )
    assert report.ok, report.problems
    by_path = {layer.path: layer for layer in report.layers}
    assert by_path["conv"].rows_in == (7, 7, 6) and by_path["pool"].rows_out == (4, 3, 3)
    three_d = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.MaxPool3d((1, 2, 2)))
    report = mpidp.validate_sharding_constraints(
        three_d, (1, 2, 4, 21, 8), parts=2, partition=mpidp.Balanced()
    )
    assert report.ok, report.problems
    assert [layer.rows_out for layer in report.layers] == [(11, 10), (5, 5)]
    assert report.layers[0].halo_before == (1, 1)  # a zero row beyond the field at rank 0
    with pytest.raises(mpidp.ConfigError, match="global_shape or example_inputs"):
        mpidp.validate_sharding_constraints(three_d, parts=2, partition=mpidp.Balanced())


# ---------------------------------------------------------------- the dry run on band shapes


def _dry(model: nn.Module, shape=(2, 3, 20, 8), parts=3) -> mpidp.ShardingReport:
    return mpidp.validate_sharding_constraints(
        model, shape, parts=parts, partition=mpidp.Weighted([2, 1, 1][:parts])
    )


class _GlobalPosEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.pos = nn.Parameter(torch.zeros(1, 3, 20, 8))

    def forward(self, x):
        return self.conv(x) + self.pos  # the global grid added to a band: its rows


class _ShapeCheck(nn.Module):
    """A model's own input check (a cubed-sphere model's): the global shape on every rank."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        if tuple(x.shape[-2:]) != (20, 8):
            raise ValueError(f"expected a 20 x 8 grid, got {tuple(x.shape[-2:])}")
        return self.conv(x)


class _Mixing(nn.Module):
    """Forward code of the model's own that mixes rows of the sharded dim (or does not)."""

    def __init__(self, op: str):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.op = op
        self.w3 = nn.Parameter(torch.randn(3, 3, 3, 3))
        self.w1 = nn.Parameter(torch.randn(3, 3, 1, 1))

    def forward(self, x):
        x = self.conv(x)
        op = self.op
        if op == "squeeze-excitation":
            return x * torch.sigmoid(x.mean(dim=(2, 3), keepdim=True))
        if op == "roll-lat":
            return torch.roll(x, 1, dims=-2)
        if op == "roll-lon":
            return torch.roll(x, 1, dims=-1)
        if op == "roll-channels-last":  # Swin's shift, after a permute: H is dim 1 there
            return x.permute(0, 2, 3, 1).roll((2, 2), dims=(1, 2)).permute(0, 3, 1, 2)
        if op == "conv3x3":
            return nn.functional.conv2d(x, self.w3, padding=1)
        if op == "conv1x1":
            return nn.functional.conv2d(x, self.w1)
        if op == "pad-lon":
            return nn.functional.pad(x, (1, 1, 0, 0), mode="circular")[..., 1:-1]
        if op == "pad-lat":
            return nn.functional.pad(x, (0, 0, 1, 1))[..., 1:-1, :]
        if op == "softmax-lon":
            return torch.softmax(x, dim=-1)
        if op == "attention-over-tokens":
            t = x.flatten(2).transpose(1, 2)  # (B, H*W, C): the rows merged into tokens
            return (torch.softmax(t @ t.transpose(1, 2), -1) @ t).transpose(1, 2).reshape(x.shape)
        if op == "fft2":
            return torch.fft.irfft2(torch.fft.rfft2(x), s=x.shape[-2:])
        if op == "global-size":  # a global size given to a band: the global grid's size
            return nn.functional.interpolate(x, size=(20, 8))
        if op == "matrix-exp":  # mixes every row of each (H, W) matrix: no band form
            return x[..., :8, :] + torch.linalg.matrix_exp(x[..., :8, :])
        raise AssertionError(op)


#: code of the model's own that runs on bands exactly (tests/mpi/test_validate_agrees.py runs
#: each at 1-4 ranks against serial), and code that is refused
EXACT = [
    "squeeze-excitation",
    "roll-lat",
    "roll-lon",
    "roll-channels-last",
    "conv3x3",
    "conv1x1",
    "pad-lon",
    "pad-lat",
    "softmax-lon",
    "attention-over-tokens",
    "fft2",
    "global-size",
]
REFUSED = {"matrix-exp": "linalg_matrix_exp"}


@pytest.mark.parametrize("model", [_GlobalPosEmbed, _ShapeCheck, *EXACT])
def test_the_dry_run_is_the_real_runs_engine(model):
    """Every rank's forward runs on meta ShardedTensors, as a real run does: the global grid
    added to a band, a model's own shape check and code that mixes rows through ops with band
    forms pass (the old dry run on plain bands reported each as a problem)."""
    report = _dry(_Mixing(model) if isinstance(model, str) else model())
    assert report.ok, report.problems


@pytest.mark.parametrize("op", list(REFUSED))
def test_the_first_refusal_of_the_real_run_is_a_problem(op):
    report = _dry(_Mixing(op))
    assert len(report.problems) == 1, report.problems
    assert REFUSED[op] in report.problems[0], report.problems


def test_an_error_of_the_models_own_code_on_bands_is_named_with_its_line():
    class Strict(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x):
            if type(x) is not torch.Tensor:  # a check that refuses tensor subclasses
                raise TypeError(f"expected a plain tensor, got {type(x).__name__}")
            return self.conv(x)

    report = _dry(Strict())
    assert len(report.problems) == 1, report.problems
    text = report.problems[0]
    assert text.startswith("the model's forward fails on bands of 3 ranks at "), text
    assert "test_validate.py" in text and "`raise TypeError(" in text, text
    assert "TypeError: expected a plain tensor, got ShardedTensor" in text, text


def test_a_refusal_names_the_module_path_in_a_model_run_before():
    """The module stack of refusals is left as it was: a converted model called with
    ShardedTensors (each rank of the dry run) no longer leaves itself on it."""
    _dry(_Mixing("conv3x3"))
    report = _dry(nn.Sequential(nn.Identity(), _Mixing("matrix-exp")))
    assert "in module 1 (_Mixing) of Sequential" in report.problems[0], report.problems


def test_the_path_named_follows_a_module_moved_since_the_last_question():
    """The path a refusal names is remembered per model (the dry run asks for it at every op);
    a module moved, swapped or added since is named where it is now, never where it was."""
    from mpidp.sharded import where

    bad, other = _Mixing("matrix-exp"), nn.Identity()
    model = nn.Sequential(nn.Identity(), nn.Sequential(other, bad))
    assert where._path([model, bad]) == "1.1 (_Mixing)"
    model[1][0], model[1][1] = bad, other  # swapped: the remembered "1.1" is now `other`
    assert where._path([model, bad]) == "1.0 (_Mixing)"
    assert where._path([model, other]) == "1.1 (Identity)"
    report = _dry(model)
    assert "in module 1.0 (_Mixing) of Sequential" in report.problems[0], report.problems
    model.add_module("2", late := nn.Identity())
    assert where._path([model, late]) == "2 (Identity)"
    assert where._path([model, nn.Identity()]) == "? (Identity)"  # not in the model


def test_converted_models_pass():
    unet = WeatherUNet(3, 2, (37, 16), width=4)
    for parts in (2, 3, 4):
        report = mpidp.validate_sharding_constraints(
            unet, (1, 3, 37, 16), parts=parts, partition=mpidp.Balanced()
        )
        assert report.ok, report.problems


@pytest.mark.parametrize("kernel", [1, 3])
def test_pointwise_layers_after_a_global_pool_are_replicated(kernel):
    class SE(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Conv2d(3, 3, kernel, padding=kernel // 2)

        def forward(self, x):
            x = self.conv(x)
            return x * torch.sigmoid(self.fc(self.pool(x)))

    report = _dry(SE())
    by_path = {layer.path: layer for layer in report.layers}
    assert by_path["pool"].rows_out == (1, 1, 1) and by_path["pool"].boundary == "replicated"
    if kernel == 1:  # the same 1 x 1 x C on every rank: exact
        assert report.ok, report.problems
        assert by_path["fc"].rows_in == (1, 1, 1) and by_path["fc"].boundary == "replicated"
    else:  # a 3 x 3 conv of the pooled row: run on the ShardedTensor engine, exact too
        assert report.ok, report.problems
