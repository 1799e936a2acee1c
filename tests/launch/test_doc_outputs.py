"""The sample outputs shown in README.md and docs/*.md are the programs' real output.

A sample output is a fenced block right after a marker line naming the command that prints it::

    <!-- output-of: .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py examples/train.py -->
    ```text
    mpidp train: unet; 4 ranks = dp 2 x domain 2; ...
    ```

The test runs each command once (blocks that name the same command share the run), all in one
temporary folder whose ``examples`` is the repository's and whose ``.venv`` is the suite's
environment (a launcher outside it, a system MPI, replaces ``.venv/bin/mpiexec``), in the
order the pages show them (README.md first, then docs/ by name), every earlier command before
a later one even when the later one is run alone: the README's inference reads the checkpoint
its training wrote. ``NAME=value`` words before a command set its environment. It compares
the block with what the command printed on stdout: the block's lines are consecutive lines of
the output; a line ``...`` stands for any number of lines, and ``...`` inside a line for any
text. Numbers with a decimal point may differ by 0.1% or by three units in their last digit
shown; integers must be equal; durations (a number followed by ``s``, ``ms``, ``min`` or
``s/step``) are not compared.
"""

from __future__ import annotations

import difflib
import math
import re
import shlex
import subprocess
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest
from test_docs import PAGES, ROOT
from test_launch import BIN, MPIEXEC, clean_env, timed_out

MARKED = re.compile(r"^<!-- output-of: (.+?) -->[ \t]*\n```[^\n]*\n(.*?)^```", re.S | re.M)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
DURATION = re.compile(r"\s?(?:ms|min|s)(?![A-Za-z0-9_-])")
RTOL = 1e-3
UNITS = 3  # in the last digit shown


@dataclass(frozen=True)
class Sample:
    """One marked block: its page, the line its fence starts on, the command and the text."""

    page: Path
    line: int
    command: str
    text: str

    def __repr__(self) -> str:
        return f"{self.page.name}:{self.line}"


def samples(pages: list[Path] = PAGES) -> list[Sample]:
    found = []
    for page in pages:
        text = page.read_text()
        for m in MARKED.finditer(text):
            line = text.count("\n", 0, m.start()) + 2
            found.append(Sample(page, line, m.group(1).strip(), m.group(2)))
    return found


def _pattern(shown: str) -> tuple[re.Pattern[str], list[str | None]]:
    """A regex for one shown line (a group per number) and, per group, the number as shown
    (None: a duration, not compared)."""
    parts, numbers, at = [], [], 0
    pieces = shown.split("...")
    for i, piece in enumerate(pieces):
        at = 0
        for m in NUMBER.finditer(piece):
            parts.append(re.escape(piece[at : m.start()]))
            parts.append(r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf)")
            numbers.append(None if DURATION.match(piece, m.end()) else m.group())
            at = m.end()
        parts.append(re.escape(piece[at:]))
        if i < len(pieces) - 1:
            parts.append(".*?")
    return re.compile("".join(parts)), numbers


def _close(shown: str, real: str) -> bool:
    if not re.search(r"[.eE]", shown):
        return shown == real
    last = Decimal(shown).as_tuple().exponent  # the place of the last digit shown
    unit = 10.0 ** int(last) if isinstance(last, int) else 0.0
    return math.isclose(float(shown), float(real), rel_tol=RTOL, abs_tol=UNITS * unit * 1.0001)


def line_matches(shown: str, real: str) -> bool:
    """Whether ``real`` is ``shown`` up to the numbers' last digits (see the module's doc)."""
    pattern, numbers = _pattern(shown.rstrip())
    m = pattern.fullmatch(real.rstrip())
    if m is None:
        return False
    return all(n is None or _close(n, v) for n, v in zip(numbers, m.groups(), strict=True))


