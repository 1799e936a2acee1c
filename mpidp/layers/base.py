"""What every domain-parallel layer shares: its manager, its sharded dim, the input partition."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.ops.bands import (
    _NOTES,
    _TORCH_PATH,
    SHARDED_CALL,
    SHARDED_TYPES,
    LayoutMismatch,
    band_call,
    in_band_call,
    in_torch_path,
    learn_spec,
    not_a_band,
    note_replicated,
    torch_path,
)
from mpidp.ops.geometry import HaloSpec
from mpidp.ops.halo import halo_exchange
from mpidp.ops.halo_band import Kept, kept_fetch
from mpidp.runtime.grid import BlockSpec, blocks_refused
from mpidp.runtime.manager import DistributedManager, bound
from mpidp.runtime.partition import ShardSpec, known_spec
from mpidp.runtime.transports import hands_out_bare

__all__ = [
    "Axis",
    "DomainParallel",
    "band_call",
    "band_forward",
    "fetch_halo",
    "in_band_call",
    "in_progress",
    "in_torch_path",
    "not_a_band",
    "LayoutMismatch",
    "known_spec",
    "learn_spec",
    "note_replicated",
    "serve",
    "serving",
    "torch_path",
    "with_rows",
]

#: the manager of the call in progress (a converted model's forward, a layer run on a
#: ShardedTensor's band): what a layer or converted model bound to None computes on inside it
_SERVING: contextvars.ContextVar[DistributedManager | None] = contextvars.ContextVar(
    "mpidp_serving", default=None
)


def serving(manager: DistributedManager | None) -> DistributedManager:
    """The manager a layer or converted model bound to ``manager`` computes on: ``manager``;
    None: the manager of the call in progress (:func:`serve`), else the default one."""
    return bound(manager if manager is not None else _SERVING.get())


def in_progress() -> DistributedManager | None:
    """The manager of the call in progress (:func:`serve`), or None outside any."""
    return _SERVING.get()


class serve:
    """``with serve(manager):`` the layers and converted models bound to None compute on
    ``manager`` (a ShardedTensor's, whose group the call's collectives must be over). A class,
    not a generator: every layer call on a ShardedTensor enters one."""

    __slots__ = ("manager", "token")

    def __init__(self, manager: DistributedManager) -> None:
        self.manager = manager

    def __enter__(self) -> None:
        self.token = _SERVING.set(self.manager)

    def __exit__(self, *exc: object) -> None:
        _SERVING.reset(self.token)


#: distinct calls a layer keeps plans for (:meth:`DomainParallel._kept_call`): a layer sees a
#: few shapes (training and validation batches, a second resolution)
KEPT_CALLS = 16


class KeptCalls(dict[Any, Any]):
    """A layer's kept calls (:meth:`DomainParallel._kept_call`), by key. Never copied or
    pickled with the layer: a deep copy (an EMA model, a dry run) or a saved model starts
    without them, as they hold this process's transports and buffers."""

    def __deepcopy__(self, memo: dict[int, Any]) -> KeptCalls:
        return KeptCalls()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (KeptCalls, ())


class Repeat(NamedTuple):
    """A layer's call on a band of known partition, kept for its repeats
    (:meth:`DomainParallel._kept_call`): the halo exchange the call made
    (:func:`~mpidp.ops.halo_band.kept_fetch`), then the call's own steps: zero rows up to
    ``need`` on a rank without output rows (0: none), the notes of the output's partition,
    the local padding (F.pad's widths and mode, or None), the kernel (``kernel(layer, ext)``),
    the output cut to ``rows`` along the band's dim (None: as computed); it serves while the
    manager's partition policy is ``policy``."""

    kept: Kept
    dim: int
    need: int
    notes: tuple[Any, ...]
    pad: tuple[list[int], str] | None
    kernel: Callable[[Any, torch.Tensor], torch.Tensor]
    rows: int | None
    #: the manager's partition policy the call derived its output's partition with
    policy: Any

    def run(self, layer: Any, x: torch.Tensor) -> torch.Tensor | None:
        """The call on ``x``; None once the exchange's agreement lapsed (the general path then
        agrees anew)."""
        kept = self.kept
        if kept.box.get("_halo_agreed") is not kept.agreed:
            return None
        ext = kept.fetch(x)
        if self.need:
            ext = with_rows(ext, self.dim, self.need)
        notes = _NOTES.get()
        if notes is not None:
            notes.extend(self.notes)
        if self.pad is not None:
            ext = F.pad(ext, self.pad[0], mode=self.pad[1])
        y = self.kernel(layer, ext)
        return y if self.rows is None else y.narrow(self.dim, 0, self.rows)


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


