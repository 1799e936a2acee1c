"""anemoi's arguments in mpidp's terms: its ``mgroup`` and its per-rank ``shapes``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.ops.collectives import resolve_transport


def transport(mgroup: Any, tensor: torch.Tensor) -> Transport | None:
    """The transport over ``mgroup`` for ``tensor``; None for ``mgroup`` None, anemoi's "not
    distributed" (the identity, forward and backward, reading no shapes). ``mgroup``: a torch
    ProcessGroup, or anything :func:`mpidp.ops.collectives.resolve_transport` accepts."""
    return None if mgroup is None else resolve_transport(mgroup, tensor.device)


def extents(shapes: Sequence[Any], dim: int, what: str, rank: int) -> list[int]:
    """Every rank's extent along ``dim``: anemoi's per-rank shapes (their ``dim`` entry, as
    anemoi's split takes it) or plain ints. The same on every rank that passes the same
    ``shapes``, so a refusal is raised on every rank."""
    if shapes is None:
        raise ConfigError(
            f"rank {rank}: {what}: shapes is None; pass every rank's shard shape (or size)"
        )
    out = []
    for s in shapes:
        if isinstance(s, int):
            out.append(s)
        elif isinstance(s, (tuple, list, torch.Size)) and -len(s) <= dim < len(s):
            out.append(int(s[dim]))
        else:
            raise ConfigError(
                f"rank {rank}: {what}: {s!r} is neither a size nor a shape with a dim {dim}; "
                "pass every rank's shard shape (or its size along dim)"
            )
    return out
