"""mpidp.ops.skill at one process: the table (one row per lead step), JSON round trip, verdicts,
bad shapes; the truth/forecast/error figure of examples/skill.py labels its colour bars with
the variable's units."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import mpidp
from mpidp.errors import ConfigError
from mpidp.ops.skill import LeadScores, Skill, SkillMeter

ROOT = Path(__file__).resolve().parents[2]


def skill(rows=((1.0, 2.0, 5.0, 0.9, 0.8), (2.5, 2.0, 5.0, 0.7, 0.75))) -> Skill:
    scores = tuple((LeadScores(*r), LeadScores(*(2 * v for v in r))) for r in rows)
    steps = tuple(range(1, len(rows) + 1))
    return Skill(("t2m", "z500"), ("K", "m2 s-2"), steps, scores, 3, 6.0)


def test_table_has_one_row_per_lead_step_per_variable():
    text = skill().table()
    blocks = text.split("\n\n")
    assert len(blocks) == 2
    lines = blocks[0].splitlines()
    assert lines[0].startswith("t2m (K): latitude-weighted RMSE and anomaly correlation of 3")
    assert "persistence" in lines[1] and "climatology" in lines[1] and "ACC" in lines[1]
    assert [line.split()[:3] for line in lines[2:]] == [["1", "6", "h"], ["2", "12", "h"]]
    assert lines[3].split()[3:] == ["2.5", "2", "5", "0.7000", "0.7500"]
    assert str(skill()) == text
    assert skill().table(["z500"]).startswith("z500 (m2 s-2)")
    assert "{" not in text and "LeadScores" not in text  # sentences and numbers, no reprs


def test_json_round_trip_and_nan(tmp_path):
    s = skill(((1.0, 2.0, 5.0, math.nan, 0.8),))
    path = s.write_json(tmp_path / "skill.json")
    d = json.loads(path.read_text())
    assert d["steps"] == [1] and d["lead_hours"] == [6.0] and d["forecasts"] == 3
    assert d["variables"]["t2m"]["units"] == "K"
    assert d["variables"]["t2m"]["rmse_persistence"] == [2.0]
    assert d["variables"]["t2m"]["acc"] == [None]  # JSON has no NaN
    back = Skill.from_dict(d)
    assert back.channels == s.channels and back.steps == s.steps and back.step_hours == 6.0
    assert back.of("t2m")[0].rmse == 1.0 and math.isnan(back.of("t2m")[0].acc)
    assert not list(tmp_path.glob(".*tmp*"))


def test_beats_and_verdict():
    s = skill()
    assert not s.beats()  # step 2 of t2m: 2.5 against 2.0
    assert s.beats("climatology")
    good = skill(((1.0, 2.0, 5.0, 0.9, 0.8),))
    assert good.beats("persistence", "t2m")
    assert good.verdict().startswith("beats persistence: better at step 1 in 2 of 2 variables; t2m")
    v = s.verdict()
    assert v.startswith("does not beat persistence: better at every lead step in 0 of 2")
    assert "t2m at step 2 (12 h): RMSE 2.5 K, persistence 2 K, climatology 5 K" in v
    assert "climatology in" not in v  # said only where the forecast is no better than it
    # level with climatology at step 2 (z500's scores are t2m's doubled)
    v = skill(((1.0, 2.0, 5.0, 0.9, 0.8), (5.0, 6.0, 5.0, 0.3, 0.2))).verdict()
    assert v.startswith(
        "beats persistence: better at every lead step in 2 of 2 variables; no better than "
        "climatology in t2m from step 2 (12 h), z500 from step 2 (12 h); t2m at step 2 (12 h): "
        "RMSE 5 K, persistence 6 K, climatology 5 K"
    )
    late = skill(((1.0, 2.0, 1.0, 0.9, 0.8),))
    assert "at step 1 in 2 of 2 variables; no better than climatology in t2m, z500; t2m" in (
        late.verdict()
    )
    with pytest.raises(ConfigError, match="reference='tomorrow'"):
        s.beats("tomorrow")
    with pytest.raises(ConfigError, match="no channel 'q'"):
        s.of("q")
    assert "2 lead steps x 2 channels" in repr(s)


def test_meter_at_one_process_and_bad_shapes():
    with mpidp.DistributedManager(domain_parallel_size=1) as m:
        g = torch.Generator().manual_seed(0)
        clim = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
        x0 = clim + torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
        y = x0 + 0.1
        weights = mpidp.latitude_weights(5, manager=m)
        meter = SkillMeter(["a", "b"], x0, clim, weights, m, units=["K", "K"])
        s = meter.add(1, y, y)[0]  # a perfect forecast
        assert s.rmse == 0 and s.acc == pytest.approx(1.0)
        assert s.rmse_persistence == pytest.approx(0.1)
        assert meter.result().forecasts == 1
        with pytest.raises(ConfigError, match=r"forecast has shape \(5, 8\)"):
            meter.add(2, y[0], y)
        with pytest.raises(ConfigError, match="3 units for 2 channels"):
            SkillMeter(["a", "b"], x0, clim, weights, m, units=["K"] * 3)


def _examples_skill():
    spec = importlib.util.spec_from_file_location("examples_skill", ROOT / "examples" / "skill.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_comparison_figure_labels_units(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    lat, lon = np.linspace(90, -90, 7), np.arange(12) * 30.0
    truth = np.add.outer(np.cos(np.deg2rad(lat)), np.sin(np.deg2rad(lon))) * 10 + 280
    path = _examples_skill().save_comparison(
        tmp_path / "t2m.png", truth, truth + 1.5, lat, lon, name="t2m", units="K", rmse=1.5
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = {ax.get_ylabel() for ax in figures[0].axes}
    assert {"t2m (K)", "t2m error (K)"} <= labels
    titles = [ax.get_title() for ax in figures[0].axes]
    assert titles[:3] == ["truth", "forecast", "forecast - truth (RMSE 1.5 K)"]
    assert not list(tmp_path.glob(".*tmp*"))


def test_lead_times_and_dates_come_from_the_time_coordinate(tmp_path):
    """The examples' lead times (metrics.json's lead_hours, the skill tables) and the map's
    dates: from the CF units of the data's time coordinate, None where there are none."""
    import h5py

    ex = _examples_skill()
    units = "hours since 2000-01-01 00:00:00"
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["time"] = np.arange(0.0, 30.0, 6.0)
        f["time"].attrs["units"] = units
    with h5py.File(tmp_path / "bare.h5", "w") as f:
        f["time"] = np.arange(5.0)
    assert ex.time_units(tmp_path / "d.h5") == units
    assert ex.time_units(tmp_path / "bare.h5") is None
    assert ex.time_units(tmp_path / "missing.h5") is None
    assert ex.step_hours(np.array([330.0, 336.0]), units) == 6.0
    assert ex.step_hours(np.array([0.0, 0.25]), "days since 2000-01-01") == 6.0
    assert ex.step_hours(np.array([0.0, 1.0]), None) is None  # index steps: no hours
    assert ex.step_hours(np.array([0.0]), units) is None
    assert ex.timestamp(330.0, units) == "2000-01-14 18:00"
    assert ex.timestamp(330.0, "hours") is None  # no reference date
