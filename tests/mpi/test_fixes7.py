"""Holes found in the sixth session, each refused on every rank or made exact (H7): a bad
block on one rank raises on every rank; the writers refuse a plain tensor that is not this
rank's band or block (every rank passing the whole field) and take a ShardedTensor;
``manager_for(blocks, gradients="whole")`` keeps the blocks.

Shapes are tiny (13 x 20, uneven over every grid); one folder per module.
"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import sys
import tempfile
import types
import weakref
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import WORLD, agreed, close, rand
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel

import mpidp
from mpidp.errors import ConfigError, DataError
from mpidp.io import RolloutWriter, write_sharded
from mpidp.runtime.adopt import manager_for
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import ShardedTensor, shard

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
ME = COMM.Get_rank()
H, W = 13, 20


@pytest.fixture(scope="module")
def shared():
    """A folder every rank sees (made by rank 0), removed at the end of the module."""
    path = COMM.bcast(tempfile.mkdtemp(prefix="mpidp-fixes7-") if ME == 0 else None)
    yield Path(path)
    COMM.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


def _refusals(call, kind=ConfigError):
    """Every rank's message of the ``kind`` error ``call`` raised (None: it did not)."""
    try:
        call()
        mine = None
    except kind as err:
        mine = str(err)
    return COMM.allgather(mine)


def test_a_bad_block_on_one_rank_raises_on_every_rank(gm):
    """A block of another shape than the spec gives on the last rank only; then (2 x 2 and
    more) columns whose learned rows differ: the same ConfigError on every rank, no hang."""
    if gm.grid[1] == 1:
        pytest.skip("bands: no block")
    bs = gm.block_spec((H, W))
    rows, cols = bs.block_shape(gm.domain_rank)
    last = gm.domain_rank == gm.domain_world_size - 1
    local = rand((2, rows + last, cols), seed=1)
    said = _refusals(lambda: ShardedTensor.from_local(local, dim=(-2, -1), spec=bs, manager=gm))
    failures = [] if all(s and "gives domain rank" in s for s in said) else [f"spec: {said}"]
    if min(gm.grid) > 1:  # each column learns its own rows: they differ between columns
        lat = list(ShardSpec.balanced(H, gm.grid[0]).sizes)
        i_lat, i_lon = gm.grid_coords
        mine = (lat if i_lon == 0 else lat[::-1])[i_lat]
        local = rand((2, mine, cols), seed=2)
        said = _refusals(lambda: ShardedTensor.from_local(local, dim=(-2, -1), manager=gm))
        failures += [] if all(s and "blocks=" in s for s in said) else [f"learned: {said}"]
    assert not agreed(failures), failures


@pytest.fixture(scope="module")
def field():
    """The whole field (2 channels, H x W), the same on every rank."""
    return rand((2, H, W), seed=3)


def _read(path, names):
    """The variables ``names`` of the HDF5 file ``path`` (rank 0 reads, every rank gets them)."""
    if ME == 0:
        with h5py.File(path, "r") as f:
            out = [np.asarray(f[n]) for n in names]
    return COMM.bcast(out if ME == 0 else None)


def test_writers_refuse_the_whole_field_on_every_rank_as_plain_tensors(gm, shared, field):
    """Every rank passes the whole field (plain, no coordinates): RolloutWriter and
    write_sharded would write P copies of it; refused on every rank, nothing written. On a
    grid of blocks, whole rows (each rank its latitude band of every longitude) are refused
    too. With the coordinates the writer knows the grid (the earlier check names it)."""
    if gm.domain_world_size == 1:
        pytest.skip("one rank: its part is the whole field")
    path = shared / f"whole-{gm.grid[0]}x{gm.grid[1]}.nc"
    x = field.numpy()

    def rollout(step, **kw):
        with RolloutWriter(path, ["a", "b"], manager=gm, **kw) as out:
            out.write(step)

    said = _refusals(lambda: rollout(x), DataError)
    said += _refusals(lambda: write_sharded(path, "a", x, manager=gm), DataError)
    failures = [s for s in said if not (s and "the whole field rather than" in s)]
    if gm.grid[1] > 1:  # this rank's rows of every longitude, on blocks
        rows = gm.block_spec((H, W)).block(gm.domain_rank)[0]
        said = _refusals(lambda: rollout(x[:, rows]), DataError)
        failures += [s for s in said if not (s and "longitude row" in s)]
    lat, lon = np.linspace(-90, 90, H), np.linspace(0, 342, W)
    said = _refusals(lambda: rollout(x, latitudes=lat, longitudes=lon), DataError)
    failures += [s for s in said if not (s and "coordinates give" in s)]
    failures += [f"{path} written"] if path.exists() else []
    assert not agreed(failures), failures


