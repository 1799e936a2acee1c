"""Kept rules: what the general dispatch path decided for one call signature, reused by the
next call of that signature.

The general path (:func:`mpidp.sharded.dispatch.dispatch`) walks a call's arguments for
partial values, picks the call's rule (the batch rule, a block's rule, the registry's handler)
and the rule checks the layouts before it computes: 120-200 Python calls where torch's own
call takes 10-30. A call's signature (:func:`signature`: the function; each tensor argument's
type, band shape, dtype, device, layout and manager; every other argument's type and value;
the grad mode) fixes what the rule decides, so it is kept per signature:

* a rule that computed its result as one torch call on the arguments' bands and plain tensors
  as they are, sent nothing and drew no random number, and returned that call's output as a
  ShardedTensor: the call, its other arguments as the rule passed them and the result's layout
  (:class:`Kept`). The next call of the signature makes that torch call on its own bands and
  wraps the output in the layout made once.
* any other rule that ran without refusing: the handler the path chose (:class:`Routed`), which
  the next call runs at once (its own checks, plans and messages as ever).

A call of another signature (another layout, shape, value or number of arguments) takes the
whole path and is planned anew; a refused call keeps nothing, so its next call is refused
again. Every rank of a call's group decides alike: the rule's messages are collective (a rank
that sent in its planned call keeps no :class:`Kept`, nor does any rank it sent to).

What a rule did is seen while it runs once (:func:`plan`): its torch calls through a
``TorchFunctionMode`` (:class:`_Seen`), its messages through a profile hook that watches for a
call into a transport (:mod:`mpidp.comm`). Under another profiler nothing is planned.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import mpidp.comm
from mpidp.errors import MpidpError
from mpidp.sharded.tensor import META_GETTERS, META_METHODS, ShardedTensor

__all__ = ["KEPT", "Kept", "Routed", "Table", "forget", "plan", "signature", "wrapped"]

#: the other arguments' types a signature takes by value (exact types: ``True`` is not ``1``)
_VALUES = {
    bool,
    int,
    str,
    type(None),
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
}
#: the tensor types taken by layout (their values are the call's)
_PLAIN = (torch.Tensor, nn.Parameter)


def signature(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """(The call's signature, its tensors: the bands and plain tensors in argument order), or
    None for a call that is not planned: a partial value, a Replicated one or another tensor
    subclass among its arguments, a spectrum of blocks, the ``"whole"`` gradient convention, an
    argument that is no value (an object, a function) or a container nested twice."""
    sig: list[Any] = [func, len(args), torch.is_grad_enabled()]
    leaves: list[torch.Tensor] = []
    for a in args:  # (the commonest arguments here, the rest in _add)
        t = type(a)
        if t in _VALUES:
            sig += (t, a)
        elif not _add(a, sig, leaves, 0):
            return None
    for k, a in kwargs.items():
        sig.append(k)
        if not _add(a, sig, leaves, 0):
            return None
    return tuple(sig), leaves


def _add(a: Any, sig: list[Any], leaves: list[torch.Tensor], depth: int) -> bool:
    """Add ``a`` to the signature ``sig`` (and its tensor to ``leaves``); False when it is no
    argument a signature takes."""
    t = type(a)
    if t is ShardedTensor:
        local = a._local
        if a._spectral or a._manager.gradients == "whole":
            return False
        # (a ShardSpec is its sizes, which hash without a Python call)
        sig += (t, local.shape, local.dtype, local.device, local.requires_grad, local.layout,
                a._spec.sizes, a._dim, a._manager, a._grid, a._blocks)  # fmt: skip
        leaves.append(local)
        return True
    if (t is tuple or t is list or t is torch.Size) and depth < 2:  # (the next commonest)
        types = tuple(map(type, a))
        if set(types) <= _VALUES:  # (the commonest: a size, a pad, a stride)
            sig += (t, tuple(a), types)
            return True
        sig += (t, len(a))
        for v in a:
            if type(v) in _VALUES:
                sig += (type(v), v)
            elif not _add(v, sig, leaves, depth + 1):
                return False
        return True
    if t is torch.Tensor or t is nn.Parameter:
        sig += (t, a.shape, a.dtype, a.device, a.requires_grad, a.layout)
        leaves.append(a)
        return True
    if t in _VALUES:
        sig += (t, a)
        return True
    if t is float:  # by its bits: -0.0 == 0.0, and the rule may pass it on
        sig += (t, a.hex())
        return True
    if t is slice:
        start, stop, step = a.start, a.stop, a.step
        if type(start) in _VALUES and type(stop) in _VALUES and type(step) in _VALUES:
            # (the commonest: what the loop below adds, without a call per value)
            sig += (t, type(start), start, type(stop), stop, type(step), step)
            return True
        sig.append(t)
        for v in (start, stop, step):  # (loops, not generators: per call)
            if not _add(v, sig, leaves, depth):
                return False
        return True
    return False


class Kept(NamedTuple):
    """A rule that is one torch call on the bands (see the module doc): ``func`` called with
    ``args`` / ``kwargs`` where the tensors of the signature go in at ``slots``, its output of
    band shape ``local_shape`` wrapped as a ShardedTensor of the recorded layout."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: (where, leaf): ``where`` an argument's index, a keyword's name, or (index, item) in a
    #: list or tuple argument; ``leaf`` the signature's tensor that goes there
    slots: tuple[tuple[Any, int], ...]
    local_shape: torch.Size
    shape: torch.Size
    #: the output's layout after its global shape, as :func:`wrapped` takes it: (spec, dim,
    #: manager, blocks, grid, spectral)
    layout: tuple[Any, ...]

    def __call__(self, leaves: list[torch.Tensor]) -> ShardedTensor:
        func, template, kwargs, slots, local_shape, shape, layout = self  # (one read, per call)
        args = list(template)
        for where, leaf in slots:  # the template with the signature's tensors in their slots
            if type(where) is int:
                args[where] = leaves[leaf]
            elif type(where) is str:
                kwargs = {**kwargs, where: leaves[leaf]}
            else:
                i, k = where
                items = list(args[i])
                items[k] = leaves[leaf]
                args[i] = type(args[i])(items)
        out = func(*args, **kwargs)
        if type(out) is not torch.Tensor or out.shape != local_shape:
            raise MpidpError(
                f"internal error: the kept rule of {func} gave "
                f"{tuple(getattr(out, 'shape', ()))}, not {tuple(local_shape)} as when it "
                f"was planned; report it with the call"
            )
        return wrapped(out, shape, *layout)


def wrapped(
    local: torch.Tensor,
    shape: torch.Size,
    spec: Any,
    dim: int,
    manager: Any,
    blocks: int = 1,
    grid: Any = None,
    spectral: bool = False,
) -> ShardedTensor:
    """The ShardedTensor of ``local`` in a layout a checked call made before (the global
    ``shape`` too): what ``ShardedTensor(...)`` gives, without deriving it again."""
    y = torch.Tensor._make_wrapper_subclass(
        ShardedTensor, shape, dtype=local.dtype, device=local.device, requires_grad=False
    )
    y._local, y._spec, y._dim, y._manager = local, spec, dim, manager
    y._shape, y._blocks, y._grid, y._spectral = shape, blocks, grid, spectral
    return y


class Routed(NamedTuple):
    """A rule that is more than one torch call on the bands: the handler the general path
    chose for the signature, run at once."""

    handler: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


#: the kept rules by signature; cleared when full, and when a handler is registered or the
#: fallback turned on or off (the path may choose otherwise)
KEPT: dict[Any, Kept | Routed] = {}
_LIMIT = 4096


def forget() -> None:
    """Drop every kept rule (the registry or the fallback changed)."""
    KEPT.clear()


class Table(dict):
    """A table the general path chooses by (the handlers, the batch rule's ``READS``, the
    fallback switch): any change to it, a test's monkeypatch too, drops every kept rule."""

    def __setitem__(self, k: Any, v: Any) -> None:
        KEPT.clear()
        super().__setitem__(k, v)

    def __delitem__(self, k: Any) -> None:
        KEPT.clear()
        super().__delitem__(k)

    def pop(self, *args: Any) -> Any:
        KEPT.clear()
        return super().pop(*args)

    def update(self, *args: Any, **kwargs: Any) -> None:
        KEPT.clear()
        super().update(*args, **kwargs)

    def clear(self) -> None:
        KEPT.clear()
        super().clear()


class _Seen(TorchFunctionMode):
    """The torch calls a rule makes itself (a nested dispatch's own are not seen): each call
    that reads more than the metadata a signature holds, with its arguments, its output, the
    grad mode it ran in and whether it drew a random number."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any, bool, bool]] = []

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in META_METHODS or _getter(func) in META_GETTERS or _getter(func) in _READ:
            return func(*args, **kwargs)
        before = _generators()
        out = func(*args, **kwargs)
        drew = _generators() != before
        self.calls.append((func, args, kwargs, out, torch.is_grad_enabled(), drew))
        return out


#: a tensor property a rule may read besides the metadata (:data:`META_GETTERS`), being in
#: the signature
_READ = {"requires_grad"}


def _getter(func: Any) -> str:
    if getattr(func, "__name__", "") == "__get__":
        return str(getattr(getattr(func, "__self__", None), "__name__", ""))
    return ""


def _generators() -> list[Any]:
    """The states of the generators a call can draw from."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return [s.tolist() for s in states]


_COMM = os.path.dirname(os.path.abspath(mpidp.comm.__file__)) + os.sep


def plan(
    sig: Any,
    leaves: list[torch.Tensor],
    run: Callable[[list[Any]], Any],
) -> Any:
    """``run(route)`` (the general path, which puts the handler it chooses in ``route``) for
    the signature ``sig``, watched: its rule kept as :class:`Kept` or :class:`Routed` when it
    returns (see the module doc). Nothing is kept under another profiler (its hook is the
    process's one), nor when the call's tensors repeat (a slot would not say which)."""
    route: list[Any] = [None]
    if sys.getprofile() is not None or len({id(t) for t in leaves}) != len(leaves):
        return run(route)
    talked: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_COMM):
            talked.append(frame.f_code.co_name)

    seen = _Seen()
    grad = torch.is_grad_enabled()
    sys.setprofile(watch)
    try:
        with seen:
            out = run(route)
    finally:
        sys.setprofile(None)
    kept: Kept | Routed | None
    kept = None if talked or grad != torch.is_grad_enabled() else _kept(seen, out, leaves, grad)
    if kept is None and route[0] is not None:
        kept = Routed(route[0])
    if kept is not None:
        if len(KEPT) >= _LIMIT:
            KEPT.clear()
        KEPT[sig] = kept
    return out


