"""Which domain-parallel layer computes a torch module type on bands.

One table, read by both front ends: :func:`mpidp.convert_to_domain_parallel` swaps a module
for its layer, and ShardedTensor dispatch builds the same layer around a functional call's
tensors (``F.conv2d(x, w)`` runs :class:`~mpidp.layers.DomainParallelConv2d`). A module type
registers its layer where the layer is defined (:func:`register_layer`), so neither front
end imports the models it serves.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["layer_for", "register_layer", "registered"]

_LAYERS: dict[type[nn.Module], type[Any]] = {}


def register_layer(torch_type: type[nn.Module], layer: type[Any]) -> None:
    """``layer`` (a :class:`~mpidp.layers.base.DomainParallel` subclass of ``torch_type``, with
    ``from_module(module, manager, shard_dim)``) computes ``torch_type`` on bands. The most
    derived registered type of a module wins; a later registration of one type replaces it."""
    _LAYERS[torch_type] = layer


def layer_for(kind: type[nn.Module]) -> tuple[type[nn.Module], type[Any]] | None:
    """``(registered type, layer)`` for the most derived registered base of ``kind``."""
    for base in kind.__mro__:
        layer = _LAYERS.get(base)
        if layer is not None:
            return base, layer
    return None


def registered() -> dict[type[nn.Module], type[Any]]:
    """A copy of the table (torch type -> layer)."""
    return dict(_LAYERS)
