"""House-keeping of the eighth session (H5): ``ShardedTensor.from_local(spec=...)`` on bands
agrees across ranks as on blocks (bands are the grid (P, 1)): a spec that differs between
ranks, or a band that does not fit the spec on one rank, raise the same ConfigError on every
rank; a parallel mesh's ``close`` runs the cyclic collector only when one of its groups was
taken, as the manager's shutdown does.

Shapes are tiny (13 rows, uneven over 2, 3 and 4 ranks).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import WORLD, agreed, rand, refusal
from mpi4py import MPI

from mpidp.parallel import build_device_mesh
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import ShardedTensor

pytestmark = pytest.mark.mpi

H, W = 13, 5


def _said(call):
    """Every rank's ConfigError message from ``call`` (None where it raised none)."""
    return MPI.COMM_WORLD.allgather(refusal(call))


def test_a_band_spec_is_agreed_on_every_rank(manager):
    """One spec everywhere: the band wraps and gathers to the field. The last rank one row
    taller than the spec gives it, or (P > 1) passing a spec of its own that its band fits
    (one row more there, so the ranks' specs differ): the same ConfigError on every rank,
    naming that rank and its values."""
    me, p = manager.domain_rank, manager.domain_world_size
    spec = ShardSpec.balanced(H, p)
    full = rand((2, H, W), seed=1)
    band = full[:, spec.slice(me)]
    x = ShardedTensor.from_local(band, spec=spec, manager=manager)
    failures = [] if torch.equal(x.full_tensor(), full) else ["the agreed band is not the field"]
    last = me == p - 1
    tall = rand((2, spec.sizes[me] + last, W), seed=2)
    said = _said(lambda: ShardedTensor.from_local(tall, spec=spec, manager=manager))
    want = f"the band has {spec.sizes[-1] + 1} rows but spec {list(spec.sizes)}"
    want = f"rank {p - 1}: {want}" if p > 1 else want  # one rank: its own check, no agreement
    if not all(
        s and s.startswith(f"rank {r}: from_local") and want in s for r, s in enumerate(said)
    ):
        failures.append(f"taller band: {said}")
    if p > 1:
        own = ShardSpec((*spec.sizes[:-1], spec.sizes[-1] + 1)) if last else spec
        said = _said(lambda: ShardedTensor.from_local(tall, spec=own, manager=manager))
        want = f"rank {p - 1}: bands={[*spec.sizes[:-1], spec.sizes[-1] + 1]} but rank 0 passed"
        if not all(s and "do not tile the" in s and want in s for s in said):
            failures.append(f"specs differ: {said}")
    assert agreed(failures) == []


class _Wrapped:
    """What a DDP/FSDP2 model is to a process group, cheaply: an object that holds it and sits
    in a reference cycle (cyclic garbage once dropped)."""

    def __init__(self, group):
        self.group, self.cycle = group, self


def test_a_mesh_closes_collecting_only_when_a_group_was_taken(manager, monkeypatch):
    """A parallel mesh nothing took closes without a full collection; one whose dp group a
    wrapped model left in a reference cycle holds collects it (the manager's rule)."""
    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or collect(*a))
    conf = {"data": "ddp", "tensor": 1, "domain": WORLD}
    build_device_mesh(conf, manager=manager).close()
    plain = len(calls)
    meshes = build_device_mesh(conf, manager=manager)
    gc.disable()  # the automatic collector could free the cycle first, leaving nothing to do
    try:
        freed = weakref.ref(_Wrapped(meshes["dp"].get_group()))
        meshes.close()
    finally:
        gc.enable()
    assert (plain, len(calls), freed() is None) == (0, 1, True)