def find(shown: list[str], real: list[str]) -> str:
    """Empty when ``shown`` is a run of consecutive lines of ``real`` (``...`` lines: any
    number of lines); else the furthest shown line that no placement matches, with the real
    line most like it."""
    furthest = [0]

    def match(i: int, j: int) -> bool:
        if i == len(shown):
            return True
        if shown[i].strip() == "...":
            return any(match(i + 1, k) for k in range(j, len(real) + 1))
        if j < len(real) and line_matches(shown[i], real[j]):
            return match(i + 1, j + 1)
        furthest[0] = max(furthest[0], i)
        return False

    if any(match(0, start) for start in range(len(real) + 1)):
        return ""
    i = furthest[0]
    near = difflib.get_close_matches(shown[i], real, n=1, cutoff=0) or ["(no output)"]
    return f"shown line {i + 1}:\n  {shown[i]}\nnearest real line:\n  {near[0]}"


def command_argv(command: str) -> tuple[list[str], dict[str, str]]:
    """The documented command as it is run in the folder whose ``.venv`` is the suite's
    environment (the launcher replaced where it is not in it: a system MPI), and the variables
    it sets (``NAME=value`` words before it)."""
    argv = shlex.split(command)
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    for k, word in enumerate(argv):
        if word == ".venv/bin/mpiexec" and Path(MPIEXEC).parent != BIN:
            argv[k] = MPIEXEC
        elif word.startswith(".venv/bin/") and not (BIN / word.removeprefix(".venv/bin/")).exists():
            raise FileNotFoundError(f"{word}: not in the suite's environment {BIN.parent}")
    return argv, env


SAMPLES = samples()


def test_quickstart_shows_sample_outputs():
    assert any(s.page.name == "quickstart.md" for s in SAMPLES), [repr(s) for s in SAMPLES]


def test_the_comparison_allows_last_digits_and_nothing_else():
    real = [
        "start",
        "step 10: loss 0.018802; RMSE msl 158.8, t2m 1.436; 6 channels (msl, t2m)",
        "done: 40 steps in 7.1 s (0.18 s/step)",
        "",
        "end",
    ]
    assert find(real[1:3], real) == ""
    assert find(["step 10: loss 0.018803; RMSE msl 158.9, t2m 1.44; ...", "..."], real) == ""
    assert find(["done: 40 steps in 99 s (2.5 s/step)"], real) == ""  # durations differ
    assert find(["start", "...", "end"], real) == ""
    assert "nearest real line" in find(["done: 41 steps in 7.1 s (0.18 s/step)"], real)
    assert find(["step 10: loss 0.0197; ..."], real)  # 5% off
    assert find(["step 10: loss 0.018802; RMSE msl 158.8, t2m 1.44; ..."], real) == ""
    assert find(["step 10: loss 0.018802; RMSE msl 158.8, t2m 1.446; ..."], real)  # 10 units
    assert find(["step 10: loss 0.018802; RMSE msl 158.8, t2m 1.436; 6 chanels (msl, t2m)"], real)
    assert find(["start", "end"], real)  # a line left out without "..."


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Each marked command's stdout, run once, in one folder, after every command before it."""
    done: dict[str, str] = {}
    folder = tmp_path_factory.mktemp("doc-output")
    (folder / "examples").symlink_to(ROOT / "examples")
    (folder / ".venv").symlink_to(BIN.parent)
    order = list(dict.fromkeys(s.command for s in SAMPLES))

    def run(command: str) -> str:
        for earlier in order[: order.index(command)]:
            run(earlier)
        if command not in done:
            argv, env = command_argv(command)
            try:
                res = subprocess.run(
                    argv,
                    env=clean_env(**env),
                    capture_output=True,
                    text=True,
                    timeout=400,
                    cwd=folder,
                )
            except subprocess.TimeoutExpired as exc:
                raise timed_out(exc) from None
            assert res.returncode == 0, f"{command}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
            done[command] = res.stdout
        return done[command]

    return run


@pytest.mark.parametrize("sample", SAMPLES, ids=repr)
def test_sample_output_is_the_real_output(sample, outputs):
    real = outputs(sample.command).splitlines()
    problem = find(sample.text.splitlines(), real)
    assert not problem, (
        f"{sample!r}: the block differs from what `{sample.command}` prints; {problem}\n"
        f"the real output:\n" + "\n".join(real)
    )
