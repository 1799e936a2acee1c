"""Fault-injection jobs: ``python -m mpi4py tests/faults/jobs.py CASE`` under mpiexec.

Each case makes the ranks disagree and prints, on every rank that raised, ``CAUGHT rank R
after S s: Type: message``; or makes one rank skip a call, raise alone or die, which ends the
job with a message on every rank (the deadline, the alarm channel of mpidp.comm.alarm, or the
launcher). Run by tests/launch/test_faults.py, which checks every rank's message, the exit,
the time to end and the files left.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from mpi4py import MPI

import mpidp

ME = MPI.COMM_WORLD.Get_rank()


def caught(fn) -> None:
    start = time.monotonic()
    try:
        fn()
    except mpidp.MpidpError as err:
        took = time.monotonic() - start
        print(f"CAUGHT rank {ME} after {took:.1f} s: {type(err).__name__}: {err} ##", flush=True)
        return
    print(f"NOT CAUGHT rank {ME}", flush=True)


def disagreements() -> None:
    """Ranks that pass different arguments to one collective: each raises, then the next
    case runs on the same communicator (nothing is left half done). ``argv[2]``: the
    transport, ``mpi`` or ``torch`` (gloo)."""
    t = mpidp.init(transport=sys.argv[2]).transport("world")
    # sizes: rank 1 believes it owns 2 rows, rank 0 believes it owns 3 (a short message)
    sizes = [2, 3] if ME == 0 else [2, 2]
    caught(lambda: t.all_gather_v(torch.zeros(2, 4), sizes))
    # a dtype of the same width: float32 against int32
    dtype = torch.float32 if ME == 0 else torch.int32
    caught(lambda: t.all_gather_v(torch.zeros(2, 4, dtype=dtype), [2, 2]))
    # another row shape (trailing dims)
    caught(lambda: t.all_gather_v(torch.zeros(2, 4 + ME), [2, 2]))
    # a parameter frozen on one rank: the gradient buckets differ in length
    model = torch.nn.Linear(3, 2)
    if ME == 1:
        model.bias.requires_grad_(False)
    model(torch.ones(1, 3)).sum().backward()
    caught(lambda: mpidp.sync_gradients(model))
    # all_to_all_v whose receive counts do not match the send counts
    recv = [1, 1] if ME == 0 else [1, 2]
    caught(lambda: t.all_to_all_v(torch.zeros(2, 3), [1, 1], recv))
    # scatter_v whose sizes do not add up to the source's tensor: checked on the source only,
    # its error reaches every rank
    src = torch.zeros(5, 2) if ME == 0 else None
    caught(lambda: t.scatter_v(src, [2, 2]))
    # a tensor that does not match this rank's own entry of sizes, on rank 1 only: checked
    # there, raised on every rank
    caught(lambda: t.all_gather_v(torch.zeros(2 + ME, 4), [2, 2]))
    # and the communicator still works for a correct call
    out = t.all_gather_v(torch.full((1, 2), float(ME)), [1, 1])
    print(f"OK rank {ME}: {out[:, 0].tolist()}", flush=True)


def init_sizes() -> None:
    """Ranks that pass different domain_parallel_size to mpidp.init."""
    caught(lambda: mpidp.init(domain_parallel_size=2 if ME == 0 else 1))


def second_init_on_one_rank() -> None:
    """Rank 0 calls mpidp.init again with another layout, uncaught; rank 1 goes on to a
    collective. The repeat call is local (it raises at once, naming both layouts) and an
    uncaught error under ``python -m mpi4py`` aborts the whole job: rank 1 must not wait."""
    manager = mpidp.init(domain_parallel_size=2)
    if ME == 0:
        print(f"rank 0 raises at {time.time():.2f}", flush=True)
        mpidp.init(domain_parallel_size=1)
    manager.transport("world").all_gather_v(torch.zeros(1, 2), [1, 1])
    time.sleep(60)


def skipped_collective() -> None:
    """Rank 1 never enters the all_gather_v: rank 0 must not wait forever."""
    t = mpidp.init().transport("world")
    if ME == 0:
        print(f"rank 0 enters at {time.time():.2f}", flush=True)
        t.all_gather_v(torch.zeros(1, 2), [1, 1])
    time.sleep(60)


def skipped_collective_torch() -> None:
    """The same over the torch transport (gloo), whose deadline is torch's own timeout."""
    t = mpidp.init(transport="torch", timeout=3).transport("world")
    if ME == 0:
        caught(lambda: t.all_gather_v(torch.zeros(1, 2), [1, 1]))
    else:
        time.sleep(10)


