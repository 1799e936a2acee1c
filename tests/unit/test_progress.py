"""Progress of long work: a bar on a terminal, whole lines in a batch log (one per interval, no
carriage returns), nothing on the ranks that are not asked to print."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

from mpidp.runtime.progress import Progress

ROOT = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_batch_log_gets_one_line_per_interval(capsys):
    bar = Progress(10, every=3)
    for step in range(1, 11):
        bar.update(step, f"loss {1 / step:.3f}")
    bar.close()
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split()[1] for line in lines] == ["3/10", "6/10", "9/10", "10/10"]
    assert lines[0].startswith("step     3/10  loss 0.333  ") and lines[0].endswith(" s/step")
    assert "\r" not in out and err == ""


def test_terminal_gets_one_bar_redrawn_in_place(monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = Progress(4, label="field", prefix="sample data: ", rate=False)
    for _ in range(4):
        bar.advance("t2m")
    bar.message("halfway")
    bar.close()
    drawn = terminal.getvalue()
    assert drawn.count("\r[") == 4 and "[" + "#" * 30 + "] sample data: field     4/4  t2m" in drawn
    assert capsys.readouterr().out == "sample data: halfway\n"


def test_other_ranks_print_nothing(capsys):
    bar = Progress(3, enabled=False)
    for step in range(1, 4):
        bar.update(step)
    bar.message("validation")
    bar.close()
    assert capsys.readouterr() == ("", "")


def test_delay_keeps_quick_work_quiet_and_shows_slow_work(capsys):
    quick = Progress(2, every=1, delay=30.0)
    quick.update(1, "building")
    quick.close()
    slow = Progress(2, every=1, delay=0.05, rate=False)
    slow.update(1, "building")
    time.sleep(0.3)  # the timer shows the pending stage though no update came
    slow.close()
    assert capsys.readouterr().out == "step     1/2  building\n"


def test_sample_data_in_a_batch_log(tmp_path):
    """``mpidp sample-data`` with stdout a pipe: a line per field, no carriage returns."""
    path = tmp_path / "s.h5"
    cmd = [sys.executable, "-m", "mpidp", "sample-data", str(path)]
    res = subprocess.run(
        [*cmd, "--lat", "7", "--lon", "8", "--time", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stdout + res.stderr
    lines = res.stdout.splitlines()
    fields = ["t2m", "msl", "z500", "z850", "t500", "t850"]
    for k, (line, name) in enumerate(zip(lines, fields, strict=False), 1):
        assert line.startswith(f"sample data: field {k:>5}/6  {name}  "), line
    assert len(lines) == 7 and lines[-1].startswith(f"mpidp: wrote {path}")
    assert path.exists()
