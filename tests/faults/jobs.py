"""Fault-injection jobs: ``python -m mpi4py tests/faults/jobs.py CASE`` under mpiexec.

Each case makes the ranks disagree and prints, on every rank that raised, ``CAUGHT rank R
after S s: Type: message``; or makes one rank skip a call, which the deadline turns into an
abort of the job with a message. Run by tests/launch/test_faults.py, which
checks that every rank raised an mpidp error naming the values, within seconds.
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
        out.write(torch.ones(1, rows, 4))
        MPI.COMM_WORLD.Barrier()
        if ME == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"rank 0 writes step 2 at {time.time():.2f}", flush=True)
        out.write(torch.ones(1, rows, 4))


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
                out.write(torch.ones(2, rows, 128))

    caught(rollout)


if __name__ == "__main__":
    globals()[sys.argv[1].replace("-", "_")]()
