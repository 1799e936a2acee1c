"""Rebalancing the bands from measured costs, and switching the manager's partition.

:func:`rebalance` turns each domain rank's measured seconds per step under the current cut
into a partition *policy* whose predicted slowest rank is fastest: a rank's speed is its rows
over its seconds, and the new rows minimise the largest ``rows / speed`` at the model input's
length (whole rows, or whole blocks for an :class:`~mpidp.Aligned` policy). The policy keeps
the current one's constraints (aligned stays aligned, ``allow_empty`` stays as it was) and cuts
every other length of the network in proportion, as any :class:`~mpidp.Weighted` policy does.

:func:`set_partition` (``manager.set_partition``) installs a policy at a step boundary after
the domain group agreed on it. Everything cut by the manager's policy follows by itself: layers
ask the policy at each call, halo plans and graph plans are cached on the specs themselves, and
a converted model learns its input's cut from the bands it is given. Tensors that live across
steps (a rollout's state, a prefetched band) move with :func:`mpidp.repartition`, which sends
only the rows that change owner.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mpidp.errors import ConfigError
from mpidp.runtime.partition import Aligned, Balanced, PartitionPolicy, ShardSpec, Weighted

if TYPE_CHECKING:
    from mpidp.runtime.manager import DistributedManager

__all__ = ["fastest_counts", "follow_partition", "rebalance", "set_partition"]


def fastest_counts(
    units: int, speeds: Sequence[float], unit: int = 1, extra: Sequence[int] = (), least: int = 0
) -> tuple[int, ...]:
    """Whole ``units`` (of ``unit`` rows each) shared over ranks of ``speeds`` (rows per
    second) so that the largest predicted time ``(count * unit + extra[r]) / speeds[r]`` is
    smallest; each rank gets at least ``least`` units, ``extra`` rows are fixed (the rows an
    aligned cut leaves to the last rank). Ties go to the lower rank. Pure: every rank computes
    the same counts from the same speeds."""
    p = len(speeds)
    fixed = list(extra) or [0] * p
    if units < least * p:
        raise ConfigError(
            f"cannot give each of {p} ranks at least {least} of {units} units; "
            f"use fewer ranks or allow_empty=True"
        )
    counts = [least] * p
    heap = [(((counts[r] + 1) * unit + fixed[r]) / speeds[r], r) for r in range(p)]
    heapq.heapify(heap)
    for _ in range(units - least * p):  # water filling: the next unit to the rank done first
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (((counts[r] + 1) * unit + fixed[r]) / speeds[r], r))
    return tuple(counts)


def _costs(rank_seconds: Any, current: ShardSpec) -> tuple[list[float], list[str]]:
    """The seconds as floats and what is wrong with them (empty when nothing is)."""
    try:
        seconds = [float(s) for s in rank_seconds]
    except (TypeError, ValueError) as err:
        return [], [f"rank_seconds {rank_seconds!r} is not a sequence of numbers ({err})"]
    fix = "pass each domain rank's measured seconds per step, the same list on every rank"
    if len(seconds) != current.parts:
        return seconds, [
            f"rank_seconds has {len(seconds)} values {seconds} for {current.parts} domain "
            f"ranks; {fix}"
        ]
    bad = [
        f"rank {r}: {s!r} s for {n} rows"
        for r, (s, n) in enumerate(zip(seconds, current.sizes, strict=True))
        if not math.isfinite(s) or s < 0 or (s == 0 and n > 0)
    ]
    if bad:
        return seconds, [
            f"rank_seconds {seconds} holds costs that are negative, NaN, infinite or zero for "
            f"a band with rows ({'; '.join(bad)}); {fix} (positive and finite)"
        ]
    if current.total == 0:
        return seconds, [f"the current cut {current} has no rows to measure a speed from"]
    return seconds, []


def _speeds(seconds: Sequence[float], current: ShardSpec) -> list[float]:
    """Rows per second; a rank with no rows was not measured and is taken at the mean speed
    of the measured ones (so that a band rebalanced away can come back)."""
    measured = [n / s for n, s in zip(current.sizes, seconds, strict=True) if n > 0]
    mean = sum(measured) / len(measured)
    return [n / s if n > 0 else mean for n, s in zip(current.sizes, seconds, strict=True)]


def _policy_for(policy: PartitionPolicy, speeds: list[float], n: int) -> PartitionPolicy:
    """The policy of the current one's kind whose cut of ``n`` rows is fastest."""
    least = 0 if policy.allow_empty else 1
    if isinstance(policy, Aligned):
        blocks, rest = divmod(n, policy.multiple)
        extra = [0] * (len(speeds) - 1) + [rest]
        counts = fastest_counts(blocks, speeds, policy.multiple, extra, least)
        return Aligned(policy.multiple, policy.allow_empty, counts)
    if isinstance(policy, (Balanced, Weighted)):
        return Weighted(fastest_counts(n, speeds, 1, (), least), policy.allow_empty)
    raise ConfigError(
        f"rebalance knows Balanced, Weighted and Aligned policies; the manager's is {policy!r}: "
        f"set one of those (manager.set_partition) or derive weights for your policy from "
        f"mpidp.runtime.rebalance.fastest_counts"
    )


