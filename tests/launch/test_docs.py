"""The Python code blocks of README.md and docs/*.md run, so the docs cannot rot.

The blocks of one page run in order as one script (later blocks may use names from earlier
ones), in a folder of its own, once as one process and once under ``mpiexec -n 2``. A block
fenced as ```python (or ```py, ```Python, ```python3: any Python tag) is always run; there is no
way to opt out.

The pages of one rank count run one after another in one job (RUNNER), which saves a start of
python, torch and MPI per page (28 jobs were about a third of the launch stage's time): each
page in a fresh namespace as ``__main__``, in its own folder, with the environment, torch's
default dtype and grad mode restored and mpidp shut down after it, so no page sees what
another left. An uncaught error ends the job (``python -m mpi4py``): that page's test fails
with the error, and the pages after it fail as not reached.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_launch import MPIEXEC, Job

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


# Runs the page scripts named on its command line one after another (see the module's doc).
RUNNER = """
import gc, os, runpy, sys
import torch
import mpidp
for script in sys.argv[1:]:
    name = os.path.basename(os.path.dirname(script))
    env, dtype, grad = dict(os.environ), torch.get_default_dtype(), torch.is_grad_enabled()
    os.chdir(os.path.dirname(script))
    sys.argv, sys.path[0] = [script], os.path.dirname(script)  # as `python script` has them
    print(f"PAGE-START {name}", flush=True)
    runpy.run_path(script, run_name="__main__")
    if mpidp.is_initialized():
        mpidp.get_manager().shutdown()
    os.environ.clear()
    os.environ.update(env)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    gc.collect()
    print(f"PAGE-OK {name}", flush=True)
"""


@pytest.fixture(scope="module")
def page_jobs(request, tmp_path_factory):
    """The job of each rank count that ran every page: the rank counts the selected tests ask
    for, all started when the first is asked for (the one-process job leaves a core idle: it
    runs beside the 2-rank one)."""
    jobs: dict[int, Job] = {}

    def launch(ranks: int) -> Job:
        folder = tmp_path_factory.mktemp(f"pages-{ranks}")
        scripts = []
        for page in WITH_CODE:
            (folder / page.name).mkdir()
            script = folder / page.name / f"{page.stem}.py"
            script.write_text("\n\n".join(blocks(page)))
            scripts.append(str(script))
        (folder / "runner.py").write_text(RUNNER)
        cmd = [sys.executable, "-m", "mpi4py", str(folder / "runner.py"), *scripts]
        if ranks > 1:
            cmd = [MPIEXEC, "-n", str(ranks), *cmd]
        return Job(cmd, folder, 900, PYTHONPATH=str(ROOT))  # 124 when over its time: once

    def job(ranks: int) -> subprocess.CompletedProcess[str]:
        if not jobs:
            wanted = {
                item.callspec.params["ranks"]
                for item in request.session.items
                if getattr(item, "originalname", "") == "test_code_blocks_run"
            }
            for n in sorted(wanted | {ranks}):
                jobs[n] = launch(n)
        return jobs[ranks].wait()

    yield job
    for started in jobs.values():
        started.stop()


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("page", WITH_CODE, ids=[p.name for p in WITH_CODE])
def test_code_blocks_run(page, ranks, page_jobs):
    res = page_jobs(ranks)
    if f"PAGE-OK {page.name}\n" in res.stdout:
        return
    started = re.findall(r"^PAGE-START (\S+)$", res.stdout, re.M)
    if page.name not in started:
        pytest.fail(f"{page.name} at {ranks} ranks: not reached; {started[-1:]} failed first")
    pytest.fail(f"{page.name} at {ranks} ranks:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")


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