def test_writers_take_a_sharded_tensor(gm, shared, field):
    """A ShardedTensor (band or block, uneven) written by write_sharded and RolloutWriter
    without coordinates reads back as the whole field; a plain block still writes; a value
    every rank holds (Replicated) is refused on every rank."""
    x = shard(field, dim=(-2, -1), manager=gm)
    tag = f"{gm.grid[0]}x{gm.grid[1]}"
    one, steps = shared / f"one-{tag}.nc", shared / f"steps-{tag}.nc"
    write_sharded(one, "a", x, dims=("channel", "latitude", "longitude"))
    with RolloutWriter(steps, ["a", "b"], manager=gm, dtype=np.float64) as out:
        out.write(x, time=1)
        out.write(x.to_local(), time=2)
    got, (a, b) = _read(one, ["a"])[0], _read(steps, ["a", "b"])
    want = field.numpy()
    failures = [] if np.array_equal(got, want) else ["write_sharded"]
    said = _refusals(lambda: write_sharded(one, "b", x.full_tensor(), manager=gm), DataError)
    failures += [s for s in said if not (s and "Replicated" in s)]
    if not (np.array_equal(a, want[0][None].repeat(2, 0)) and np.array_equal(b[1], want[1])):
        failures.append("RolloutWriter")
    assert not agreed(failures), failures


def test_manager_for_a_manager_of_blocks_under_the_whole_convention_keeps_its_blocks(gm, field):
    """``manager_for(m, gradients="whole")`` (PhysicsNeMo's convention on mpidp's manager)
    has ``m``'s grid: a convolution on its blocks equals serial torch, forward, input gradient
    and the kernel's and bias's gradients, whole on every rank without a sync."""
    w = manager_for(gm, gradients="whole")
    conv = torch.nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64)
    serial = copy.deepcopy(conv)
    x = field[None].clone().requires_grad_()
    xs = x.detach().clone().requires_grad_()
    y = conv(shard(x, dim=(-2, -1), manager=w))
    (y * y).sum().backward()
    ys = serial(xs)
    (ys * ys).sum().backward()
    failures = [] if w.grid == gm.grid else [f"grid {w.grid}, the manager's {gm.grid}"]
    failures += [] if y.grid is not None or gm.grid[1] == 1 else ["a band, not a block"]
    dx = torch.from_numpy(COMM.allreduce(x.grad.numpy()))  # each rank: its block's entries
    pairs = [("y", y.full_tensor(), ys), ("dx", dx, xs.grad)]
    pairs += [
        (n, p.grad, q.grad)
        for (n, p), q in zip(conv.named_parameters(), serial.parameters(), strict=True)
    ]
    failures += [n for n, a, b in pairs if not close(a, b)]
    assert not agreed(failures), failures


def test_the_zoo_harness_tells_a_refusal_from_a_crash():
    """bench/zoo/harness.py labels a ConfigError (as an UnsupportedOp) "refused", with its
    type and message, and any other error "crash". Local: a stand-in manager and cases."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "zoo"))
    import harness

    def refuses():
        raise ConfigError("rank 0: no grid of 5 ranks fits 2 x 2; fix: run 4 ranks")

    def crashes():
        raise RuntimeError("a bug")

    sys.modules["cases_fixes7"] = types.SimpleNamespace(CASES={"a": refuses, "b": crashes})
    m = types.SimpleNamespace(domain_world_size=1, domain_rank=0, grid=(1, 1))
    a, b = (harness.run_case(c, m, "fixes7") for c in ("a", "b"))
    del sys.modules["cases_fixes7"]
    assert (a["status"], a.get("refusal"), b["status"]) == ("refused", "ConfigError", "crash")
    assert a["message_first_line"].endswith("fix: run 4 ranks"), a


def test_shutdown_collects_cyclic_garbage_only_when_a_group_was_taken(monkeypatch):
    """A manager whose groups nothing took shuts down without a full collection (0.9 s on a
    large heap); one whose data-parallel group a DDP model left in a reference cycle holds
    collects it (its gloo threads and sockets go with it)."""
    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or collect(*a))
    with mpidp.DistributedManager(domain_parallel_size=WORLD):
        pass
    plain = len(calls)
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as m:
        net = DistributedDataParallel(torch.nn.Linear(3, 3), process_group=m.data_parallel_group)
        net.cycle = [net]
        freed = weakref.ref(net)
        del net
    assert (plain, len(calls), freed() is None) == (0, 1, True)
