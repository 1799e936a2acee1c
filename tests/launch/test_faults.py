"""Faults injected into real multi-rank jobs (tests/faults/jobs.py under mpiexec): ranks that
disagree on a collective's arguments or on mpidp.init's, a rank that skips a collective or the
backward of a halo exchange, errors that one rank raises alone, ranks killed mid-write, full
disks. Every rank that takes part must raise (or print) an mpidp error naming the values, the
rank and the fix, within seconds of the fault (MPIDP_TIMEOUT=2 for the calls skipped by a rank
that then sleeps; a rank that went on to another call is found without the deadline), no
temporary file may stay that the next write does not remove, and a communicator whose ranks
disagreed must still work for the next correct call."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_launch import MPIEXEC, clean_env

ROOT = Path(__file__).resolve().parents[2]
JOBS = str(ROOT / "tests" / "faults" / "jobs.py")


def job(case: str, *args: str, n: int = 2, **env: str) -> str:
    return job_result(case, *args, n=n, **env).stdout


def job_result(case: str, *args: str, n: int = 2, **env: str) -> subprocess.CompletedProcess[str]:
    """The finished job, its output (stdout and stderr together) as ``stdout``."""
    res = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", JOBS, case, *args],
        env=clean_env(PYTHONPATH=str(ROOT), **env),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    res.stdout += res.stderr
    return res


def since_fault(out: str) -> float:
    """Seconds from the fault (the first ``rank R ... at T`` line a job prints just before it:
    a rank that raises, skips, saves or is killed) to now, the job having ended. Measured from
    the fault, not from the launch: on a loaded machine python, torch and MPI take 10-20 s to
    start, which is not what the bounds are about (the job ending in seconds, not at a 60 s
    sleep or deadline)."""
    stamps = [float(t) for t in re.findall(r"rank \d+ [\w -]+? at (\d{10}\.\d+)", out)]
    assert stamps, out
    return time.time() - min(stamps)


def told_by_both(out: str, error: str, raised: int, heard: int) -> None:
    """``error`` (its type and the start of its message) printed by the rank that raised it
    (its traceback's last line) and by the rank that heard of it (the alarm channel's line),
    whichever rank's abort ended the job: the rank that raised (``python -m mpi4py``), or the
    other when the first is slow to exit. The launcher's own lines (``MPI_Abort``) are not
    looked for: a launcher that kills the job may drop what it had not forwarded yet."""
    text = " ".join(re.sub(r"\[rank\d\]: ", "", out).split())
    relay = (
        f"mpidp: rank {heard} of 2: the job ends because rank {raised} of 2 raised an error "
        f"that nothing caught: {error}"
    )
    assert relay in text, out
    assert text.count(error) == 2, out  # once in the relay, once in the raising rank's own


def caught(out: str) -> list[tuple[int, float, str]]:
    # ranks' lines may be glued together by the launcher: each message ends with " ##"
    found = re.findall(r"CAUGHT rank (\d+) after ([\d.]+) s: (.*?) ##", out, re.S)
    return [(int(r), float(s), msg) for r, s, msg in found]


# ids that are not "mpi": pytest-mpi would take that keyword for its marker and skip the test
@pytest.mark.parametrize("transport", ["mpi", "torch"], ids=["mpi-transport", "gloo"])
def test_disagreeing_ranks_raise_on_every_rank_and_the_group_survives(transport):
    out = job("disagreements", transport)
    assert "NOT CAUGHT" not in out, out
    got = caught(out)
    assert sorted(r for r, _, _ in got) == [0] * 7 + [1] * 7, out
    for _, seconds, msg in got:
        assert msg.startswith("CommError: rank ") and seconds < 10, msg
    by_case = [msg for r, _, msg in got if r == 0]
    assert "rank 0: ('all_gather_v', (2, 3)" in by_case[0]
    assert "rank 1: ('all_gather_v', (2, 2)" in by_case[0]
    assert "torch.float32" in by_case[1] and "torch.int32" in by_case[1]
    assert "(4,)" in by_case[2] and "(5,)" in by_case[2]
    assert (
        "sync_gradients: the ranks hold gradients for different parameters: 'bias': "
        in (by_case[3])
    )
    assert "no gradient (requires_grad=False) on ranks [1]" in by_case[3]
    assert "matching send and receive counts" in by_case[4]
    assert (
        "rank 1: ('all_to_all_v', torch.float32, (3,), 'send rows [1, 1]', 'receive rows [1, 2]')"
        in by_case[4]
    )
    scatter = [msg for _, _, msg in got if "scatter_v" in msg or "sum(sizes)" in msg]
    assert len(scatter) == 2 and all(
        "has 5 entries along dim 0 but sum(sizes) = 4" in m for m in scatter
    )
    assert any(m.startswith("CommError: rank 1 of 2: from rank 0 of 2:") for m in scatter)
    local = [msg for _, _, msg in got if "has 3 entries along dim 0 but sizes[1] = 2" in msg]
    assert len(local) == 2
    assert any(m.startswith("CommError: rank 1 of 2: tensor of shape (3, 4)") for m in local)
    assert any(
        m.startswith("CommError: rank 0 of 2: all_gather_v cannot run: rank 1") for m in local
    )
    assert "OK rank 0: [0.0, 1.0]" in out and "OK rank 1: [0.0, 1.0]" in out


def test_init_with_different_layouts_is_an_error_on_every_rank():
    got = caught(job("init-sizes"))
    assert sorted(r for r, _, _ in got) == [0, 1]
    for _, _, msg in got:
        assert "ConfigError" in msg and "domain_parallel_size" in msg
        assert "rank 0: domain_parallel_size=2" in msg and "rank 1: domain_parallel_size=1" in msg


def test_a_second_init_on_one_rank_ends_the_job_at_once_with_its_message_on_every_rank():
    out = job("second-init-on-one-rank")
    assert since_fault(out) < 40, out  # rank 1 sleeps 60 s: the abort ended it
    text = " ".join(out.split())
    # rank 1, waiting in a collective, says why the job ends too, naming the rank it came from
    told_by_both(
        out,
        "mpidp.errors.ConfigError: rank 0 of 2: mpidp is already initialised with "
        "domain_parallel_size=2",
        raised=0,
        heard=1,
    )
    assert "called again with domain_parallel_size=1" in text and "shutdown() first" in text


def _aborted_after_deadline(out: str) -> str:
    """The deadline's message: rank 0 entered the call and waited 2-4 s for rank 1."""
    assert re.search(r"rank 0 enters at [\d.]+", out), out
    found = re.search(r"mpidp CommTimeout: (.*?)(?:\n\n|\Z)", out, re.S)
    assert found, out
    msg = " ".join(found.group(1).split())
    waited = float(re.search(r"after ([\d.]+) s \(deadline 2 s\)", msg).group(1))
    assert 2 <= waited < 4, msg
    assert "Aborting the job" in msg and "MPIDP_TIMEOUT" in msg
    return msg


