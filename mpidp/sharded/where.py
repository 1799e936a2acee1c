"""Where in a user's model an op on a ShardedTensor runs: the module path a refusal names.

The modules running now are read off the Python stack when a refusal is raised (the frames
of torch's ``Module._call_impl``, each with its module and its arguments): the stack of those
called with a ShardedTensor among their positional arguments, and of those :func:`enter`
puts there (a converted model called with plain bands). A refusal then names the innermost one by
its path from the outermost (``decoder.up2 (Conv2d)``), or the model's own ``forward``.
Nothing runs per module call: no global hook slows the modules of the process (plain ones
included) to answer a question asked only when a call is refused.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator

from torch import nn

from mpidp.sharded.tensor import ShardedTensor

__all__ = ["enter", "leave", "locate", "location", "module_path", "relocated", "running", "stack"]

_FUNCTIONS: list[str] = []  # the user's autograd.Function running now: "Name.forward"
#: the modules :func:`enter` put there now (converted models running their forward)
_ENTERED: list[nn.Module] = []
#: the code of torch's module call, whose frames hold the module (``self``) and ``args``
_CALL = nn.Module._call_impl.__code__


def stack() -> list[nn.Module]:
    """The modules running now that were called with a ShardedTensor positional argument or
    :func:`enter` put there, outermost first (read off the Python stack)."""
    found: list[nn.Module] = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL:
            local = frame.f_locals
            module, args = local["self"], local.get("args", ())
            if any(module is e for e in _ENTERED) or any(
                isinstance(a, ShardedTensor) for a in args
            ):
                found.append(module)
        frame = frame.f_back  # type: ignore[assignment]
    found.reverse()
    return found


def module_path() -> str:
    """The running module's path from the outermost (``decoder.up2 (Conv2d)``), ``""`` for
    the outermost module's own forward or outside any module."""
    return _path(stack())


def _path(modules: list[nn.Module]) -> str:
    if not modules:
        return ""
    root, inner = modules[0], modules[-1]
    if inner is root:
        return ""
    return f"{_named(root, inner) or '?'} ({type(inner).__name__})"


#: root -> {id(module): its path}: the dry run asks for the path at every op (thousands per
#: forward; walking ``named_modules`` each time took half of FengWu's dry run)
_PATHS: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()


def _named(root: nn.Module, inner: nn.Module) -> str | None:
    """``inner``'s path in ``root`` (None: not in it), from the root's map of paths; the map is
    made again when the path it gives no longer leads to ``inner`` (modules added, replaced or
    moved since)."""
    paths = _PATHS.get(root)
    path = None if paths is None else paths.get(id(inner))
    if path is not None and _at(root, path) is inner:
        return path
    paths = {}
    for name, mod in root.named_modules():
        paths.setdefault(id(mod), name)
    _PATHS[root] = paths
    return paths.get(id(inner))


def _at(root: nn.Module, path: str) -> nn.Module | None:
    mod: nn.Module | None = root
    for part in path.split("."):
        mod = getattr(mod, "_modules", {}).get(part)
        if mod is None:
            return None
    return mod


def location() -> str:
    """``in module decoder.up2 (Conv2d) of UNet``, ``in UNet.forward``, or ``""`` outside
    any module."""
    where = f"in autograd.Function {_FUNCTIONS[-1]}" if _FUNCTIONS else ""
    modules = stack()
    if not modules:
        return where
    path, root = _path(modules), type(modules[0]).__name__
    module = f"in module {path} of {root}" if path else f"in {root}.forward"
    return f"{where}, {module}" if where else module


def enter(module: nn.Module) -> int:
    """Put ``module`` on the stack while its forward runs, whatever its arguments (a converted
    model, called with plain bands; called with ShardedTensors it is there already); returns
    the depth to :func:`leave` with. Plain calls, not a context manager: every call of a
    converted model makes them."""
    _ENTERED.append(module)
    return len(_ENTERED) - 1


def leave(depth: int) -> None:
    """Take the module :func:`enter` put at ``depth`` (and any left above it) off the stack."""
    del _ENTERED[depth:]


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
