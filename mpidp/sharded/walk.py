"""The walk over a call's arguments that every dispatched call makes: the tensors inside the
containers torch functions take (tuples, named tuples, lists, dicts), found without pytree's
bookkeeping (its flatten and unflatten cost several microseconds a call). For the builtin
containers it visits what ``torch.utils._pytree.tree_flatten`` visits, in the same order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["holds", "leaves"]


def leaves(tree: Any) -> Iterator[Any]:
    """The leaves of ``tree`` in pytree's order."""
    if isinstance(tree, (tuple, list)):
        for a in tree:
            yield from leaves(a)
    elif isinstance(tree, dict):
        for a in tree.values():
            yield from leaves(a)
    else:
        yield tree


def holds(tree: Any, kind: type | tuple[type, ...]) -> bool:
    """Whether a leaf of ``tree`` is a ``kind``."""
    if isinstance(tree, kind):
        return True
    if isinstance(tree, (tuple, list)):
        return any(holds(a, kind) for a in tree)
    if isinstance(tree, dict):
        return any(holds(a, kind) for a in tree.values())
    return False