def test_a_bad_rendezvous_address_ends_every_rank_at_once_naming_it():
    """torchrun's variables with a MASTER_ADDR that does not resolve, both ranks started: a
    LaunchError on each, naming the rank, the address, the port and the fix, within seconds.
    Rank 0 used to wait the whole timeout (here 90 s; 600 s by default) for a rank 1 that can
    never reach it, and rank 1's message was the only one. (Each process imports torch on a
    loaded machine: up to half a minute here.)"""
    code = "import mpidp; mpidp.init(timeout=90)"
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=clean_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="no-such-host.invalid",
                MASTER_PORT="29531",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for rank, proc in enumerate(procs):
        _, stderr = proc.communicate(timeout=240)
        err = " ".join(stderr.split())
        assert proc.returncode != 0 and f"LaunchError: rank {rank} of 2 (torchrun): " in err, err
        assert "MASTER_ADDR='no-such-host.invalid' (MASTER_PORT='29531') does not resolve" in err
        assert "set MASTER_ADDR to rank 0's host name or IP address" in err
    assert time.monotonic() - start < 60


def test_a_skipped_collective_aborts_the_job_at_the_deadline():
    out = job("skipped-collective", MPIDP_TIMEOUT="2")
    assert since_fault(out) < 40, out  # rank 1 sleeps 60 s: the abort ended it
    msg = _aborted_after_deadline(out)
    assert msg.startswith("rank 0 of 2 (MPI group of 2): all_gather_v did not complete")


