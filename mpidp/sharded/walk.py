"""The walk over a call's arguments that every dispatched call makes: the tensors inside the
containers torch functions take (tuples, named tuples, lists, dicts), found without pytree's
bookkeeping (its flatten and unflatten cost several microseconds a call). For the builtin
containers it visits what ``torch.utils._pytree.tree_flatten`` visits, in the same order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["first", "holds"]


def first(tree: Any, test: Callable[[Any], bool]) -> Any:
    """The first leaf of ``tree``, in pytree's order, that passes ``test``, or None."""
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (tuple, list)):
        return tree if test(tree) else None
    for a in tree:
        found = first(a, test) if isinstance(a, _CONTAINERS) else (a if test(a) else None)
        if found is not None:
            return found
    return None


def holds(tree: Any, kind: type | tuple[type, ...]) -> bool:
    """Whether a leaf of ``tree`` is a ``kind``. A loop over each container, recursing only
    into nested containers (a call's arguments are nearly always flat)."""
    if isinstance(tree, kind):
        return True
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (tuple, list)):
        return False
    for a in tree:
        if isinstance(a, kind) or (isinstance(a, _CONTAINERS) and holds(a, kind)):
            return True
    return False


_CONTAINERS = (tuple, list, dict)
