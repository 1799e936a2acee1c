"""Letting go of process groups: destroying a mesh's groups, and the one rule for when a
shutdown runs the cyclic garbage collector (the manager's and a parallel mesh's alike).

Models wrapped by DDP/FSDP2 sit in reference cycles that keep their process groups (two gloo
threads and open sockets each) alive until the cyclic collector runs; measured: with ~25 such
groups left, a small MPI all-reduce was 20-40x slower. A full collection walks the whole heap
(0.9 s on a large one), so it runs only when something took a reference to one of the groups
since they were counted (a wrapped model, live or garbage). Local: no communication.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["destroy_groups", "group_references", "release_groups"]


def group_references(groups: Iterable[Any]) -> list[int]:
    """How many references each distinct group of ``groups`` (None left out) has, torch's own
    registries included: count them when the groups are made, and hand the counts to
    :func:`release_groups`."""
    distinct = list({id(g): g for g in groups if g is not None}.values())
    return [sys.getrefcount(g) for g in distinct]


def release_groups(before: list[int], groups: Iterable[Any], destroy: Callable[[], None]) -> None:
    """Run ``destroy`` (which drops ``groups`` from torch's registries), then the cyclic
    collector, but only when a count of ``groups`` (the ones counted in ``before``, in the
    same order) grew since: something took one of them."""
    taken = any(now > then for now, then in zip(group_references(groups), before, strict=False))
    destroy()
    if taken:
        gc.collect()


def destroy_groups(mesh: DeviceMesh) -> None:
    """Destroy the process groups of every dimension of ``mesh`` (each group's threads and
    connections go with it; a job that builds many meshes would otherwise keep them all)."""
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if group is not dist.group.WORLD:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass  # destroyed already
