"""``mpidp plan`` and the dry run's halo widths, checked against an independent oracle: the
input rows each rank's output rows really depend on, found by backpropagating through the
serial torch layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.models import WeatherUNet
from mpidp.preflight.plan import build_model, parse_partition, plan_model
from mpidp.runtime.partition import Balanced, ShardSpec, Weighted


def depends_on(layer: nn.Module, shape: tuple[int, ...], out_rows: range) -> tuple[int, int]:
    """[lo, hi) of the input rows that output rows ``out_rows`` depend on (serial autograd)."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    y = layer.double()(x)
    y[..., out_rows.start : out_rows.stop, :].sum().backward()
    rows = (x.grad.abs().sum((0, 1, 3)) != 0).nonzero().flatten()
    return (int(rows.min()), int(rows.max()) + 1) if rows.numel() else (0, 0)


LAYERS = [
    ("conv3", lambda: nn.Conv2d(2, 2, 3, padding=1), (1, 2, 13, 8)),
    ("conv3s2", lambda: nn.Conv2d(2, 2, 3, 2, 1), (1, 2, 13, 8)),
    ("conv5d2", lambda: nn.Conv2d(2, 2, 5, padding=4, dilation=2), (1, 2, 17, 8)),
    ("convT", lambda: nn.ConvTranspose2d(2, 2, 3, 2, 1, output_padding=1), (1, 2, 7, 8)),
    ("convT4", lambda: nn.ConvTranspose2d(2, 2, 4, 2, 1), (1, 2, 9, 8)),
    ("bilinear", lambda: nn.Upsample(size=(13, 8), mode="bilinear"), (1, 2, 7, 8)),
    ("bicubic", lambda: nn.Upsample(scale_factor=2, mode="bicubic"), (1, 2, 6, 8)),
    ("nearest", lambda: nn.Upsample(scale_factor=2, mode="nearest"), (1, 2, 5, 8)),
]


@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[n for n, _, _ in LAYERS])
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("policy", [Balanced(), "thin"], ids=["balanced", "thin"])
def test_halo_widths_are_the_rows_outputs_read(name, make, shape, parts, policy):
    if policy == "thin":
        policy = Weighted((1.0,) * (parts - 1) + (4.0 * parts,))
    layer = make()
    result = plan_model(layer, shape, parts, partition=policy, dtype=torch.float64)
    (info,) = result.report.layers
    spec_in = ShardSpec.from_sizes(info.rows_in)
    spec_out = ShardSpec.from_sizes(info.rows_out)
    for r in range(parts):
        lo, hi = depends_on(layer, shape, range(spec_out.start(r), spec_out.stop(r)))
        if hi == lo:
            continue  # no output rows here: nothing needed
        start, stop = spec_in.start(r), spec_in.stop(r)
        # the fetched range, clipped to the field (rows beyond it are padding, not fetched)
        h = shape[2]
        got = (max(0, start - info.halo_before[r]), min(h, stop + info.halo_after[r]))
        assert got[0] <= lo and hi <= got[1], (r, info, lo, hi)  # covers every row read
        if name != "conv5d2":  # contiguous taps: exactly the rows read (a dilated kernel
            # skips rows inside its range, which one contiguous fetch still brings)
            assert got == (lo, hi), (r, info, lo, hi)


def test_bytes_are_conserved_and_vanish_on_one_rank():
    model = WeatherUNet(3, 3, (37, 16))
    one = plan_model(model, (2, 3, 37, 16), 1)
    assert one.ranks[0].recv_bytes == one.ranks[0].send_bytes == 0
    assert one.ranks[0].activation_bytes == one.serial_activation_bytes
    for parts in (2, 3, 4):
        res = plan_model(model, (2, 3, 37, 16), parts)
        assert sum(r.recv_bytes for r in res.ranks) == sum(r.send_bytes for r in res.ranks) > 0
        # every rank saves its share, and the bands it extends by halo rows on top
        total = sum(r.activation_bytes for r in res.ranks)
        assert res.serial_activation_bytes < total < 1.5 * res.serial_activation_bytes
        assert max(r.activation_bytes for r in res.ranks) < res.serial_activation_bytes
        assert [r.rows for r in res.ranks] == list(Balanced().spec(37, parts).sizes)


def test_conv_bytes_count_rows_from_other_ranks_only():
    """A 3x3 zero-padded conv over 3 ranks of 4 rows, 5 channels, W=6, float32: the edge ranks
    receive one row, the middle rank two; each way, forward plus backward."""
    res = plan_model(nn.Conv2d(5, 5, 3, padding=1), (1, 5, 12, 6), 3)
    row = 5 * 6 * 4
    assert [r.recv_bytes for r in res.ranks] == [2 * row, 4 * row, 2 * row]
    assert [r.halo_rows for r in res.ranks] == [(2,), (2,), (2,)]


