"""The parallelism config takes the domain as bands (an int) or a grid of latitude x longitude
blocks (a pair), and the example's ``--domain`` parses both; pure checks, no ranks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mpidp import ConfigError
from mpidp.parallel import ParallelismConfig

ROOT = Path(__file__).resolve().parents[2]


def test_domain_grid_counts_its_ranks():
    bands, blocks = ParallelismConfig(domain=4), ParallelismConfig(domain=[2, 3], data="ddp")
    assert (bands.grid, bands.domain_ranks, bands.sizes(8)) == ((4, 1), 4, (2, 1, 4))
    assert (blocks.domain, blocks.grid, blocks.sizes(12)) == ((2, 3), (2, 3), (2, 1, 6))
    with pytest.raises(ConfigError, match=r"tensor 1 x domain 2 x 3 = 6; launch a multiple"):
        blocks.sizes(8)
    for bad in ((2, 0), (2, 2, 2), ("2", 2)):
        with pytest.raises(ConfigError, match="domain"):
            ParallelismConfig(domain=bad)


def test_example_domain_option(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # train.py imports its skill.py
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples/train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_example", train)
    spec.loader.exec_module(train)
    grid = train.domain_grid
    assert (grid("4"), grid("2x2"), grid("1X4")) == ((4, 1), (2, 2), (1, 4))
    assert [grid(s) for s in ("0", "2x", "x2", "2x2x2", "auto", "-1")] == [None] * 6