def rebalance(
    manager: DistributedManager, rank_seconds: Sequence[float], *, rows: int | ShardSpec
) -> PartitionPolicy:
    """The partition policy whose predicted slowest domain rank is fastest.

    Parameters
    ----------
    manager:
        Whose domain group and current policy (its constraints are kept: an ``Aligned(p)``
        policy gives an aligned one, ``allow_empty`` is kept).
    rank_seconds:
        Each domain rank's measured seconds per step under the current cut, one per rank, the
        same list on every rank (finite; positive for every rank that has rows).
    rows:
        The model input's length along the sharded dim (its current cut is
        ``manager.spec(rows)``), or that cut itself as a :class:`ShardSpec`.

    A rank's speed is its rows over its seconds (a rank without rows is taken at the mean
    speed of the others); the new cut of the input length minimises the largest
    ``rows / speed``, and the returned policy (:class:`Weighted` with those row counts as
    weights, or :class:`Aligned` with block counts) cuts every other length in proportion.
    Nothing is changed: pass the policy to ``manager.set_partition``.

    Collective over the domain group: the ranks agree on the costs, the cut and the policy
    (one small all-gather); a difference or bad costs raise the same :class:`ConfigError` on
    every rank.
    """
    p = manager.domain_world_size
    problems: list[str] = _blocks_refused(manager)
    try:
        current = rows if isinstance(rows, ShardSpec) else manager.spec(int(rows))
    except ConfigError as err:
        current, problems = ShardSpec.balanced(0, p, allow_empty=True), [str(err)]
    if not problems and current.parts != p:
        problems.append(f"rows={current} has {current.parts} parts for {p} domain ranks")
    seconds, bad = _costs(rank_seconds, current) if not problems else ([], [])
    problems += bad
    facts = {  # the same in every data-parallel replica too: the replicas share one cut
        "rank_seconds": repr(seconds or rank_seconds),
        "rows": repr(current),
        "policy": repr(manager.partition),
    }
    _agree(manager, "rebalance", problems, facts)
    return _policy_for(manager.partition, _speeds(seconds, current), current.total)


def set_partition(
    manager: DistributedManager, policy: PartitionPolicy, rows: int | None = None
) -> None:
    """Install ``policy`` as ``manager``'s partition (the logic of
    :meth:`DistributedManager.set_partition`). Collective over the domain group: every rank
    passes the same policy (compared by its repr) and, with ``rows``, the policy must cut that
    length over the group; otherwise the same :class:`ConfigError` on every rank and the old
    partition is kept."""
    problems: list[str] = []
    if not isinstance(policy, PartitionPolicy):
        problems.append(
            f"set_partition takes a PartitionPolicy (Balanced, Weighted, Aligned, ...), got "
            f"{policy!r}"
        )
    else:
        weights = getattr(policy, "weights", None)
        p = manager.domain_world_size
        if weights is not None and len(weights) != p:
            problems.append(f"{policy!r} has {len(weights)} weights for {p} domain ranks")
        elif rows is not None:
            try:
                policy.spec(rows, p)
            except ConfigError as err:
                problems.append(f"{policy!r} cannot cut the input's {rows} rows: {err}")
    moving = _followers(manager)
    problems += [why for cb in moving if (why := _refusal(cb))]
    facts = {"policy": repr(policy), "rows": repr(rows), "loops read ahead": len(moving)}
    _agree(manager, "set_partition", problems, facts)
    for follow in moving:  # in the order they were made, the same on every rank
        follow(manager.partition, policy)
    manager.partition = policy


