"""Where in a user's model an op on a ShardedTensor runs: the module path a refusal names.

Once the first ShardedTensor exists, two global module hooks keep the stack of modules that
were called with a ShardedTensor argument (a check of the positional arguments per module
call, nothing else). A refusal then names the innermost one by its path from the outermost
(``decoder.up2 (Conv2d)``), or the model's own ``forward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from mpidp.sharded.tensor import ShardedTensor

__all__ = ["entered", "locate", "location", "module_path", "relocated", "running", "track"]

_STACK: list[nn.Module] = []
_FUNCTIONS: list[str] = []  # the user's autograd.Function running now: "Name.forward"
_ON: list[Any] = []


def _sharded_args(args: Any) -> bool:
    return any(isinstance(a, ShardedTensor) for a in args)


def _push(module: nn.Module, args: Any) -> None:
    if _sharded_args(args):
        _STACK.append(module)


def _pop(module: nn.Module, args: Any, out: Any) -> None:
    if module in _STACK:  # runs on the way out of an exception too (always_call)
        while _STACK and _STACK.pop() is not module:
            pass


def track() -> None:
    """Install the hooks (once per process)."""
    if not _ON:
        _ON.append(nn.modules.module.register_module_forward_pre_hook(_push))
        _ON.append(nn.modules.module.register_module_forward_hook(_pop, always_call=True))


def module_path() -> str:
    """The running module's path from the outermost (``decoder.up2 (Conv2d)``), ``""`` for
    the outermost module's own forward or outside any module."""
    if not _STACK:
        return ""
    root, inner = _STACK[0], _STACK[-1]
    if inner is root:
        return ""
    path = next((p for p, mod in root.named_modules() if mod is inner), None)
    return f"{path or '?'} ({type(inner).__name__})"


def location() -> str:
    """``in module decoder.up2 (Conv2d) of UNet``, ``in UNet.forward``, or ``""`` outside
    any module."""
    where = f"in autograd.Function {_FUNCTIONS[-1]}" if _FUNCTIONS else ""
    if not _STACK:
        return where
    path, root = module_path(), type(_STACK[0]).__name__
    module = f"in module {path} of {root}" if path else f"in {root}.forward"
    return f"{where}, {module}" if where else module


@contextlib.contextmanager
def entered(module: nn.Module) -> Iterator[None]:
    """``module`` is the root while its forward runs (a converted model, called with plain
    bands, is not seen by the hooks; called with ShardedTensors, the hooks pushed it already)."""
    depth = len(_STACK)
    if not (_STACK and _STACK[-1] is module):
        _STACK.append(module)
    try:
        yield
    finally:
        del _STACK[depth:]


def relocated(err: Exception) -> Exception | None:
    """``err`` again, its message naming where it happened (:func:`locate`); None when it
    already does or is raised outside any module."""
    message = locate(str(err))
    if getattr(err, "located", False) or message == str(err):
        return None
    out = type(err)(message)
    out.located = True  # type: ignore[attr-defined]
    return out


def locate(message: str) -> str:
    """``rank r: <where>: rest`` from ``rank r: rest`` (unchanged outside modules)."""
    where = location()
    head, sep, rest = message.partition(": ")
    if not where or not sep or not head.startswith("rank "):
        return message
    return f"{head}: {where}: {rest}"


@contextlib.contextmanager
def running(function: str) -> Iterator[None]:
    """A user's autograd.Function (``"Name.forward"``) runs on ShardedTensors."""
    _FUNCTIONS.append(function)
    try:
        yield
    finally:
        _FUNCTIONS.pop()
