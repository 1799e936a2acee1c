"""What every domain-parallel layer shares: its manager, its sharded dim, the input partition."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.manager import DistributedManager, get_manager
from mpidp.partition import ShardSpec, known_for, known_spec

__all__ = [
    "DomainParallel",
    "LayoutMismatch",
    "known_spec",
    "learn_spec",
    "note_replicated",
    "torch_path",
    "with_rows",
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
    return ShardSpec(tuple(row[0] for row in t.all_gather_ints([x.size(dim)])))


def not_a_band(x: torch.Tensor) -> bool:
    """Inside a layer's call on ShardedTensors: whether ``x`` is a whole tensor beside the
    bands (learned latent queries against a band of keys), which the layer's band form does not
    take: it raises :class:`LayoutMismatch` and its torch form runs through dispatch."""
    bands = _BANDS.get()
    return bool(bands) and not any(band is x for band, _ in bands)


def with_rows(ext: torch.Tensor, dim: int, need: int) -> torch.Tensor:
    """``ext`` with zero rows appended up to ``need`` rows along ``dim``.

    A rank that owns no output rows (an empty shard) still runs its layer's op, on rows whose
    result it then drops: its output gets the right shape and its graph still reaches the
    halo exchange and the weights (zero gradients, the same backward on every rank)."""
    short = need - ext.size(dim)
    if short <= 0:
        return ext
    shape = list(ext.shape)
    shape[dim] = short
    return torch.cat([ext, ext.new_zeros(shape)], dim)


def _opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind :func:`torch.compiler.disable`: dynamo breaks the graph at the call and
    runs it eagerly (a layer's MPI calls, plans and cached buffers are not traceable), and
    compiles the model's code between layers. The disabled function is made at the first call
    in a process that has imported dynamo: importing it costs 1.7 s of every process's start,
    and a process that never compiles runs ``fn`` as it is."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing compiles in this process
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call


def _sharded_entry(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, or, when an argument is a ShardedTensor, the layer run on its band
    (:data:`SHARDED_CALL`): a converted layer is the kernel ShardedTensor dispatch runs."""

    @functools.wraps(forward)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if SHARDED_TYPES and not _TORCH_PATH.get():
            kinds = tuple(SHARDED_TYPES)
            if any(isinstance(a, kinds) for a in args) or any(
                isinstance(a, kinds) for a in kwargs.values()
            ):
                return SHARDED_CALL[0](self, forward, args, kwargs)
        return forward(self, *args, **kwargs)

    return call


def band_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of every domain-parallel layer's ``forward`` (a class deriving from
    :class:`DomainParallel` that defines ``forward`` must apply it; the class statement raises
    otherwise). The decorated forward

    * hands a call with a ShardedTensor argument to ShardedTensor dispatch's layer runner
      (:data:`SHARDED_CALL`, which :mod:`mpidp.sharded.modules` fills): the layer's band form
      then is the kernel of that call (:func:`_sharded_entry`);
    * is opaque to ``torch.compile`` (:func:`_opaque`): a layer's MPI calls are not traceable.

    Called with plain tensors (this rank's bands) it is the undecorated ``forward``."""
    call = _sharded_entry(_opaque(forward))
    call.__mpidp_band_forward__ = True  # type: ignore[attr-defined]
    return call


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


class DomainParallel:
    """Mixin for layers sharded along one spatial dim over a manager's domain group.

    ``shard_dim`` counts from the end of the input (-2: H of (B, C, H, W) and (B, C, T, H, W));
    ``dp_manager`` None means the default manager, looked up at each call.
    """

    shard_dim: int = -2
    dp_manager: DistributedManager | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A layer that defines ``forward`` decorates it with :func:`band_forward` (checked
        here, nothing rewritten)."""
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not getattr(forward, "__mpidp_band_forward__", False):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__}.forward: a DomainParallel layer's "
                f"forward is decorated with @mpidp.layers.base.band_forward (it routes "
                f"ShardedTensor calls and hides the layer's MPI calls from torch.compile)"
            )

    def _dp_setup(self, manager: DistributedManager | None, shard_dim: int) -> None:
        if shard_dim >= 0:
            raise ConfigError(
                f"shard_dim={shard_dim}: count it from the end of the input (e.g. -2 for H of "
                f"(B, C, H, W)), so that it means the same with and without a batch dim"
            )
        self.dp_manager = manager
        self.shard_dim = shard_dim

    def input_band_dim(self) -> int:
        """The dim (from the end) along which this layer's input is cut: a converted model
        whose first layer this is takes its input bands cut along it."""
        return self.shard_dim

    def _manager(self) -> DistributedManager:
        return self.dp_manager if self.dp_manager is not None else get_manager()

    def _alone(self) -> bool:
        """Whether the domain group has one rank: the layer then is its torch module (the
        same function, computed by torch's own kernels; no halo, no statistics to merge)."""
        return _TORCH_PATH.get() or self._manager().domain_world_size == 1

    def _out_spec(self, n: int) -> ShardSpec:
        """The partition of this layer's output (``n`` rows) by the manager's policy."""
        manager = self._manager()
        try:
            spec = manager.partition.derived(n, manager.domain_world_size)
        except ConfigError as err:
            raise ConfigError(
                f"rank {manager.rank}: {type(self).__name__} {self!r} gives {n} output rows "
                f"along the sharded dim: {err}"
            ) from None
        notes = _NOTES.get()
        if notes is not None:
            notes.append(("spec", spec))
        return spec

    def _transport(self, x: torch.Tensor) -> Transport:
        return self._manager().transport(None, x.device)

    @classmethod
    def from_module(
        cls, module: Any, manager: DistributedManager | None = None, shard_dim: int = -2
    ) -> Any:
        """This wrapper around ``module``'s own parameters and buffers (shared, not copied)."""
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)
        new._dp_setup(manager, shard_dim)
        return new
