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
transport are kept. A manager's shutdown drops the calls kept over it, and those kept over
its transports once one over it was kept (the table would otherwise hold the manager, its
groups and communicators until it starts over); a transport passed alone stays the caller's.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mpidp.comm import Transport
from mpidp.ops.functions import _call, debug_enabled
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import ShardSpec
from mpidp.runtime.transports import hands_out_bare

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

#: the managers whose shutdown drops their kept calls (:func:`_forget`: hooked once each)
_HOOKED: weakref.WeakSet[DistributedManager] = weakref.WeakSet()

#: the types of group seen to be a manager or a transport: a set lookup, not an isinstance call
_KINDS: set[type] = set()

# os.environ's own table and the debug switch's key in it: whether MPIDP_DEBUG is set at all
# is one dict lookup (os.environ.get raises and catches a KeyError when it is not: 1-4 us);
# when it is, debug_enabled reads its value
_ENV: Any = getattr(os.environ, "_data", None)
_DEBUG_KEY: Any = os.environ.encodekey("MPIDP_DEBUG") if _ENV is not None else None


def kept_call(
    fn: type[torch.autograd.Function],
    tensor: torch.Tensor,
    sizes: Any,
    dim: int,
    group: Any,
    debug: bool | None,
) -> tuple[tuple[Any, ...] | None, torch.Tensor | None]:
    """The call's key (None: not to be kept: another kind of group, or the debug check on) and,
    when a kept call of that key serves, its result on ``tensor`` (else None)."""
    if debug or (debug is None and (_ENV is None or _DEBUG_KEY in _ENV) and debug_enabled()):
        return None, None
    if group is not None and type(group) not in _KINDS:
        if not isinstance(group, (DistributedManager, Transport)):
            return None, None
        _KINDS.add(type(group))
    if type(sizes) is list or type(sizes) is tuple:
        sz = tuple(sizes)
    else:
        sz = sizes.sizes if isinstance(sizes, ShardSpec) else tuple(sizes)
    grad = tensor.requires_grad
    key = (
        fn,
        group,
        tensor.shape,
        tensor.dtype,
        tensor.device,
        tensor.is_contiguous(),
        grad,
        sz,
        dim,
    )
    try:
        kept = _KEPT[key]
    except KeyError:
        return key, None
    except TypeError:  # sizes of something unhashable: the full path says what is wrong
        return None, None
    m = kept.manager
    if m is not None:
        if (get_manager() if group is None else group) is not m:
            return key, None
        if not hands_out_bare(m):  # shut down, or wrapped
            return key, None
    if kept.run is None or (grad and torch.is_grad_enabled()):
        return key, _call(fn, tensor, kept.t, kept.sizes, kept.dim)
    return key, kept.run(tensor)


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
    if m is not None and m not in _HOOKED:
        _HOOKED.add(m)
        mid = id(m)  # not the manager: its hook must not hold it
        m._on_shutdown.append(lambda: _forget(mid))
    if len(_KEPT) >= LIMIT:
        _KEPT.clear()
    run = t.kept_all_gather_v(tensor, sizes, dim) if t.size > 1 else None
    _KEPT[key] = Kept(m, t, sizes, dim, run)


def _forget(mid: int) -> None:
    """Drop every call kept over the manager of id ``mid`` or one of its transports (run by its
    shutdown, before it lets its transports go)."""
    m = next((h for h in _HOOKED if id(h) == mid), None)
    ts = {id(t) for t in m._transports.values()} if m is not None else set()
    for key in [k for k, v in _KEPT.items() if id(v.manager) == mid or id(v.t) in ts]:
        del _KEPT[key]
