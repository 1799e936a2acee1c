"""The Python code blocks of README.md and docs/*.md run, so the docs cannot rot.

The blocks of one page run in order in one process (later blocks may use names from earlier
ones), in a temporary folder, once as one process and once under ``mpiexec -n 2``. A block
fenced as ```python (or ```py, ```Python, ```python3: any Python tag) is always run; there is no
way to opt out.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_launch import MPIEXEC, clean_env

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[ \t]*(?:py|python|python3)[ \t]*\n(.*?)^```", re.S | re.M | re.I)
ANY_FENCE = re.compile(r"^```[ \t]*(\S*)[ \t]*\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


WITH_CODE = [p for p in PAGES if blocks(p)]


def test_every_python_fence_is_run():
    """The fence pattern catches every spelling of a Python block (```py, ```Python) and
    nothing but Python blocks: each fence's language tag is one we know."""
    sample = "```py\na = 1\n```\n```Python\nb = 2\n```\n```python3 \nc = 3\n```\n```bash\nls\n```\n"
    assert FENCE.findall(sample) == ["a = 1\n", "b = 2\n", "c = 3\n"]
    for page in PAGES:
        tags = {tag.lower() for tag, _ in ANY_FENCE.findall(page.read_text())}
        assert tags <= {"", "bash", "yaml", "text", "console", "json", "py", "python", "python3"}, (
            page.name,
            tags,
        )


def test_pages_with_code_are_found():
    names = {p.name for p in WITH_CODE}
    assert {"README.md", "quickstart.md", "io.md", "halo.md"} <= names, names


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("page", WITH_CODE, ids=[p.name for p in WITH_CODE])
def test_code_blocks_run(page, ranks, tmp_path):
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n\n".join(blocks(page)))
    cmd = [sys.executable, "-m", "mpi4py", str(script)]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    res = subprocess.run(
        cmd,
        env=clean_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, (
        f"{page.name} at {ranks} ranks:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    )


MODULES = [
    "mpidp",
    "mpidp.ops.fft",
    "mpidp.sharded",
    "mpidp.ops.attention",
    "mpidp.anemoi",
    "mpidp.graph",
    "mpidp.io",
    "mpidp.parallel",
    "mpidp.preflight.plan",
    "mpidp.preflight.scaling",
    "mpidp.models",
    "mpidp.testing",
    "mpidp.runtime.bootstrap",
    "mpidp.runtime.partition",
    "mpidp.runtime.grid",
    "mpidp.ops.blocks",
    "mpidp.ops.block_halo",
    "mpidp.ops.geometry",
    "mpidp.ops.halo_plan",
    "mpidp.preflight.validate",
    "mpidp.parallel.probe",
]


@pytest.mark.parametrize("module", MODULES)
def test_api_reference_covers_every_public_name(module):
    import importlib

    text = (ROOT / "docs" / "api.md").read_text()
    with warnings.catch_warnings():  # mpidp.anemoi is documented until it goes
        warnings.filterwarnings("ignore", "mpidp.anemoi has moved", DeprecationWarning)
        names = importlib.import_module(module).__all__
    missing = [n for n in names if f"**`{n}`**" not in text]
    assert not missing, f"docs/api.md lacks {module}: {missing}"