def skipped_halo_backward() -> None:
    """The documented trap: the forward through a halo ran on every rank, the backward on
    rank 0 only."""
    manager = mpidp.init(domain_parallel_size=2)
    conv = mpidp.convert_to_domain_parallel(torch.nn.Conv2d(1, 1, 3, padding=1), manager)
    x = torch.randn(1, 1, 4, 6, requires_grad=True)
    y = conv(x)
    if ME == 0:
        print(f"rank 0 enters at {time.time():.2f}", flush=True)
        y.sum().backward()
    time.sleep(60)


def killed_mid_write() -> None:
    """A rollout over a file that exists: after one step, rank 1 is killed with SIGKILL. The
    job must end (not hang) and the old file must be intact; the temporary file stays behind
    for the next write to report."""
    import os
    import signal

    from mpidp.io import RolloutWriter

    path = sys.argv[2]
    manager = mpidp.init(domain_parallel_size=2)
    rows = manager.spec(8).sizes[manager.domain_rank]
    with RolloutWriter(path, ["a"], manager=manager) as out:
        out.write(torch.full((1, rows, 4), ME + 1.0))  # bands that differ: not copies
        MPI.COMM_WORLD.Barrier()
        if ME == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"rank 0 writes step 2 at {time.time():.2f}", flush=True)
        out.write(torch.full((1, rows, 4), ME + 1.0))


def killed_mid_zarr_write() -> None:
    """A Zarr rollout over a store that exists: after one step, rank 1 is killed with SIGKILL
    while rank 0 goes on to write the next step. The job must end and the old store must be
    intact."""
    import os
    import signal

    from mpidp.io import RolloutWriter

    path = sys.argv[2]
    manager = mpidp.init(domain_parallel_size=2)
    rows = manager.spec(8).sizes[manager.domain_rank]
    with RolloutWriter(path, ["x"], manager=manager, chunk_rows=3) as out:
        out.write(torch.full((1, rows, 4), 7.0 + ME))  # bands that differ: not copies
        MPI.COMM_WORLD.Barrier()
        if ME == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"rank 0 writes step 2 at {time.time():.2f}", flush=True)
        out.write(torch.full((1, rows, 4), 8.0 + ME))


def rollout_fills_disk() -> None:
    """A rollout over an existing file on a file system that fills up (a 2 MB tmpfs, or, where
    mounting one is not allowed, a disk whose free space ``argv[3]`` bytes is injected):
    every rank must raise a DataError naming the full disk, not crash inside HDF5."""
    import shutil

    from mpidp.io import RolloutWriter

    path = sys.argv[2]
    if len(sys.argv) > 3:  # no tmpfs here: the disk "has" this much room left
        real = shutil.disk_usage
        room = int(sys.argv[3])
        shutil.disk_usage = lambda p: real(p)._replace(free=room - os.path.getsize(tmp_file()))

        def tmp_file() -> str:
            import glob

            found = glob.glob(os.path.join(os.path.dirname(path), ".*.tmp-*"))
            return found[0] if found else path

    manager = mpidp.init(domain_parallel_size=2)
    rows = manager.spec(64).sizes[manager.domain_rank]

    def rollout() -> None:
        with RolloutWriter(path, ["a", "b"], manager=manager) as out:
            for _ in range(1000):
                out.write(torch.full((2, rows, 128), ME + 1.0))  # not copies of one field

    caught(rollout)