@dataclasses.dataclass(frozen=True)
class Axis:
    """A dim of a layer's input cut over ``transport``'s ranks (a band's rows, or one axis of
    a block)."""

    dim: int
    transport: Transport


def fetch_halo(
    layer: DomainParallel,
    x: torch.Tensor,
    cuts: Sequence[tuple[Axis, ShardSpec, HaloSpec]],
    boundary: str | tuple[str, str],
    roll_dim: int = -1,
) -> torch.Tensor:
    """``x`` extended by each cut axis's halo: the 1-D exchange on bands, the block exchange
    (corners and the polar fold included) on blocks. ``boundary``: one kind for every cut axis
    or a ``(latitude, longitude)`` pair; a polar latitude on bands rolls ``roll_dim``.
    Collective over the domain group."""
    lat_b, lon_b = (boundary, boundary) if isinstance(boundary, str) else boundary
    if len(cuts) == 1:
        axis, spec, halo = cuts[0]
        return halo_exchange(
            x,
            halo.before,
            halo.after,
            axis.dim,
            spec,
            boundary=lat_b,
            group=axis.transport,
            roll_dim=roll_dim,
        )
    (lat, s_lat, h_lat), (lon, s_lon, h_lon) = cuts
    return halo_exchange(
        x,
        (h_lat.before, h_lon.before),
        (h_lat.after, h_lon.after),
        (lat.dim, lon.dim),
        BlockSpec(s_lat, s_lon, (lat.dim, lon.dim)),
        layer._manager(),
        (lat_b, lon_b),
    )