def test_a_skipped_collective_on_the_torch_transport_names_the_call():
    """gloo's own timeout (the manager's, 3 s) ends the wait; the error names the call, the
    rank and what to look for, instead of gloo's bare message."""
    got = caught(job("skipped-collective-torch"))
    assert [r for r, _, _ in got] == [0], got
    _, seconds, msg = got[0]
    assert 2.5 < seconds < 10, msg
    assert msg.startswith(
        "CommError: rank 0 of 2 (torch.distributed, gloo): the argument check of all_gather_v "
        "failed: Timed out waiting 3000ms"
    ), msg
    assert "another rank of the group did not enter the same call" in msg


def test_a_backward_skipped_on_one_rank_aborts_naming_the_peer():
    out = job("skipped-halo-backward", MPIDP_TIMEOUT="2")
    assert since_fault(out) < 40, out
    msg = _aborted_after_deadline(out)
    assert "halo) waiting for messages from ranks [1]" in msg


def test_an_error_on_one_rank_ends_the_job_without_python_m_mpi4py_too():
    """The same second init on rank 0, in a job started as ``python jobs.py`` (no abort on an
    uncaught error): rank 0 exits, and rank 1, waiting in a collective, used to wait for the
    whole deadline (here 60 s). It prints rank 0's error, and the job ends in seconds: by the
    launcher when rank 0's exit ends it, else by rank 1, which aborts a job still running a few
    seconds after it heard (which of the two comes first depends on the machine's load)."""
    res = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, JOBS, "second-init-on-one-rank"],
        env=clean_env(PYTHONPATH=str(ROOT), MPIDP_TIMEOUT="60"),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    out = res.stdout + res.stderr
    assert since_fault(out) < 40 and res.returncode != 0, out
    told_by_both(out, "mpidp.errors.ConfigError: rank 0 of 2: mpidp is already", raised=0, heard=1)


