"""halo_plan.neighbours_only: when it says yes, every rank's plan is the two-neighbour exchange
(what halo_exchange without a spec sends before it knows the partition), sends included."""

from __future__ import annotations

import itertools

import pytest

from mpidp.errors import ConfigError
from mpidp.ops.halo_plan import Boundary, neighbour_messages, neighbours_only, plan

SIZES = [(4, 4), (1, 4), (0, 3), (2, 1, 5), (3, 3, 3), (1, 1, 1, 4), (5, 0, 5), (6, 2, 2, 6)]
KINDS = ["zeros", "replicate", "reflect", "symmetric", "none", "circular", "polar"]


def _sends(sizes, before, after, rank):
    """What the neighbours need of this rank when halos come from neighbours alone."""
    out = []
    if rank > 0 and after[rank - 1] > 0:
        out.append((rank - 1, 0, after[rank - 1]))
    if rank < len(sizes) - 1 and before[rank + 1] > 0:
        out.append((rank + 1, sizes[rank] - before[rank + 1], sizes[rank]))
    return tuple(out)


@pytest.mark.parametrize("kind", KINDS)
def test_yes_means_every_plan_is_the_neighbour_exchange(kind):
    b = Boundary.of(kind)
    yes = 0
    for sizes in SIZES:
        p = len(sizes)
        for w in itertools.product(range(3), repeat=2):
            before, after = (w[0],) * p, (w[1],) * p
            try:
                ok = neighbours_only(sizes, before, after, b)
            except ConfigError:
                continue
            if not ok:
                continue
            yes += 1
            for r in range(p):
                pl = plan(sizes, before, after, b, r)
                assert pl.recv == neighbour_messages(sizes, before, after, r), (sizes, w, r)
                assert tuple(sorted(pl.send)) == _sends(sizes, before, after, r), (sizes, w, r)
    if kind not in ("circular",):
        assert yes  # the common case takes the neighbour exchange


def test_thin_shards_and_wrapping_boundaries_say_no():
    assert not neighbours_only((1, 4), (2, 2), (2, 2), Boundary.of("zeros"))  # two hops
    assert not neighbours_only((4, 4), (1, 1), (1, 1), Boundary.of("circular"))
    assert neighbours_only((4, 4), (1, 1), (1, 1), Boundary.of("zeros"))
