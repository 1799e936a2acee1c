"""The examples run for real: training at 1 process and at 4 (dp 2 x domain 2) reaches the same
validation loss, resuming at another rank count continues the same run, inference writes a
file xarray opens, the uneven-shards experiment reproduces the serial result."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import BIN, LAUNCHER, MPIEXEC, Job, clean_env, timed_out

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "train.py")
F64 = ["--precision", "float64", "--no-plot"]
# Steps of the runs compared with one process: enough to learn and to compare several losses
# (validation and the checkpoint come at the end either way, --val-every 50). A float64 step
# costs about 0.45 s of CPU here (one process: 8.7 s for 1 step, 14.4 s for 8, 19.5 s for 20).
STEPS, HALF, MLP_STEPS = "8", "4", "5"


def start(n: int, script: str, *args: str, timeout: int = 400) -> Job:
    """``script`` with ``args`` as one process or under mpiexec, started."""
    cmd = [sys.executable, script, *args]
    if n > 1:
        cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", script, *args]
    return Job(cmd, ROOT, timeout)


def finished(job: Job) -> str:
    """The job's stdout once it ended; fails with its output unless it exited 0."""
    res = job.wait()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def launch(n: int, script: str, *args: str, timeout: int = 400) -> str:
    return finished(start(n, script, *args, timeout=timeout))


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