def test_an_error_inside_one_ranks_rollout_reaches_every_rank(tmp_path):
    """An exception inside ``with RolloutWriter`` on rank 1 only, uncaught, while rank 0 goes on
    to the next step: rank 1 discards the temporary file, the job ends within seconds, and rank
    0's output names rank 1 and its error (it used to say nothing); the old file is intact."""
    path = tmp_path / "forecast.nc"
    path.write_bytes(b"the previous forecast")
    res = job_result("rollout-raises-on-one-rank", str(path))
    assert since_fault(res.stdout) < 40, res.stdout
    assert res.returncode != 0
    told_by_both(res.stdout, "ValueError: the model diverged on rank 1 (injected)", 1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forecast.nc"], res.stdout
    assert path.read_bytes() == b"the previous forecast"


def test_an_error_one_rank_raises_inside_a_converted_layer_reaches_every_rank():
    """A module of a converted model that raises on rank 1 only, while rank 0 waits in the next
    layer's halo exchange: the job ends within seconds and rank 0's output names rank 1 and its
    error (issue 44: an error one rank alone can raise inside a layer is every rank's)."""
    res = job_result("layer-raises-on-one-rank")
    assert since_fault(res.stdout) < 40, res.stdout
    assert res.returncode != 0
    error = "RuntimeError: the layer's own check failed on this band (injected)"
    told_by_both(res.stdout, error, raised=1, heard=0)


def test_scatter_sizes_that_do_not_add_up_on_the_source_raise_on_every_rank():
    """mpidp.scatter_v (the differentiable one) whose sizes do not add up to the source's
    tensor: checked on the source alone, it used to raise there and leave rank 1 waiting in the
    scatter until the deadline. The source's message travels in the broadcast every rank takes
    part in: the same error on both ranks, naming the source."""
    got = caught(job("scatter-sizes-on-one-rank"))
    assert sorted(r for r, _, _ in got) == [0, 1], got
    want = (
        "scatter_v src tensor of shape (5, 2) has 5 entries along dim 0 but sum(sizes) = 4 "
        "(sizes [2, 2]); pass the sizes of the partition this tensor belongs to"
    )
    for rank, seconds, msg in got:
        msg = " ".join(msg.split())
        assert seconds < 10 and want in msg, msg
        head = "CommError: rank 0 of 2: " if rank == 0 else "CommError: rank 1 of 2: from rank 0"
        assert msg.startswith(head), msg


@pytest.mark.parametrize("then", ["sync", "exchange"])
def test_a_backward_skipped_on_one_rank_ends_the_job_in_seconds_not_at_the_deadline(then):
    """Rank 1 skips the backward through a halo and goes on (to sync_gradients, or to the next
    step's halo exchange) while rank 0 waits in the backward's exchange. With a deadline of
    60 s (600 s by default), both ranks find within seconds that the other waits for them in
    another call, and each prints which two calls; the exchange's number in the messages' tags
    keeps the next step's rows from ever arriving as the backward's."""
    res = job_result("skipped-halo-backward-then-next", then, MPIDP_TIMEOUT="60")
    assert since_fault(res.stdout) < 40 and res.returncode != 0, res.stdout
    text = " ".join(res.stdout.split())
    for rank in (0, 1):
        found = re.search(
            rf"mpidp CommDeadlock: rank {rank} of 2 \(MPI group of 2\): this rank has waited "
            rf"([\d.]+) s in (.*?) for rank {1 - rank}, which is waiting for this rank in another "
            rf"call: (.*?)\. Neither can go on",
            text,
        )
        assert found, res.stdout
        assert 4 < float(found.group(1)) < 15, found.group(0)
    assert "Aborting the job now rather than at the 60 s deadline; fix: make every rank" in text
    if then == "exchange":
        assert "in the backward of halo exchange 1 (mod 255) with ranks [1] for rank 1" in text
        assert "in halo exchange 2 (mod 255) with ranks [0] for rank 0" in text


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_write_sharded_leaves_a_file_the_next_write_removes(tmp_path, victim):
    """SIGKILL to one rank in the middle of ``write_sharded`` over an existing file: the job
    ends within seconds, the old file is intact, and the one temporary file left is named
    after its writer (world rank 0's pid and host), whom the next write to that path finds
    dead and whose file it removes."""
    from mpidp.io import write_sharded
    from mpidp.io._common import host_hash

    path = tmp_path / "field.nc"
    path.write_bytes(b"the previous field")
    res = job_result("killed-mid-write-sharded", str(path), str(victim))
    assert since_fault(res.stdout) < 40 and res.returncode != 0, res.stdout
    assert f"rank {victim} killed mid-write" in res.stdout, res.stdout
    assert path.read_bytes() == b"the previous field"
    left = [p.name for p in tmp_path.iterdir() if p.name != "field.nc"]
    assert len(left) == 1, (left, res.stdout)
    assert re.fullmatch(rf"\.field\.nc\.tmp-[0-9a-f]+-p\d+-h{host_hash():08x}", left[0]), left
    write_sharded(path, "t", np.ones((2, 3), dtype=np.float32), dims=("latitude", "longitude"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["field.nc"]


def test_a_checkpoint_save_that_fills_the_disk_ends_the_job_in_seconds(tmp_path):
    """A 4 MB checkpoint saved, uncaught, onto a 2 MB tmpfs that holds the previous one (an
    injected ENOSPC in torch.save where no tmpfs can be mounted): every rank raises the same
    DataError naming the full disk, the job ends within seconds, the previous checkpoint is
    intact and no temporary file is left."""
    with small_disk(tmp_path / "small", "2m") as mounted:
        path = tmp_path / "small" / "model.pt"
        path.write_bytes(b"the previous checkpoint")
        res = job_result("checkpoint-fills-disk", str(path), *([] if mounted else ["x"]))
        took = since_fault(res.stdout)
        left = sorted(p.name for p in path.parent.iterdir())
        kept = path.read_bytes()
    assert took < 40 and res.returncode != 0, res.stdout
    text = " ".join(re.sub(r"\[rank\d\]: ", "", res.stdout).split())
    for rank in (0, 1):
        assert (
            f"DataError: rank {rank}: save_checkpoint('{path}') failed; {path} was left as it "
            "was: rank 0: " in text
        ), res.stdout
    assert "free space or write elsewhere, then retry" in text
    if mounted:
        assert "is the disk full?" in text
    assert left == ["model.pt"] and kept == b"the previous checkpoint"


def test_a_rank_killed_mid_write_leaves_the_old_file_intact(tmp_path):
    """SIGKILL on rank 1 after the first step of a rollout over an existing file: the job ends
    within seconds (the launcher sees the dead rank, or the deadline does), the old file is
    byte for byte what it was, and the temporary file is what remains (reported by the next
    write to that path: tests/mpi/test_io.py)."""
    path = tmp_path / "forecast.nc"
    path.write_bytes(b"the previous forecast")
    out = job("killed-mid-write", str(path), MPIDP_TIMEOUT="5")
    assert since_fault(out) < 40, out
    assert path.read_bytes() == b"the previous forecast"
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".forecast.nc.tmp-")]
    assert len(left) == 1, (left, out)


def test_a_rank_killed_mid_zarr_write_leaves_the_old_store_intact(tmp_path):
    """The same for a Zarr store (a folder, replaced by two renames at publication): the job
    ends, ``xarray.open_zarr`` reads the previous values, and the temporary store is what
    remains."""
    import numpy as np
    import xarray as xr

    from mpidp.io import write_sharded

    path = tmp_path / "forecast.zarr"
    old = np.arange(32.0).reshape(1, 8, 4)
    write_sharded(path, "x", old, dims=("time", "latitude", "longitude"))
    out = job("killed-mid-zarr-write", str(path), MPIDP_TIMEOUT="5")
    assert since_fault(out) < 40, out
    assert "rank 0 writes step 2" in out, out
    with xr.open_zarr(path) as ds:
        np.testing.assert_array_equal(ds["x"].values, old)
    left = [p.name for p in tmp_path.iterdir() if p.name != "forecast.zarr"]
    assert len(left) == 1 and left[0].startswith(".forecast.zarr.tmp-"), (left, out)


def test_a_rollout_that_fills_the_disk_raises_everywhere_and_leaves_nothing(tmp_path):
    """A RolloutWriter on a 2 MB tmpfs (mounted here when the tests run as root; otherwise the
    free space is injected): HDF5 out of space mid-write used to crash the process in h5py.
    Now every rank raises a DataError naming the full disk, the temporary file is gone and the
    previous file is intact."""
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True
        ).returncode
        == 0
    )
    try:
        path = disk / "forecast.nc"
        path.write_bytes(b"the previous forecast")
        out = job("rollout-fills-disk", str(path), *([] if mounted else [str(2 << 20)]))
        got = caught(out)
        assert sorted(r for r, _, _ in got) == [0, 1], out
        for _, seconds, msg in got:
            assert msg.startswith("DataError: rank ") and seconds < 60, msg
            assert "No space left on device" in msg and "is the disk full?" in msg, msg
        assert "Segmentation fault" not in out
        assert sorted(p.name for p in disk.iterdir()) == ["forecast.nc"]
        assert path.read_bytes() == b"the previous forecast"
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[bool]:
    """``folder`` as a tmpfs of ``size`` when the tests run as root (True), else as it is."""
    folder.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_bad_inputs_raise_on_every_rank_naming_value_rank_and_fix(tmp_path):
    """Issue 33's faults that every rank can learn of, in one job: a band one row taller on
    rank 1 only (write_sharded with a spec, RolloutWriter with 13 latitudes), a 15-row file
    where a 13-row grid is expected, an HDF5 file whose header is garbled (read, and appended
    to), ``verify`` passed on rank 0 only (save and load: it was MPI's "Message truncated"),
    a checkpoint save on a full disk (a 256 kB tmpfs) and a parameter frozen on rank 1 only
    (sync_gradients). Each ends with the same mpidp error on both ranks within seconds; no
    temporary file is left and the previous checkpoint is intact."""
    work = tmp_path / "work"
    work.mkdir()
    with small_disk(tmp_path / "small", "256k") as mounted:
        out = job("bad-inputs", str(work), str(tmp_path / "small"), *([] if mounted else ["x"]))
        left = sorted(p.name for p in (tmp_path / "small").iterdir())
    assert "NOT CAUGHT" not in out, out
    got = caught(out)
    assert sorted(r for r, _, _ in got) == [0] * 9 + [1] * 9, out
    by_rank: dict[int, list[str]] = {0: [], 1: []}
    for r, seconds, msg in got:
        assert seconds < 10 and msg.split(": ")[1].startswith(f"rank {r}"), msg
        by_rank[r].append(" ".join(msg.split()))
    cases = list(zip(by_rank[0], by_rank[1], strict=True))
    for i, (m0, m1) in enumerate(cases):  # the same error on both ranks, each naming itself
        assert m0.replace("rank 0", "rank *", 1) == m1.replace("rank 1", "rank *", 1), i
    first = [m0 for m0, _ in cases]
    assert first[0].startswith("DataError: rank 0: write_sharded(") and (
        "spec is [7, 6] (rank 1 holds 7 where spec gives it 6)" in first[0]
    )
    assert (
        "bands have [7, 7] rows (14 in all) of 8 longitudes, but the coordinates give a 13 x 8 "
        "grid (rank 1 holds 7 rows where a balanced split of 13 gives it 6); fix: pass each "
        "rank its own band of that grid (manager.spec(13).sizes gives each rank's rows)"
        in (first[1])
    )
    assert (
        "wide.nc holds a 15 x 8 (lat x lon) grid but the model expects (13, 8) (the grid argument)"
        in first[2]
    )
    assert "fix: use the files of the model's resolution" in first[2]
    assert (
        "ranks [0, 1]: " in first[3]
        and "broken.nc: not a readable HDF5/netCDF-4 file" in (first[3])
    )
    assert "its header or metadata is damaged, or it is of another format; restore it" in (first[3])
    assert "Unable to synchronously open file" in first[3] and "fix: pass existing" in first[3]
    assert (
        "mode='a' but" in first[4] and "restore it, or write a new file with mode='w'" in first[4]
    )
    for save_or_load in first[5:7]:
        assert "rank 1: verify=False but rank 0 passed True" in save_or_load
        assert re.search(r"fix: .*the same .*verify", save_or_load), save_or_load
    assert (
        first[7].startswith("DataError: rank 0: save_checkpoint(")
        and "was left as it was" in (first[7])
    )
    if mounted:
        assert "is the disk full?" in first[7] and "free space or write elsewhere" in first[7]
    assert "'1.weight': gradient (2, 4) torch.float32 on ranks [0]; no gradient " in first[8]
    assert "(requires_grad=False) on ranks [1]; freeze the same parameters" in first[8]
    # nothing but the files the job made: the broken file untouched, no temporary file
    assert "LEFT ['broken.nc', 'model.pt', 'wide.nc', 'model.pt'] step 1" in out, out
    assert left == ["model.pt"]


