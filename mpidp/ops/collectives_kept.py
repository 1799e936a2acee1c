"""Repeated ``all_gather_v`` calls: what the first call of a key resolved and checked, kept.

A model gathers the same shapes step after step. The first call of a key (the Function, the
group, the tensor's shape, dtype, device, layout and gradient flag, the sizes and the dim)
resolves the group's transport, checks the arguments and runs; its transport, sizes and dim
are kept, and so is the transport's own plan of the call where it keeps one
(:meth:`~mpidp.comm.Transport.kept_all_gather_v`: on MPI, the counts, the result's layout and
the message that carries the rank agreement). A later call of the key is a dict lookup, the
transport's one exchange and, when a gradient flows, autograd's bookkeeping.

Nothing is skipped that could differ between calls of one key: the agreement of every rank's
arguments travels with each call's data (a peer that passed something else raises the same
:class:`~mpidp.CommError` on every rank); the debug check (``debug=True``, ``MPIDP_DEBUG``) is
read per call and takes the full path; a kept transport serves only while the manager that
made it hands out the same (not shut down, no ``count_traffic`` or ``profile`` block, whose
wrapped transports take the full path). Only calls over the default manager, a manager or a
transport are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mpidp.comm import Transport
from mpidp.ops.functions import _call
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import ShardSpec

__all__: list[str] = []

#: distinct keys kept at most: past it the table starts over (a model has a few dozen)
LIMIT = 256


class Kept(NamedTuple):
    """A key's resolved call: its transport (``manager``'s, or one passed: None), sizes, dim
    and the transport's own plan of the gather (None: call the transport)."""

    manager: DistributedManager | None
    t: Transport
    sizes: list[int]
    dim: int
    run: Callable[[torch.Tensor], torch.Tensor] | None


_KEPT: dict[tuple[Any, ...], Kept] = {}


def key_of(
    fn: type[torch.autograd.Function], tensor: torch.Tensor, sizes: Any, dim: int, group: Any
) -> tuple[Any, ...] | None:
    """The key of a call that may be kept, or None (another kind of group)."""
    if group is not None and not isinstance(group, (DistributedManager, Transport)):
        return None
    sz = sizes.sizes if isinstance(sizes, ShardSpec) else tuple(sizes)
    return (
        fn,
        group,
        tensor.shape,
        tensor.dtype,
        tensor.device,
        tensor.is_contiguous(),
        tensor.requires_grad,
        sz,
        dim,
    )


def run_kept(key: tuple[Any, ...], tensor: torch.Tensor, group: Any) -> torch.Tensor | None:
    """The result of the kept call ``key`` on ``tensor``, or None when none serves."""
    try:
        kept = _KEPT.get(key)
    except TypeError:  # sizes of something unhashable: the full path says what is wrong
        return None
    if kept is None:
        return None
    m = kept.manager
    if m is not None:
        if (get_manager() if group is None else group) is not m:
            return None
        if not m._transports or "transport" in m.__dict__:  # shut down, or wrapped
            return None
    fn = key[0]
    if kept.run is None or (key[6] and torch.is_grad_enabled()):
        return _call(fn, tensor, kept.t, kept.sizes, kept.dim)
    return kept.run(tensor)


def keep(
    key: tuple[Any, ...], tensor: torch.Tensor, group: Any, t: Transport, sizes: list[int], dim: int
) -> None:
    """Keep the call ``key`` that just ran over ``t`` (resolved from ``group``) and returned."""
    if not all(type(s) is int for s in key[7]):
        return
    m = None
    if not isinstance(group, Transport):
        m = get_manager() if group is None else group
        if "transport" in m.__dict__:  # a wrapped transport: not kept
            return
    if len(_KEPT) >= LIMIT:
        _KEPT.clear()
    run = t.kept_all_gather_v(tensor, sizes, dim) if t.size > 1 else None
    _KEPT[key] = Kept(m, t, sizes, dim, run)
