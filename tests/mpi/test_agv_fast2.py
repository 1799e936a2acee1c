"""all_gather_v's kept calls, sixth pass (issue 47): a manager's shutdown drops what was kept
over it (the table held it, its groups and communicators until 256 keys)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.ops import collectives_kept

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()


def test_a_closed_manager_leaves_no_kept_call(manager):
    """Two calls of a key over a second manager and two over its transport are kept; once it
    shuts down no kept call refers to it or its transports, and the first manager's stay."""
    x = torch.ones(2, 3)
    mpidp.all_gather_v(x, [2] * WORLD, 0, manager)
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as m:
        t = m.transport()
        for group in (m, m, t, t):
            mpidp.all_gather_v(x, [2] * WORLD, 0, group)
        ours = [k for k, v in collectives_kept._KEPT.items() if v.manager is m or v.t is t]
    left = [k for k, v in collectives_kept._KEPT.items() if v.manager is m or v.t is t]
    kept_first = any(v.manager is manager for v in collectives_kept._KEPT.values())
    problems = []
    if len(ours) != 2:
        problems.append(f"kept before the shutdown: {len(ours)} calls, want 2")
    if left:
        problems.append(f"kept after the shutdown: {left}")
    if not kept_first:
        problems.append("the first manager's kept call went too")
    everyone = manager.transport().all_gather_object(problems)
    assert not any(everyone), everyone
