"""What a call on bands knows about them, below the layers that use it: the partition of a
band learned from every rank's extent (:func:`learn_spec`), the bands a ShardedTensor call
handed to a layer (:func:`band_call`, :func:`in_band_call`, :class:`LayoutMismatch`,
:func:`not_a_band`), what the layer notes about its output (:func:`note_replicated`), and the
torch path of dry runs (:func:`torch_path`). The layers (:mod:`mpidp.layers.base` re-exports
these names), the distributed FFT and the training helpers read them."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.runtime.partition import ShardSpec, known_for, learned

__all__ = [
    "LayoutMismatch",
    "band_call",
    "in_band_call",
    "in_torch_path",
    "learn_spec",
    "not_a_band",
    "note_replicated",
    "torch_path",
]

_TORCH_PATH = contextvars.ContextVar("mpidp_torch_path", default=False)
# What a layer called with ShardedTensors declares about its output while it runs: the
# partition it computed (``_out_spec``) or that it is the same on every rank.
_NOTES: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "mpidp_layer_notes", default=None
)
# The bands a ShardedTensor call handed to a layer, with their sharded dims
_BANDS: contextvars.ContextVar[tuple[tuple[torch.Tensor, int], ...]] = contextvars.ContextVar(
    "mpidp_layer_bands", default=()
)
#: Runs a layer on ShardedTensor arguments (set by :mod:`mpidp.sharded.modules`)
SHARDED_CALL: list[Callable[..., Any]] = []
#: Tensor types that route a layer call through :data:`SHARDED_CALL`
SHARDED_TYPES: list[type] = []


class LayoutMismatch(Exception):
    """A layer asked for the partition of a ShardedTensor's band along a dim it is not cut
    along: the layer does not apply to this layout (its torch form runs through dispatch)."""


def note_replicated() -> None:
    """Declare, inside a layer's forward, that its result is the same whole value on every
    rank (an adaptive pool to fewer rows than ranks)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append(("replicated",))


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Inside this block every domain-parallel layer runs its torch module's forward (no
    communication): for dry runs on meta tensors of the global shape."""
    token = _TORCH_PATH.set(True)
    try:
        yield
    finally:
        _TORCH_PATH.reset(token)


def in_torch_path() -> bool:
    """Whether :func:`torch_path` is on (the layers run their torch forward)."""
    return _TORCH_PATH.get()


def learn_spec(x: torch.Tensor, dim: int, t: Transport) -> ShardSpec:
    """The partition of ``x`` along ``dim``: every rank's local extent, in one all-gather of
    one integer. Nothing is cached on the local shape (two global sizes can give a rank the
    same local size). Collective over the transport's group, except inside :func:`known_spec`
    for its band."""
    known = known_for(x, dim)
    if known is not None:
        return known
    for band, d in _BANDS.get():
        if band is x and d != dim % x.dim():
            raise LayoutMismatch(f"cut along dim {d}, asked along {dim % x.dim()}")
    spec = ShardSpec(tuple(row[0] for row in t.all_gather_ints([x.size(dim)])))
    learned(x, dim, spec)
    return spec


def not_a_band(x: torch.Tensor) -> bool:
    """Inside a layer's call on ShardedTensors: whether ``x`` is a whole tensor beside the
    bands (learned latent queries against a band of keys), which the layer's band form does not
    take: it raises :class:`LayoutMismatch` and its torch form runs through dispatch."""
    bands = _BANDS.get()
    return bool(bands) and not any(band is x for band, _ in bands)


def in_band_call() -> bool:
    """Whether a layer runs inside a call on ShardedTensors (:func:`band_call`), where a
    :class:`LayoutMismatch` hands the call to its torch form through dispatch."""
    return bool(_BANDS.get())


@contextlib.contextmanager
def band_call(bands: tuple[tuple[torch.Tensor, int], ...]) -> Iterator[list[Any]]:
    """Inside this block a layer runs on ``bands`` (band, sharded dim) of ShardedTensors:
    asking one for its partition along another dim raises :class:`LayoutMismatch`; the block
    yields the notes the layer makes about its output (``_out_spec``, :func:`note_replicated`)."""
    notes: list[Any] = []
    t1, t2 = _NOTES.set(notes), _BANDS.set(bands)
    try:
        yield notes
    finally:
        _BANDS.reset(t2)
        _NOTES.reset(t1)