def _opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind :func:`torch.compiler.disable`: dynamo breaks the graph at the call and
    runs it eagerly (a layer's MPI calls, plans and cached buffers are not traceable), and
    compiles the model's code between layers. The disabled function is made at the first call
    that dynamo traces (importing dynamo costs 1.7 s of every process's start); an eager call
    runs ``fn`` as it is, in a process that compiles too (the disabled function's own entry
    costs every layer call tens of microseconds)."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # (under dynamo's trace is_compiling() is True: the call takes the disabled function)
        if "torch._dynamo" not in sys.modules or not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call


def _sharded_entry(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` opaque to ``torch.compile`` (:func:`_opaque`), or, when an argument is a
    ShardedTensor, the layer run on its band (:data:`SHARDED_CALL`): a converted layer is the
    kernel ShardedTensor dispatch runs. One frame a call: the eager test of :func:`_opaque`
    made here."""
    opaque = _opaque(forward)

    @functools.wraps(forward)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if SHARDED_TYPES and not _TORCH_PATH.get():
            kind = SHARDED_TYPES[0]
            for a in (*args, *kwargs.values()) if kwargs else args:  # (no generator: per call)
                if isinstance(a, kind):
                    return SHARDED_CALL[0](self, opaque, args, kwargs)
        if "torch._dynamo" not in sys.modules or not torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        return opaque(self, *args, **kwargs)

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
    call = _sharded_entry(forward)
    call.__mpidp_band_forward__ = True  # type: ignore[attr-defined]
    return call


class DomainParallel:
    """Mixin for layers sharded along one spatial dim over a manager's domain group.

    ``shard_dim`` counts from the end of the input (-2: H of (B, C, H, W) and (B, C, T, H, W));
    ``dp_manager`` None means the manager of the call in progress (a converted model's, a
    ShardedTensor's: :func:`serving`), else the default manager, looked up at each call.
    """

    shard_dim: int = -2
    dp_manager: DistributedManager | None = None
    #: exact on latitude x longitude blocks too (its band code runs per axis of :meth:`_axes`);
    #: a layer without it refuses a grid that cuts the longitude
    on_blocks: bool = False

    # -- what the pre-flight tools (mpidp.preflight: validate, plan) ask of a layer's class,
    # for the serial module it replaces; torch's own layer types are read by validate itself
    #: the dry run lists this layer (rows in and out per rank) though its torch type is not
    #: one of torch's spatial layers (the example models' own modules)
    dry_run: bool = False
    #: an output of fewer rows than ranks is the whole result on every rank (adaptive pools)
    whole_when_short: bool = False
    #: the sharded dim of its input / output is one more from the end (channels-last tokens)
    channels_last_in: bool = False
    channels_last_out: bool = False

    @classmethod
    def geometry(cls, module: Any, k: int) -> tuple[int, int, tuple[int, int], int] | None:
        """(kernel, stride, (padding before, after), dilation) of a window along spatial axis
        ``k``; None when the layer reads no window."""
        return None

    @classmethod
    def halo_of(
        cls, module: Any, spec_in: ShardSpec, spec_out: ShardSpec, k: int, n_in: int, n: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
        """(rows before, rows after per rank, what fills rows beyond the field) that the
        layer's band form fetches along spatial axis ``k`` of ``n``, cutting ``n_in`` input
        rows by ``spec_in`` and its output by ``spec_out``; None when it fetches none. By
        default the rows its window (:meth:`geometry`) reads, filled by :meth:`boundary_of`."""
        geo = cls.geometry(module, k)
        if geo is None:
            return None
        halo = HaloSpec.for_layer(spec_in, spec_out, *geo)
        return halo.before, halo.after, cls.boundary_of(module)

    @classmethod
    def boundary_of(cls, module: Any) -> str:
        """What fills the rows of a window beyond the field (a :class:`~mpidp.Boundary` kind)."""
        return "zeros"

    @classmethod
    def modes_of(cls, module: Any, shape_in: Any, parts: int, partition: Any) -> tuple[int, ...]:
        """A spectral layer: its W modes on each rank (its spectra's cut); else ``()``."""
        return ()

    @classmethod
    def window_of(cls, module: Any, d: int) -> tuple[int, ...]:
        """Windowed attention: (window rows, shift) along dim ``d``; else ``()``."""
        return ()

    @classmethod
    def transpose_bytes(cls, layer: Any, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` sends in a training step in this layer's transposes beyond its halo
        (a :class:`~mpidp.preflight.validate.LayerSharding` of the dry run)."""
        return 0

    @classmethod
    def block_transpose_bytes(
        cls, lat: Any, lon: Any, i: int, j: int, itemsize: int, partition: Any
    ) -> int:
        """Bytes block ``(i, j)`` sends in a training step in this layer's transposes on a grid
        of blocks (``lat``, ``lon``: the layer cut along the latitude and along the longitude,
        :class:`~mpidp.preflight.validate.LayerSharding`; ``partition``: the policy that cut
        them). By default the band transposes along each cut axis in turn, as the layer's
        block form makes them: along the latitude column on the block's columns, then along
        the longitude row on the rows that gave (:meth:`_rows_after`)."""
        cols = lon.rows_in[j] / max(sum(lon.rows_in), 1)
        along_lat = cls.transpose_bytes(lat, i, itemsize) * cols
        along_lon = cls.transpose_bytes(lon, j, itemsize) * cls._rows_after(lat, i)
        return round(along_lat + along_lon)

    @classmethod
    def _rows_after(cls, lat: Any, i: int) -> float:
        """The share of the rows latitude index ``i`` holds after the transposes along the
        latitude: by default its rows of the layer's output."""
        return lat.rows_out[i] / max(sum(lat.rows_out), 1)

    @classmethod
    def saved_shares(cls, layer: Any) -> list[float] | None:
        """Each rank's share of what this layer saves for the backward inside it, where its
        layout has no sharded dim to read it off (windows); None: read off the dims."""
        return None

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
        whose first layer this is takes its input bands cut along it (one more from the end
        for channels-last tokens)."""
        return self.shard_dim - 1 if self.channels_last_in else self.shard_dim

    def own_manager(self) -> DistributedManager | None:
        """The manager this layer computes on in this call: its own (``dp_manager``), else
        the call in progress's (:func:`serve`); None: a ShardedTensor's, or the default."""
        return self.dp_manager if self.dp_manager is not None else _SERVING.get()

    def _manager(self) -> DistributedManager:
        m = bound(self.own_manager())  # (compat layers override own_manager)
        if m._blocks and not self.on_blocks:  # it would take its block for a band
            raise blocks_refused(m, f"the converted layer {type(self).__name__}")
        return m

    def _axes(self, x: torch.Tensor) -> list[Axis]:
        """The dims of ``x`` this rank's part is cut along, with the transport of each: the
        sharded dim over the latitude column (on bands the domain group itself) and, on blocks,
        the dim after it (the longitude) over the longitude row. A layer computes the same per
        axis on both."""
        m = self._manager()
        d = x.dim() + self.shard_dim
        if not m._blocks:  # the latitude column is the domain group
            return [Axis(d, m.transport(None, x.device))]
        if self.shard_dim > -2:  # cut along its last dim: a 1-D layer has no longitude
            raise blocks_refused(m, f"the converted layer {type(self).__name__} (1-D)")
        return [Axis(d, m.transport("lat", x.device)), Axis(d + 1, m.transport("lon", x.device))]

    def _kept_call(
        self, m: DistributedManager, x: torch.Tensor, *facts: Any
    ) -> tuple[tuple[Any, ...] | None, Any]:
        """(the key of this call, the plan :meth:`_keep_call` kept for it, or None).

        A layer whose repeated calls make the same exchange and kernel keeps what its first
        call resolved (the partitions, the halo, the kernel's arguments) by the call's facts:
        the input's shape, dtype, device and gradient flag, the manager (while it hands out
        its own transports: not shut down, no counting or profiling block) with its overlap
        switch, and the layer's own ``facts`` (its known input partition, its kernel's
        geometry); a kept call serves while the manager's partition policy is the one it was
        kept with. ``m``: the layer's manager (:meth:`_manager`). Key None: this call is not
        to be kept."""
        if not hands_out_bare(m):
            return None, None
        grad = torch.is_grad_enabled() and x.requires_grad
        key = (x.shape, x.dtype, x.device, grad, m, m.overlap, *facts)
        kept = self.__dict__.get("_kept_calls")
        if not kept:
            return key, None
        try:
            found = kept.get(key)
        except TypeError:  # a fact that is not a plain value
            return None, None
        if found is not None and found.policy is not m.partition:  # (identity: no hash)
            return key, None
        return key, found

    def _repeated(
        self, m: DistributedManager, x: torch.Tensor, *facts: Any
    ) -> tuple[tuple[Any, ...] | None, torch.Tensor | None]:
        """(the key of this call, its output when a kept :class:`Repeat` served it, else
        None: the layer's general path runs, and keeps the call by the key)."""
        key, repeat = self._kept_call(m, x, *facts)
        return key, None if repeat is None else repeat.run(self, x)

    def _keep_call(self, key: tuple[Any, ...], plan: Any) -> None:
        """Keep ``plan`` for the calls of ``key`` (:meth:`_kept_call`)."""
        kept = self.__dict__.setdefault("_kept_calls", KeptCalls())
        if len(kept) >= KEPT_CALLS:  # many distinct calls: start over
            kept.clear()
        try:
            kept[key] = plan
        except TypeError:
            pass

    def _keep_repeat(
        self,
        key: tuple[Any, ...],
        x: torch.Tensor,
        cut: tuple[Axis, ShardSpec, HaloSpec],
        boundary: str,
        roll_dim: int = -1,
        *,
        need: int,
        notes: tuple[Any, ...],
        pad: tuple[list[int], str] | None,
        kernel: Callable[[Any, torch.Tensor], torch.Tensor],
        rows: int | None,
    ) -> None:
        """Keep the call of ``key`` just made on ``x``, a band of known partition cut as
        ``cut`` says, as a :class:`Repeat` (when its halo exchange is one a repeat can make:
        :func:`~mpidp.ops.halo_band.kept_fetch`)."""
        axis, spec, halo = cut
        t = axis.transport
        kept = kept_fetch(x, halo.before, halo.after, axis.dim, spec, boundary, t, roll_dim)
        if kept is not None:
            policy = self._manager().partition
            self._keep_call(key, Repeat(kept, axis.dim, need, notes, pad, kernel, rows, policy))

    def _alone(self) -> bool:
        """Whether the domain group has one rank: the layer then is its torch module (the
        same function, computed by torch's own kernels; no halo, no statistics to merge)."""
        return _TORCH_PATH.get() or self._manager().domain_world_size == 1

    def _manager_if_cut(self) -> DistributedManager | None:
        """The layer's manager (:meth:`_manager`), or None when it is :meth:`_alone`."""
        if _TORCH_PATH.get():
            return None
        m = self._manager()
        return None if m.domain_world_size == 1 else m

    def _out_spec(self, n: int, t: Transport | None = None) -> ShardSpec:
        """The partition of this layer's output (``n`` rows) by the manager's policy, over the
        ranks of ``t`` (an axis of :meth:`_axes`; default the domain group)."""
        manager = self._manager()
        try:
            spec = manager.partition.derived(n, t.size if t else manager.domain_world_size)
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