class OneProcess:
    """A one-process training run of the module's fixtures: started when a test first asks
    for it, it runs beside that test's own job (one process leaves a core idle); :attr:`out`
    waits for it."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.folder, self.job = folder, start(1, TRAIN, *args, "--out", str(folder))

    @property
    def out(self) -> Path:
        finished(self.job)
        return self.folder


@pytest.fixture(scope="module")
def serial_run(tmp_path_factory):
    run = OneProcess(tmp_path_factory.mktemp("serial"), "--steps", STEPS, *F64)
    yield run
    run.job.stop()


def test_train_four_ranks_two_by_two_matches_one_process(serial_run, tmp_path):
    log = launch(4, TRAIN, "--steps", STEPS, *F64, "--out", str(tmp_path))
    one, four = metrics(serial_run.out), metrics(tmp_path)
    assert one["val_skill"]["variables"]["t2m"]["units"] == "K"
    assert one["val_skill"]["lead_hours"] == [6.0]  # the data's 6-hourly time coordinate
    for name, v in one["val_skill"]["variables"].items():
        for score, values in v.items():
            if score != "units":
                w = four["val_skill"]["variables"][name][score]
                assert values == pytest.approx(w, rel=1e-12), (name, score)
    *_, verdict, _, then = log.strip().splitlines()  # does it beat persistence? then what
    assert "persistence" in verdict
    assert then.endswith(f"-m mpi4py examples/inference.py --checkpoint {tmp_path}/checkpoint.pt")
    assert (four["world"], four["dp"], four["domain"]) == (4, 2, 2)
    assert (one["world"], one["dp"], one["domain"]) == (1, 1, 1)
    assert abs(one["val_loss"] - four["val_loss"]) <= 1e-12 * abs(one["val_loss"])
    for (s1, a), (s4, b) in zip(one["history"]["train"], four["history"]["train"], strict=True):
        assert s1 == s4 and abs(a - b) <= 1e-12 * abs(a)
    for name, v in one["val_rmse"].items():
        assert abs(v - four["val_rmse"][name]) <= 1e-12 * abs(v)
    assert one["val_loss"] < one["history"]["train"][0][1]  # it learned something
    assert "dp 2 x domain 2" in log and log.count("mpidp train:") == 1  # rank 0 alone prints
    assert (tmp_path / "checkpoint.pt").exists()


@pytest.fixture(scope="module")
def serial_mlp_run(tmp_path_factory):
    run = OneProcess(
        tmp_path_factory.mktemp("serial-mlp"), "--steps", MLP_STEPS, "--mlp", "5", *F64
    )
    yield run
    run.job.stop()


def _same_run(one: dict, other: dict) -> None:
    assert abs(one["val_loss"] - other["val_loss"]) <= 1e-12 * abs(one["val_loss"])
    for (s1, a), (s2, b) in zip(one["history"]["train"], other["history"]["train"], strict=True):
        assert s1 == s2 and abs(a - b) <= 1e-12 * abs(a)


@pytest.mark.parametrize("data", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_by_domain_two_by_two_match_one_process(serial_run, tmp_path, data):
    log = launch(4, TRAIN, "--steps", STEPS, "--data-parallel", data, *F64, "--out", str(tmp_path))
    got = metrics(tmp_path)
    assert (got["dp"], got["tensor"], got["domain"], got["data_parallel"]) == (2, 1, 2, data)
    assert f"dp 2 x domain 2 ({data})" in log
    _same_run(metrics(serial_run.out), got)


def test_blocks_two_by_two_match_one_process(serial_run, tmp_path):
    """``--domain 2x2``: latitude x longitude blocks (the reader's blocks, the converted U-Net
    on block ShardedTensors, the polar fold across longitude ranks) train the serial run."""
    log = launch(4, TRAIN, "--steps", STEPS, "--domain", "2x2", *F64, "--out", str(tmp_path))
    got = metrics(tmp_path)
    assert (got["dp"], got["domain"], got["grid"]) == (1, 4, [2, 2])
    assert "dp 1 x domain 2 x 2 blocks" in log
    _same_run(metrics(serial_run.out), got)


@pytest.mark.parametrize(
    "layout",
    [("none", "2", "2"), ("fsdp2", "2", "1")],
    ids=["tp2-domain2", "fsdp2-tp2"],
)
def test_tensor_parallel_layouts_match_one_process(serial_mlp_run, tmp_path, layout):
    data, tensor, domain = layout
    args = ["--data-parallel", data, "--tensor", tensor, "--domain", domain, "--mlp", "5"]
    launch(4, TRAIN, "--steps", MLP_STEPS, *args, *F64, "--out", str(tmp_path))
    got = metrics(tmp_path)
    assert (got["tensor"], got["domain"], got["dp"]) == (2, int(domain), 4 // (2 * int(domain)))
    _same_run(metrics(serial_mlp_run.out), got)


def test_resume_at_another_rank_count_continues_the_same_run(serial_run, tmp_path):
    launch(4, TRAIN, "--steps", HALF, *F64, "--out", str(tmp_path))
    launch(2, TRAIN, "--steps", STEPS, *F64, "--out", str(tmp_path), "--resume", "--domain", "1")
    got, want = metrics(tmp_path), metrics(serial_run.out)
    assert (got["dp"], got["domain"], got["steps_run"]) == (2, 1, int(STEPS) - int(HALF))
    assert abs(got["val_loss"] - want["val_loss"]) <= 1e-12 * abs(want["val_loss"])
    assert len(got["history"]["train"]) == int(STEPS)


@pytest.mark.parametrize("model", ["afno", "swin", "graph"])
def test_token_models_four_ranks_match_one_process(tmp_path, model):
    """92 x 180 grid in patches of 4 (23 token rows, cut 12/11 over 2 domain ranks).
    ``--model afno``: FourCastNet-style, its filters through mpidp.ops.fft. ``--model swin``:
    Pangu-style windows of 4 x 5 tokens (the rows padded to 24), unshifted then shifted,
    earth-specific bias. ``--model graph`` (91 x 180, no patches): GraphCast-style, grid ->
    512-node mesh -> grid through sharded graphs. The same run as one process."""
    args = ["--model", model, "--steps", "6", "--val-every", "3", *F64]
    serial = start(1, TRAIN, *args, "--out", str(tmp_path / "one"))  # beside the 4 ranks
    try:
        log = launch(4, TRAIN, *args, "--out", str(tmp_path / "four"))
        finished(serial)
    finally:
        serial.stop()
    one, four = metrics(tmp_path / "one"), metrics(tmp_path / "four")
    grid = "91 x 180" if model == "graph" else "92 x 180"
    assert f"mpidp train: {model}; 4 ranks = dp 2 x domain 2" in log and grid in log
    _same_run(one, four)
    assert one["val_loss"] < one["history"]["train"][0][1]  # it learned something


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    res = subprocess.run(
        [sys.executable, TRAIN, "--steps", "2", "--out", str(tmp_path), "--resume"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
    )
    assert res.returncode != 0 and "--resume: no checkpoint at" in res.stderr


def test_yaml_config_zarr_store_and_loss_curve(tmp_path):
    """A YAML config (a flag wins over it) whose ``data`` is a Zarr store: the Zarr reader
    feeds training (2 ranks, domain 2; an HDF5 reader would fail on a directory), and the loss
    curve is drawn. One job for the three."""
    pytest.importorskip("zarr")
    from mpidp.io import make_sample_data

    store = make_sample_data(tmp_path / "sample.zarr", n_time=20, format="zarr")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"data: {store}\nsteps: 3\nwidth: 4\nval_every: 3\nval_samples: 4\nlog_every: 1\n"
    )
    log = launch(2, TRAIN, "--config", str(cfg), "--out", str(tmp_path / "o"), "--lr", "1e-3")
    m = metrics(tmp_path / "o")
    assert m["steps"] == 3 and (m["dp"], m["domain"]) == (1, 2), log[-2000:]
    assert "step     3/3" in log
    losses = [v for _, v in m["history"]["train"]] + [m["val_loss"]]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert m["val_skill"]["lead_hours"] == [6.0]  # the store's time units
    png = (tmp_path / "o" / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_inference_from_a_four_rank_checkpoint_on_three_ranks(tmp_path):
    xr = pytest.importorskip("xarray")
    launch(4, TRAIN, "--steps", "4", "--out", str(tmp_path / "t"), "--no-plot")
    ckpt = str(tmp_path / "t" / "checkpoint.pt")
    common = ["--checkpoint", ckpt, "--steps", "3", "--start", "40", "--map", "z500"]
    inference = str(ROOT / "examples" / "inference.py")
    serial = start(1, inference, *common, "--out", str(tmp_path / "p1"))  # beside the 3 ranks
    try:
        log = launch(3, inference, *common, "--out", str(tmp_path / "p3"))
        finished(serial)
    finally:
        serial.stop()
    assert "the forecast from 2000-01-11 00:00 (time index 40) " in log  # the date, then the index
    with (
        xr.open_dataset(tmp_path / "p3" / "forecast-40.nc", engine="h5netcdf") as a,
        xr.open_dataset(tmp_path / "p1" / "forecast-40.nc", engine="h5netcdf") as b,
    ):
        assert dict(a.sizes) == {"time": 3, "latitude": 91, "longitude": 180}
        assert set(a.data_vars) == {"msl", "t2m", "t500", "t850", "z500", "z850"}
        assert str(a.time.values[0]).startswith("2000-01-11T06")  # time index 41, 6-hourly
        # float32 model and file: a few units in the last place of values near 5e4
        assert float(abs(a.z500 - b.z500).max()) <= 1e-6 * float(abs(b.z500).max())
        assert 40000 < float(a.z500.mean()) < 70000  # physical units (m2 s-2)
        # CF attributes from the source data (its units; long_name: the name and level)
        assert a.z500.attrs["units"] == "m2 s-2" and a.t2m.attrs["units"] == "K"
        assert a.z500.attrs["long_name"] == "geopotential at 500 hPa"
        assert a.t2m.attrs["standard_name"] == "air_temperature"
        assert all("units" in a[v].attrs and "long_name" in a[v].attrs for v in a.data_vars)
        assert a.latitude.attrs["units"] == "degrees_north"
    assert (tmp_path / "p3" / "z500-40+3.png").read_bytes()[:4] == b"\x89PNG"
    # skill against persistence and climatology, the same at any rank count
    s3, s1 = (json.loads((tmp_path / p / "skill-40.json").read_text()) for p in ("p3", "p1"))
    assert s3["steps"] == [1, 2, 3] and s3["lead_hours"] == [6.0, 12.0, 18.0]
    for name in ("t2m", "z500"):
        v3, v1 = s3["variables"][name], s1["variables"][name]
        assert v3["rmse_persistence"] == pytest.approx(v1["rmse_persistence"], rel=1e-12)
        assert v3["rmse"] == pytest.approx(v1["rmse"], rel=1e-5)  # float32 model
        assert all(
            0 < r < c for r, c in zip(v3["rmse_persistence"], v3["rmse_climatology"], strict=True)
        )


def test_uneven_shards_experiment_reproduces_serial():
    out = launch(3, str(ROOT / "examples" / "uneven_shards.py"), "--repeat", "2")
    assert "every partition computes the serial result" in out
    assert "weighted 2,1,1" in out and "reversed 1,1,2" in out


def test_rebalance_experiment_moves_rows_off_the_slow_rank():
    """The cut comes from the profile's measured seconds: the slow last rank gives rows away."""
    out = launch(2, str(ROOT / "examples" / "rebalance.py"), "--steps", "2")
    after = re.search(r"round1 +cut \[(\d+), (\d+)\]", out)
    assert "balanced cut [23, 22]" in out and after, out
    assert int(after[2]) < 22 and int(after[1]) + int(after[2]) == 45, out