def test_a_strided_window_past_the_band_saves_only_its_rows():
    """A stride-2 conv over 8 ranks of 13 rows: the last rank's band (one row) holds no output
    row, its window (halo -1 before) is empty, so it saves nothing; counted as band plus the
    positive widths it saved a row (at 1024 thin bands of 1801 x 3600 one rank read 129)."""
    res = plan_model(nn.Conv2d(2, 2, 3, 2, 1), (1, 2, 13, 8), 8, dtype=torch.float64)
    (info,) = res.report.layers
    row = 2 * 8 * 8
    assert info.rows_out[-1] == 0 and info.halo_before[-1] < 0
    windows = [
        max(0, n + b + a)
        for n, b, a in zip(info.rows_in, info.halo_before, info.halo_after, strict=True)
    ]
    assert [r.activation_bytes for r in res.ranks] == [w * row for w in windows]
    assert res.ranks[-1].activation_bytes == 0


def test_polar_rows_count_when_another_rank_owns_them():
    from mpidp.layers.periodic import PeriodicConv2d

    res = plan_model(PeriodicConv2d(1, 1, 3, pole="polar"), (1, 1, 8, 4), 4)
    # rank 0's row beyond the pole is its own row 1 (rolled): no bytes for it
    assert res.ranks[0].recv_bytes == 2 * 1 * 4 * 4


def test_build_model_names_and_paths():
    assert isinstance(build_model("unet", 4, (19, 8)), WeatherUNet)
    m = build_model("mpidp.models:WeatherUNet", 4, (19, 8))
    assert isinstance(m, WeatherUNet) and m.grid == (19, 8)
    with pytest.raises(ConfigError, match="use one of unet, resblock, patch"):
        build_model("resnet", 4, (19, 8))
    with pytest.raises(ConfigError, match="cannot import"):
        build_model("no_such_module:f", 4, (19, 8))
    with pytest.raises(ConfigError, match="2 weights for 4 ranks"):
        parse_partition("weighted:1,2", 4)
    assert parse_partition("weighted:3,1,1,1", 4) == Weighted((3.0, 1.0, 1.0, 1.0))


def test_cli_plan_table_and_json():
    cmd = [sys.executable, "-m", "mpidp", "plan", "--grid", "91x180", "-d", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "over 3 domain ranks (balanced)" in res.stdout and "up1.0" in res.stdout
    res = subprocess.run(
        [*cmd, "--json", "--partition", "weighted:2,1,1"], capture_output=True, text=True
    )
    doc = json.loads(res.stdout)
    assert [r["rows"] for r in doc["ranks"]] == [46, 22, 23]  # 91 x 2/4 = 45.5 -> 46, ...
    assert doc["partition"] == "weighted [2.0, 1.0, 1.0]"
    bad = subprocess.run([*cmd, "--model", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "use one of unet" in bad.stderr
    bad = subprocess.run(
        [*cmd, "--model", "afno", "--grid", "91x180"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "cannot be built for a 91 x 180 grid" in bad.stderr and "88x176" in bad.stderr


def test_cli_plan_five_d_grid_and_extra_inputs(tmp_path):
    """--grid TIMExLATxLON gives a 5-D input; --input adds the inputs of a forward that takes
    several, for a user factory (module:factory)."""
    factory = tmp_path / "zoo.py"
    factory.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, channels, grid):\n"
        "        super().__init__()\n"
        "        self.conv = nn.Conv3d(channels + 1, channels, 3, padding=1)\n"
        "    def forward(self, x, static):\n"
        "        s = static.unsqueeze(2).expand(x.shape[0], -1, x.shape[2], -1, -1)\n"
        "        return self.conv(torch.cat([x, s], 1))\n"
        "def make(channels, grid):\n"
        "    return Net(channels, grid)\n"
    )
    cmd = [sys.executable, "-m", "mpidp", "plan", "--grid", "4x37x16", "-d", "2", "--json"]
    cmd += ["--model", "zoo:make", "--channels", "2", "--input", "1x1x37x16"]
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["shape"] == [1, 2, 4, 37, 16] and [r["rows"] for r in doc["ranks"]] == [19, 18]
    assert doc["layers"][0]["halo_before"] == [1, 1]  # a zero row beyond the field at rank 0


_CALLS: list[
    str
] = []  # every forward of every copy of _Counted (a list of its own would be copied)


class _Counted(nn.Module):
    """A conv net that counts its forward calls, on the whole field and on bands."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CALLS.append(type(x).__name__)
        return self.net(x)


@pytest.mark.parametrize("parts", [2, 3])
def test_the_dry_run_runs_the_serial_model_once(parts):
    """The layer table, the conversion's shapes and the activation memory come from one forward
    of the serial model on meta tensors, then one forward per simulated rank on its band: a
    model run again for each question costs ``mpidp plan`` on a real model (PhysicsNeMo's
    FengWu) a third more."""
    _CALLS.clear()
    plan = plan_model(_Counted(), (1, 2, 13, 8), parts)
    assert plan.report.ok, plan.report.problems
    assert _CALLS == ["Tensor"] + ["ShardedTensor"] * parts, _CALLS
    assert sum(r.activation_bytes for r in plan.ranks) >= plan.serial_activation_bytes > 0