def bad_inputs() -> None:
    """Issue 33's faults that every rank can be told about, in one job over the folder
    ``argv[2]`` (and ``argv[3]``, a small file system: a 256 kB tmpfs, or with ``argv[4]``
    given, an ordinary folder where torch.save is made to fail with ENOSPC). Each case raises
    an mpidp error on every rank; the job then lists the files it left."""
    import errno
    from pathlib import Path

    from mpidp.io import (
        RolloutWriter,
        ShardedH5Dataset,
        load_checkpoint,
        make_sample_data,
        save_checkpoint,
        write_sharded,
    )

    folder, small = Path(sys.argv[2]), Path(sys.argv[3])
    manager = mpidp.init(domain_parallel_size=2)
    spec = manager.spec(13)
    rows = spec.sizes[manager.domain_rank]
    # 1. a band one row taller on rank 1 only, written against the 13-row spec and grid
    band = torch.zeros(1, rows + ME, 8)
    caught(lambda: write_sharded(folder / "field.nc", "t", band, spec=spec, manager=manager))

    def rollout() -> None:
        lat = torch.linspace(90, -90, 13)
        with RolloutWriter(folder / "forecast.nc", ["t"], lat, manager=manager) as out:
            out.write(band)

    caught(rollout)
    # 2. a file of 15 rows where the model expects 13, on every rank
    if ME == 0:
        make_sample_data(folder / "wide.nc", n_lat=15, n_lon=8, n_time=3)
        make_sample_data(folder / "broken.nc", n_lat=13, n_lon=8, n_time=3)
        with open(folder / "broken.nc", "r+b") as f:  # 3. garble the superblock
            f.seek(8)
            f.write(bytes(b ^ 0x5A for b in f.read(88)))
    MPI.COMM_WORLD.Barrier()
    caught(lambda: ShardedH5Dataset(folder / "wide.nc", grid=(13, 8), manager=manager))
    caught(lambda: ShardedH5Dataset(folder / "broken.nc", manager=manager))
    good = torch.zeros(1, rows, 8)
    caught(lambda: write_sharded(folder / "broken.nc", "u", good, manager=manager, mode="a"))
    # 4. verify passed on rank 0 only, to save and to load
    model = torch.nn.Linear(3, 2)
    mpidp.broadcast_parameters(model, manager)
    ckpt = folder / "model.pt"
    save_checkpoint(ckpt, model, step=1, manager=manager)
    caught(lambda: save_checkpoint(ckpt, model, step=2, manager=manager, verify=ME == 0))
    caught(lambda: load_checkpoint(ckpt, model, manager=manager, verify=ME == 0))
    # 5. a save on a full disk: the previous checkpoint stays
    full = small / "model.pt"
    save_checkpoint(full, model, step=1, manager=manager)
    big = torch.nn.Linear(256, 256)  # 257 kB of parameters: more than the disk has left
    mpidp.broadcast_parameters(big, manager)
    if len(sys.argv) > 4 and ME == 0:  # no tmpfs here: the write fails as on a full disk
        import mpidp.io.checkpoint as checkpoint

        def full_disk(state, f) -> None:
            Path(f).write_bytes(b"part of a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        checkpoint.torch.save = full_disk  # type: ignore[assignment]
    caught(lambda: save_checkpoint(full, big, step=2, manager=manager))
    # 6. a parameter frozen on rank 1 only
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    if ME == 1:
        net[1].weight.requires_grad_(False)
    net(torch.ones(1, 3)).sum().backward()
    caught(lambda: mpidp.sync_gradients(net, manager))
    MPI.COMM_WORLD.Barrier()
    if ME == 0:
        left = sorted(p.name for p in folder.iterdir()) + sorted(p.name for p in small.iterdir())
        print(f"LEFT {left} step {torch.load(full, weights_only=False)['step']}", flush=True)


def band_height_on_one_rank() -> None:
    """ShardedTensor.from_local(band, spec=...) with a band one row taller on rank 1 only: the
    ranks agree on the bands (as on blocks), so both raise the same ConfigError, uncaught, and
    ``python -m mpi4py`` aborts the job through MPI with it (were the check local, rank 0
    would wait in its next collective and sleep 60 s: the test's time bound)."""
    manager = mpidp.init(domain_parallel_size=2)
    spec = manager.spec(13)
    band = torch.zeros(1, spec.sizes[ME] + ME, 8)
    print(f"rank {ME} starts at {time.time():.2f}", flush=True)
    x = mpidp.ShardedTensor.from_local(band, spec=spec, manager=manager)
    x.full_tensor()
    time.sleep(60)


class _KillWhilePickled:
    """Pickled inside torch.save, after the temporary file was opened: the writer is killed
    by ``signal`` mid-write."""

    def __init__(self, signal: int) -> None:
        self.signal = signal

    def __reduce__(self):  # type: ignore[no-untyped-def]
        print(f"rank {ME} killed mid-write at {time.time():.2f}", flush=True)
        os.kill(os.getpid(), self.signal)
        time.sleep(30)
        return (int, (0,))


def killed_mid_checkpoint() -> None:
    """``argv[2]``: the checkpoint path; ``argv[3]``: TERM or KILL. The run first saves a
    checkpoint (step N: the run number ``argv[4]``) over whatever an earlier run left, which
    removes the temporaries of dead writers; then saves again with rank 0 killed by that
    signal in the middle of torch.save."""
    import signal
    from pathlib import Path

    from mpidp.io import save_checkpoint

    path, sig, run = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    manager = mpidp.init(domain_parallel_size=2)
    model = torch.nn.Linear(3, 2)
    mpidp.broadcast_parameters(model, manager)
    before = sorted(p.name for p in path.parent.iterdir())
    save_checkpoint(path, model, step=run, manager=manager)
    after = sorted(p.name for p in path.parent.iterdir())
    if ME == 0:
        print(f"BEFORE {before} AFTER {after}", flush=True)
    bomb = _KillWhilePickled(getattr(signal, f"SIG{sig}")) if ME == 0 else None
    save_checkpoint(path, model, step=run + 100, manager=manager, extra={"bomb": bomb})


def killed_mid_write_sharded() -> None:
    """``argv[2]``: a path that holds a file; ``argv[3]``: the rank killed with SIGKILL in the
    middle of ``write_sharded`` over it (in its turn to write its rows, the temporary file
    open)."""
    import signal
    from pathlib import Path

    import mpidp.io.writer as writer
    from mpidp.io import write_sharded

    path, victim = Path(sys.argv[2]), int(sys.argv[3])
    manager = mpidp.init(domain_parallel_size=2)
    rows = manager.spec(8).sizes[manager.domain_rank]
    real = writer._rows_slab

    def killed(*args):  # type: ignore[no-untyped-def]
        if ME == victim:
            print(f"rank {ME} killed mid-write at {time.time():.2f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)

    writer._rows_slab = killed
    write_sharded(path, "a", torch.full((1, rows, 4), ME + 1.0), manager=manager)


def checkpoint_fills_disk() -> None:
    """``argv[2]``: a checkpoint path on a small file system (a 2 MB tmpfs) that holds an
    earlier checkpoint; the save of a model larger than the room left, uncaught: the job must
    end within seconds, the earlier checkpoint intact, no temporary file left. ``argv[3]``
    given: no tmpfs here, torch.save fails on rank 0 as on a full disk."""
    import errno
    from pathlib import Path

    from mpidp.io import save_checkpoint

    path = Path(sys.argv[2])
    manager = mpidp.init(domain_parallel_size=2)
    big = torch.nn.Linear(1024, 1024)  # 4 MB of parameters
    mpidp.broadcast_parameters(big, manager)
    if len(sys.argv) > 3 and ME == 0:
        import mpidp.io.checkpoint as checkpoint

        def full_disk(state, f) -> None:  # type: ignore[no-untyped-def]
            Path(f).write_bytes(b"part of a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        checkpoint.torch.save = full_disk  # type: ignore[assignment]
    print(f"rank {ME} saves at {time.time():.2f}", flush=True)
    save_checkpoint(path, big, step=2, manager=manager)
    time.sleep(60)


def scatter_sizes_on_one_rank() -> None:
    """mpidp.scatter_v (the differentiable one) whose sizes do not add up to the source's
    tensor: the source's check must reach every rank."""
    mpidp.init(domain_parallel_size=2)
    src = torch.zeros(5, 2) if ME == 0 else None
    caught(lambda: mpidp.scatter_v(src, [2, 2]))


def rollout_raises_on_one_rank() -> None:
    """An exception inside ``with RolloutWriter`` on rank 1 only, uncaught; rank 0 goes on to
    the next step."""
    from mpidp.io import RolloutWriter

    path = sys.argv[2]
    manager = mpidp.init(domain_parallel_size=2)
    rows = manager.spec(8).sizes[manager.domain_rank]
    with RolloutWriter(path, ["a"], manager=manager) as out:
        out.write(torch.full((1, rows, 4), ME + 1.0))  # bands that differ: not copies
        if ME == 1:
            print(f"rank 1 raises at {time.time():.2f}", flush=True)
            raise ValueError("the model diverged on rank 1 (injected)")
        out.write(torch.full((1, rows, 4), ME + 1.0))
    time.sleep(60)


def skipped_halo_backward_then_next() -> None:
    """Rank 1 skips the backward through the halo and goes on, as a training loop would, to
    ``argv[2]``: ``sync`` (sync_gradients: a collective), ``forward`` (the next step's
    halo exchange) or ``exchange`` (that exchange's messages alone, which must never meet the
    backward's); rank 0 waits in the backward's exchange. Run without
    MPIDP_TIMEOUT's short deadline: the ranks must tell within seconds that they are out of
    step."""
    manager = mpidp.init(domain_parallel_size=2)
    spec = manager.spec(8)
    x = torch.randn(1, 1, 4, 6, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(1))
    y = mpidp.halo_exchange(x * weight, 1, 1, spec=spec, manager=manager)
    print(f"rank {ME} enters at {time.time():.2f}", flush=True)
    if ME == 0:
        y.sum().backward()
    if sys.argv[2] == "sync":
        mpidp.sync_gradients(torch.nn.ParameterList([weight]), manager)
    elif sys.argv[2] == "forward":  # the next step's halo exchange (an agreement first)
        mpidp.halo_exchange(x, 1, 1, spec=spec, manager=manager)
    else:  # the next step's exchange itself, numbered as the halo numbers it
        t, rows = manager.transport("domain"), torch.zeros(1, 1, 1, 6)
        t.start_exchange([(1 - ME, rows)], [(1 - ME, rows.clone())], 2 * t.fetches + 2).wait()
    time.sleep(60)


def layer_raises_on_one_rank() -> None:
    """A converted model whose own module raises inside its forward on rank 1 only (torch's
    error on an input only that rank's band has), uncaught, while rank 0 goes on into the
    next layer's halo exchange: every rank's output must name rank 1 and its error, in
    seconds."""
    from torch import nn

    class Picky(nn.Module):
        def forward(self, x):
            if ME == 1:
                print(f"rank 1 raises at {time.time():.2f}", flush=True)
                raise RuntimeError("the layer's own check failed on this band (injected)")
            return x

    with mpidp.DistributedManager(domain_parallel_size=MPI.COMM_WORLD.Get_size()) as m:
        model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), Picky(), nn.Conv2d(2, 2, 3, padding=1))
        model = mpidp.convert_to_domain_parallel(model, m)
        model(torch.randn(1, 2, 4, 6))


if __name__ == "__main__":
    globals()[sys.argv[1].replace("-", "_")]()