def test_a_band_of_another_height_on_one_rank_aborts_the_job(tmp_path):
    """ShardedTensor.from_local(band, spec=...) agrees across ranks: with rank 1's band one row
    too tall, every rank raises the same ConfigError naming rank 1 and the rows it should hold,
    and the job ends in seconds with a non-zero code (``python -m mpi4py``'s abort)."""
    res = job_result("band-height-on-one-rank")
    assert since_fault(res.stdout) < 40 and res.returncode != 0, res.stdout
    text = " ".join(re.sub(r"\[rank\d\]: ", "", res.stdout).split())
    want = (
        "ConfigError: rank {}: from_local: the ranks' bands do not tile the 2 x 1 grid: rank 1: "
        "the band has 7 rows but spec [7, 6] (13 rows) gives domain rank 1 6; fix: pass this "
        "rank rows 7..12 of the field (its band of that spec)"
    )
    assert any(want.format(r) in text for r in (0, 1)), res.stdout


def test_a_job_killed_mid_checkpoint_leaves_nothing_for_the_next_run(tmp_path):
    """SIGTERM, then SIGKILL, to rank 0 in the middle of torch.save of a checkpoint: each job
    ends at once, the previous checkpoint is intact, and the temporary file it leaves is
    removed by the next save to that path (its writer, named in the file name, is dead): the
    second job's first save removes the first job's; the second job's is removed by the same
    call that save makes (here, instead of a third job)."""
    from mpidp.io._common import remove_dead_temporaries

    path = tmp_path / "model.pt"
    left: list[str] = []
    for run, sig in enumerate(["TERM", "KILL"], 1):
        res = job_result("killed-mid-checkpoint", str(path), sig, str(run))
        assert since_fault(res.stdout) < 40, res.stdout
        assert res.returncode != 0 and "rank 0 killed mid-write" in res.stdout, res.stdout
        assert torch.load(path, weights_only=False)["step"] == run, res.stdout
        tmp = sorted(p.name for p in tmp_path.iterdir() if p.name != "model.pt")
        assert len(tmp) == 1, (tmp, res.stdout)
        assert re.fullmatch(r"\.model\.pt\.tmp-[0-9a-f]+-p\d+-h[0-9a-f]{8}", tmp[0])
        if left:  # this run's first save removed the previous run's temporary file
            assert f"BEFORE {sorted(['model.pt', *left])} AFTER ['model.pt']" in res.stdout
        left = tmp
    assert remove_dead_temporaries(path) == left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