#: per manager, weak references to the callbacks of what holds bands across set_partition
_FOLLOWERS: weakref.WeakKeyDictionary[Any, list[weakref.WeakMethod[Any]]] = (
    weakref.WeakKeyDictionary()
)


def follow_partition(manager: DistributedManager, callback: Any) -> None:
    """Call the bound method ``callback(old_policy, new_policy)`` inside every later
    ``manager.set_partition``, once the ranks agreed and before the new policy is installed
    (so that bands read under the old cut can be moved), when its object's ``following()`` is
    true (it holds bands now); the number of those is agreed with the policy. An object that
    holds bands it cannot move defines ``partition_refusal()``, which says why (or returns
    None): the switch is then refused on every rank. Held weakly. Each call is collective:
    register in the same order on every domain rank."""
    _FOLLOWERS.setdefault(manager, []).append(weakref.WeakMethod(callback))


def _followers(manager: DistributedManager) -> list[Any]:
    """The live callbacks whose objects hold bands now, in the order they were registered."""
    refs = [r for r in _FOLLOWERS.get(manager, []) if r() is not None]
    if refs:
        _FOLLOWERS[manager] = refs
    live = [r() for r in refs]
    return [cb for cb in live if cb is not None and cb.__self__.following()]


def _refusal(callback: Any) -> str | None:
    """Why the object of a live follower ``callback`` cannot follow now (None: it can)."""
    refusal = getattr(callback.__self__, "partition_refusal", None)
    return refusal() if refusal is not None else None


def _blocks_refused(manager: DistributedManager) -> list[str]:
    """Why rebalancing a grid of blocks is refused (empty for bands). Local: every rank's
    manager has the same grid."""
    p_lat, p_lon = manager.grid
    if p_lon == 1:
        return []
    return [
        f"the domain group is a ({p_lat}, {p_lon}) grid of blocks, and rebalance cuts bands: "
        f"the manager has one policy, which every layer asks for a length and a part count "
        f"without naming the axis, so a latitude cut and a longitude cut of their own cannot "
        f"be installed (at {p_lat} x {p_lon} they are not even told apart by their part "
        f"count); and a block's cost is its rows times its columns, so where the costs are "
        f"not a latitude factor times a longitude factor (one slow node) no pair of per-axis "
        f"cuts matches the measured speeds, and the per-axis sums would move work onto the "
        f"slow block's row and column peers. fix: rebalance bands "
        f"(domain_parallel_size={p_lat * p_lon}), or pass an explicit Weighted per axis "
        f"by hand to mpidp.runtime.grid.block_spec"
    ]


def _agree(manager: DistributedManager, what: str, problems: list[str], facts: Any) -> None:
    """The same ConfigError on every rank when any rank found a problem or passed other facts
    than rank 0: over the domain group, and over the whole world when there are several
    data-parallel replicas (they share one cut, so they must pass the same facts)."""
    lines = [f"rank {manager.domain_rank}: {msg}" for msg in problems]
    replicas = manager.dp_world_size > 1
    if replicas or manager.domain_world_size > 1:
        _, lines = manager.transport("world" if replicas else None).agree(problems, facts)
    if lines:
        hint = (
            "; the data-parallel replicas share one cut: reduce each domain rank's seconds over "
            "the replicas first (Profile.rank_seconds() takes the slowest replica's)"
            if replicas
            else ""
        )
        raise ConfigError(
            f"rank {manager.rank}: {what} refused, the partition stays {manager.partition!r}: "
            + "; ".join(lines)
            + hint
            + "; otherwise, fix: pass the same, valid arguments on every domain rank"
            + (" of every replica" if replicas else "")
        )
