"""Temporary files of mpidp's atomic writes (no MPI): their names carry the writer's pid and
host, and a later write removes those whose writer is dead, never anything else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from mpidp.io._common import WriterTag, host_hash, remove_dead_temporaries, temporary_name


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)


def test_temporary_names_carry_the_writer(tmp_path: Path) -> None:
    tmp = temporary_name(tmp_path / "model.pt", WriterTag(0xABC, 4242, 0x1234))
    assert tmp.name == ".model.pt.tmp-abc-p4242-h00001234"
    assert temporary_name(tmp_path / "x.nc", 7).name == (
        f".x.nc.tmp-7-p{os.getpid()}-h{host_hash():08x}"
    )


def test_only_the_temporaries_of_dead_writers_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    here, hour_ago = host_hash(), time.time() - 7200
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        files = {
            "dead here": f".model.pt.tmp-1-p{_dead_pid()}-h{here:08x}",
            "alive here": f".model.pt.tmp-2-p{alive.pid}-h{here:08x}",
            "this process": f".model.pt.tmp-3-p{os.getpid()}-h{here:08x}",
            "elsewhere, recent": f".model.pt.tmp-4-p1-h{here ^ 1:08x}",
            "elsewhere, old": f".model.pt.tmp-5-p1-h{here ^ 1:08x}",
            "not ours": ".model.pt.tmp-dead",
            "another target": f".other.pt.tmp-6-p{_dead_pid()}-h{here:08x}",
        }
        for name in files.values():
            (tmp_path / name).write_bytes(b"x")
        old = tmp_path / files["elsewhere, old"]
        os.utime(old, (hour_ago, hour_ago))
        removed = remove_dead_temporaries(path)
        assert sorted(removed) == sorted([files["dead here"], files["elsewhere, old"]])
        kept = sorted(p.name for p in tmp_path.iterdir())
        assert kept == sorted(
            n for k, n in files.items() if k not in ("dead here", "elsewhere, old")
        )
    finally:
        alive.kill()
        alive.wait()