def _kept(seen: _Seen, out: Any, leaves: list[torch.Tensor], grad: bool) -> Kept | None:
    """The :class:`Kept` of a rule that made one torch call (in the dispatch's grad mode, no
    random draw) on the signature's tensors and returned its output as a ShardedTensor."""
    if len(seen.calls) != 1 or type(out) is not ShardedTensor:
        return None
    func, args, kwargs, y, mode, drew = seen.calls[0]
    if drew or mode != grad or type(y) is not torch.Tensor or out._local is not y:
        return None
    if _getter(func):  # a read of the band's state (``.grad``), not a function of the call
        return None
    if any(y is t for t in leaves):  # in place: the result is an argument
        return None
    at = {id(t): i for i, t in enumerate(leaves)}
    slots: list[tuple[Any, int]] = []
    # the template keeps no tensor (the planned call's would live on): None in each slot
    targs, tkwargs = list(args), dict(kwargs)
    for where, a in (*enumerate(args), *kwargs.items()):
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN or id(a) not in at:
                return None
            slots.append((where, at[id(a)]))
            if type(where) is int:
                targs[where] = None
            else:
                tkwargs[str(where)] = None
        elif type(a) in (list, tuple) and type(where) is int and _holds_tensor(a):
            items = list(a)
            for k, v in enumerate(a):
                if not isinstance(v, torch.Tensor):
                    if _holds_tensor(v):
                        return None
                    continue
                if type(v) not in _PLAIN or id(v) not in at:
                    return None
                slots.append(((where, k), at[id(v)]))
                items[k] = None
            targs[where] = type(a)(items)
        elif _holds_tensor(a):
            return None
    layout = (out._spec, out._dim, out._manager, out._blocks, out._grid, out._spectral)
    return Kept(func, tuple(targs), tkwargs, tuple(slots), y.shape, out._shape, layout)


def _holds_tensor(a: Any) -> bool:
    """Whether ``a`` is a tensor or a container holding one."""
    if isinstance(a, torch.Tensor):
        return True
    if isinstance(a, dict):
        a = list(a.values())
    return isinstance(a, (list, tuple)) and any(_holds_tensor(v) for v in a)
