"""docs/supported.md is generated from the registries and current (it cannot drift)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_supported_page_is_generated_from_the_registries():
    spec = importlib.util.spec_from_file_location("supported", ROOT / "scripts" / "supported.py")
    assert spec is not None and spec.loader is not None
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    text = page.render()
    assert "`F.conv2d`" in text or "`torch.conv2d`" in text
    assert "DomainParallelConv2d" in text
    assert (ROOT / "docs" / "supported.md").read_text() == text, (
        "docs/supported.md is out of date: run python scripts/supported.py"
    )