def torchrun(nproc: int, *args: str) -> None:
    """``launchers/torchrun.sh examples/train.py ARGS`` with ``nproc`` processes."""
    res = subprocess.run(
        ["bash", "launchers/torchrun.sh", "examples/train.py", *args],
        env=clean_env(NPROC=str(nproc), TORCHRUN=str(BIN / "torchrun")),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_torchrun_launcher_trains(tmp_path):
    torchrun(2, "--steps", "2", "--no-plot", "--out", str(tmp_path))
    m = metrics(tmp_path)
    assert m["launcher"] == "torchrun" and (m["dp"], m["domain"]) == (1, 2)


def test_torchrun_fsdp2_by_tensor_parallel_matches_one_process(serial_mlp_run, tmp_path):
    """Without MPI: FSDP2 over dp 2 and the tensor-parallel layers over gloo, tp 2."""
    args = ["--data-parallel", "fsdp2", "--tensor", "2", "--domain", "1", "--mlp", "5"]
    torchrun(4, *args, "--steps", MLP_STEPS, *F64, "--out", str(tmp_path))
    got = metrics(tmp_path)
    assert got["launcher"] == "torchrun" and (got["dp"], got["tensor"]) == (2, 2)
    _same_run(metrics(serial_mlp_run.out), got)


def test_mpirun_launcher_script(tmp_path):
    """launchers/mpirun.sh running `mpidp info -d 2 --json` at 4 ranks: its flags, and the
    2 x 2 mesh (each rank's place in it, 4 processes)."""
    res = subprocess.run(
        ["bash", "launchers/mpirun.sh", "-m", "mpidp", "info", "-d", "2", "--json"],
        env=clean_env(NP="4", MPIRUN=MPIEXEC, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # the script asked the launcher what it is and chose its flags (Open MPI -x, Hydra -genv)
    flag = "-x OMP_NUM_THREADS=" if LAUNCHER == "openmpi" else "-genv OMP_NUM_THREADS"
    assert flag in res.stderr, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["world_size"] == 4 and doc["mesh"] == {"dp": 2, "domain": 2}
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert [r["mesh_coords"] for r in doc["ranks"]] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert {r["launcher"] for r in doc["ranks"]} == {LAUNCHER}
    assert len({r["pid"] for r in doc["ranks"]}) == 4


def test_gpu_script_dry_run_on_cpu():
    """scripts/test-gpu.sh has never run on a GPU here; its dry run (the same steps on CPU
    tensors at 1 and 2 ranks; the step benchmark, 20 s here, is left out) keeps it from rotting
    in the CPU CI."""
    env = clean_env(PYTHON=sys.executable, MPIDP_GPU_BENCH="0")
    cmd = ["bash", str(ROOT / "scripts" / "test-gpu.sh"), "--cpu"]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        raise timed_out(exc) from None
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("9 passed") == 2 and "test-gpu: passed on cpu" in res.stdout


def _mistake(n: int, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(ROOT / script), *args]
    return subprocess.run(
        cmd, env=clean_env(), capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--domain", "x"], "--domain 'x': give the ranks per domain group"),
        (["--domain", "2"], "does not divide the 3 ranks of this launch"),
        (["--batch", "4", "--domain", "1"], "--batch 4 must be a multiple of the 3 data-parallel"),
        (["--data", "nowhere.h5"], "--data nowhere.h5: no such file"),
    ],
)
def test_a_training_mistake_is_one_sentence_once_exit_2(tmp_path, args, said):
    res = _mistake(3, "examples/train.py", *args, "--out", str(tmp_path / "o"))
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-2000:]
    assert out.count(said) == 1 and "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "o").exists()  # stopped before any work


def test_inference_mistakes_stop_before_the_rollout(serial_run, tmp_path):
    ckpt = str(serial_run.out / "checkpoint.pt")
    res = _mistake(2, "examples/inference.py", "--checkpoint", ckpt, "--map", "foo",
                   "--out", str(tmp_path / "p"))  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out[-2000:]
    assert out.count("--map foo: ") == 1 and "draw one of msl, t500, t850, t2m, z500, z850" in out
    assert not (tmp_path / "p").exists()  # no rollout ran, nothing written
    res = _mistake(2, "examples/inference.py", "--checkpoint", str(tmp_path / "none.pt"))
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out[-2000:]
    assert out.count("no such file; train first (python examples/train.py") == 1
