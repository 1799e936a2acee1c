"""all_gather_v's kept calls, sixth pass (issue 47): a manager's shutdown drops what was kept
over it (the table held it, its groups and communicators until 256 keys); on three and four
ranks the agreement travels in messages beside the rows (mpidp.comm.few_gather), and a rank
far from rank 0 that passes other facts still fails on every rank."""

from __future__ import annotations

import re

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.errors import CommError
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


@pytest.mark.mpi(min_size=2)
def test_the_last_rank_of_other_facts_fails_everywhere_and_the_kept_call_runs(manager):
    """After two kept calls, the last rank passes another dtype of the same width (its rows'
    length agrees: only the headers tell) and then a longer row (its rows message is truncated
    at every peer): every rank raises naming the other arguments, and the kept call then gives
    the whole field, uneven sizes with a rank of no rows."""
    p, me = manager.domain_world_size, manager.domain_rank
    sizes = [(2, 0, 3, 1)[r % 4] for r in range(p)]
    full = torch.randn(sum(sizes), 4, generator=torch.Generator().manual_seed(5))
    x = full[sum(sizes[:me]) :][: sizes[me]].clone()
    for _ in range(2):
        mpidp.all_gather_v(x, sizes, 0, manager)
    last = me == p - 1
    wide = torch.zeros(sizes[me], 5)
    cases = [(x.view(torch.int32) if last else x, "int32"), (wide if last else x, r"\(5,\)")]
    problems = []
    for part, match in cases:
        try:
            mpidp.all_gather_v(part, sizes, 0, manager)
            problems.append(f"{match}: no error")
        except CommError as err:
            if not re.search(f"different arguments.*{match}", str(err), re.S):
                problems.append(f"{match}: {err}")
        if not torch.equal(mpidp.all_gather_v(x, sizes, 0, manager), full):
            problems.append(f"{match}: the kept call differs after")
    everyone = manager.transport().all_gather_object(problems)
    assert not any(everyone), everyone
