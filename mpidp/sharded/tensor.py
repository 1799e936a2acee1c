"""ShardedTensor: a band that knows it is a band, and Replicated: a value every rank holds.

A :class:`ShardedTensor` is this rank's band of a global tensor cut along one dim
(``shard_dim``) by a :class:`~mpidp.ShardSpec`, over a manager's domain group. It reports the
GLOBAL shape, so a model written for one process sees the sizes it expects; every torch
function called on it goes through :func:`mpidp.sharded.dispatch.dispatch`, which computes the
band of the serial result or raises.

Imports run one way: this module sits below the modules that give the types their behaviour
(the dispatcher and its handlers build ShardedTensors). The two ways up are registrations made
once, when :mod:`mpidp.sharded` is imported (its ``__init__``): :func:`use_dispatcher` names
the dispatcher, and :func:`on_first` adds what the first ShardedTensor turns on.

Gradients, the rule (docs/sharded_tensor.md):

* a ShardedTensor's gradient is the gradient of its own rows, exact;
* a :class:`Replicated` value (a reduction over the sharded dim, ``full_tensor()``) holds the
  same value on every rank and the same, whole gradient (every rank seeds ``loss.backward()``
  with 1: that is the gradient, counted once);
* a plain tensor (a parameter, a constant) holds this rank's share of its gradient:
  ``mpidp.sync_gradients`` sums the shares over the domain group. Used on a band its share is
  what the band contributes; used in a replicated computation (``F.linear`` of a pooled
  vector) the whole gradient goes to rank 0 of the group and zeros to the others;
* a Replicated value that meets a band (``conv(x) * g``) enters through
  :func:`mpidp.copy_to`: its gradient is the sum of every rank's share, whole again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from mpidp.comm import Transport
from mpidp.errors import ConfigError, MpidpError
from mpidp.ops.collectives import all_gather_v_replicated
from mpidp.runtime.adopt import mesh_ndim
from mpidp.runtime.grid import BlockSpec, blocks_refused
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import PartitionPolicy, ShardSpec
from mpidp.sharded import block_layout as bl
from mpidp.sharded import layout as pl
from mpidp.sharded.layout import chunk_spec  # also mpidp.sharded.tensor.chunk_spec, as before
from mpidp.sharded.walk import first, holds

__all__ = ["ShardedTensor", "Replicated", "shard", "replicated"]

#: Tensor methods and properties whose answer is the wrapper's global metadata (filled by
#: :mod:`mpidp.sharded.pointwise`, which registers the same ones as handlers)
META_METHODS: set[Any] = set()
META_GETTERS: set[str] = set()

#: What the first ShardedTensor of a process turns on, once: the bridge that runs a user's
#: ``torch.autograd.Function`` on ShardedTensors (:mod:`mpidp.sharded.function` adds its
#: ``install`` through :func:`on_first`). A program that imports mpidp and never shards runs
#: torch as it is.
_ON_FIRST: list[Any] = []
_FIRST_DONE: list[bool] = []
#: set once the process makes a block ShardedTensor: until then dispatch never looks for one
GRID_SEEN: list[bool] = []
#: set once the process makes a ShardedTensor whose sharded dim holds merged blocks
#: (``blocks > 1``): until then dispatch never looks for one
MERGED_SEEN: list[bool] = []

Dispatcher = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def _not_ready(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise MpidpError(
        f"internal error: {func} ran on a ShardedTensor before mpidp.sharded finished "
        f"importing (its dispatcher is set at the end of mpidp/sharded/__init__.py)"
    )


#: Where every torch function on a ShardedTensor or Replicated value goes:
#: :func:`mpidp.sharded.dispatch.dispatch`, set by :func:`use_dispatcher`
_DISPATCHER: list[Dispatcher] = [_not_ready]


def use_dispatcher(dispatch: Dispatcher) -> None:
    """Send every torch function on a ShardedTensor to ``dispatch`` (called once, by
    ``mpidp/sharded/__init__.py``: the dispatcher sits above this module)."""
    _DISPATCHER[0] = dispatch


def has_sharded(args: Any, kwargs: Any) -> bool:
    """Whether a ShardedTensor is among a call's arguments."""
    return holds(args, ShardedTensor) or holds(kwargs, ShardedTensor)


def on_first(turn_on: Any) -> None:
    """Call ``turn_on()`` when the first ShardedTensor of the process is made (now, if one
    already was)."""
    _ON_FIRST.append(turn_on)
    if _FIRST_DONE:
        turn_on()


class ShardedTensor(torch.Tensor):
    """This rank's band (``.local``) of a global tensor cut along ``shard_dim`` by ``spec``,
    or, on a latitude x longitude grid, its block (:attr:`grid`: ``spec`` cuts the latitude
    ``shard_dim`` over the latitude column, ``grid.lon`` the longitude ``grid.dims[1]`` over the
    longitude row; docs/sharded_tensor.md, "Blocks").

    Build one with :func:`mpidp.shard` (from the full tensor, no communication) or
    :meth:`from_local` (from the band). ``shape``, ``size()``, ``dim()`` and ``numel()`` are
    the global ones.
    """

    _local: torch.Tensor
    _spec: ShardSpec
    _dim: int
    _manager: DistributedManager
    _blocks: int
    _shape: torch.Size
    _grid: BlockSpec | bl.TokenSpec | None = None  # a band, unless __new__ (or a copy) sets it
    _spectral: bool = False  # a band of modes of a spectrum of blocks (see :attr:`spectral`)

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        spec: ShardSpec,
        dim: int,
        manager: DistributedManager,
        blocks: int = 1,
        grid: BlockSpec | bl.TokenSpec | None = None,
        spectral: bool = False,
    ) -> ShardedTensor:
        shape = list(local.shape)
        rows = blocks  # the runs of ``spec`` along ``dim``: a band's blocks, a block's lead
        if grid is not None:  # a block: spec and dim are its latitude's; tokens: their counts'
            if isinstance(grid, bl.TokenSpec):
                spec, dim = grid.counts, grid.dim
            else:
                spec, dim, rows = grid.lat, grid.dims[0], grid.lead[0]
                shape[grid.dims[1]] = grid.lead[1] * grid.lon.total
            spectral = False
            if not GRID_SEEN:
                GRID_SEEN.append(True)
        elif manager._blocks:  # every ShardedTensor is made here: band code meeting blocks
            if not (spectral or bl.SPECTRAL_CALL):  # only a spectrum's modes are a band there
                raise blocks_refused(manager, "a band ShardedTensor")
            spectral = True
        else:
            spectral = False
        if blocks > 1 and not MERGED_SEEN:
            MERGED_SEEN.append(True)
        shape[dim] = rows * spec.total
        out = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        out._local, out._spec, out._dim, out._manager = local, spec, dim, manager
        out._shape = torch.Size(shape)
        out._blocks, out._grid, out._spectral = blocks, grid, spectral
        if not _FIRST_DONE:
            _FIRST_DONE.append(True)
            for turn_on in _ON_FIRST:
                turn_on()
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    # -- what it is -------------------------------------------------------------------------

    def dim(self) -> int:
        """The number of dims (the band's: the same as the global tensor's). Answered here, not
        through ``__torch_function__``: the rules ask it several times per call."""
        return self._local.dim()

    def size(self, dim: int | None = None) -> Any:
        """The global shape, or its extent along ``dim`` (answered here, as :meth:`dim`: a
        model asks it between its ops, ``y.size(-1)``)."""
        return self._shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:  # type: ignore[override]
        """See :meth:`dim`."""
        return self._local.dim()

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        """The global shape (answered here, as :meth:`dim`)."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        """The band's dtype, the wrapper's (answered here, as :meth:`dim`)."""
        return self._local.dtype

    @property
    def local(self) -> torch.Tensor:
        """This rank's band (a plain tensor, with its autograd history)."""
        return self._local

    @property
    def spec(self) -> ShardSpec:
        """Every rank's extent along :attr:`shard_dim`."""
        return self._spec

    @property
    def shard_dim(self) -> int:
        """The sharded dim (non-negative)."""
        return self._dim

    @property
    def blocks(self) -> int:
        """How many blocks of the partition the sharded dim holds: 1 for a band; ``O > 1``
        when dims before the band were merged into it (windows folded into the batch, (Z, H,
        W) tokens): the global dim is ``O`` blocks of ``spec.total`` rows and this rank holds
        its rows of every block, ``O * spec.sizes[rank]`` (DTensor's strided shard)."""
        return self._blocks

    @property
    def manager(self) -> DistributedManager:
        return self._manager

    @property
    def grid(self) -> BlockSpec | bl.TokenSpec | None:
        """A block's cut of both dims (``lat`` is :attr:`spec`, ``dims[0]`` :attr:`shard_dim`),
        or tokens of blocks (:class:`~mpidp.sharded.block_layout.TokenSpec`); None for a band."""
        return self._grid

    @property
    def spectral(self) -> bool:
        """Whether this is a band of modes of a spectrum of blocks (``torch.fft.rfft2`` of a
        block, or computed from one): the W modes cut over the whole domain group, never a
        field; dispatch runs on it the band rules that read no field and the inverse
        transforms, and refuses the layers (:mod:`mpidp.sharded.fft`)."""
        return self._spectral

    def like(
        self, local: torch.Tensor, dim: int | None = None, spec: ShardSpec | None = None
    ) -> ShardedTensor:
        """``local`` with this tensor's layout (partition, blocks, grid, spectral), sharded
        along ``dim`` (a block keeps its grid only with its own dim and spec)."""
        same = (dim is None or dim == self._dim) and (spec is None or spec == self._spec)
        return ShardedTensor(
            local,
            spec if spec is not None else self._spec,
            self._dim if dim is None else dim,
            self._manager,
            self._blocks,
            self._grid if same else None,
            self._spectral,
        )

    def same_layout(self, local: torch.Tensor) -> ShardedTensor:
        """``local``, a band of this tensor's band's shape, with this tensor's layout: what
        :meth:`like` gives, without re-deriving the global shape (element-wise results). On a
        band (not a block) ``local`` may differ in the dims the band is not cut along (a 1x1
        convolution's channels): its global shape is then its own but along the cut."""
        shape = self._shape
        if local.shape != self._local.shape:
            d = self._dim
            if (
                self._grid is not None
                or local.dim() != self._local.dim()
                or local.size(d) != self._local.size(d)
            ):
                return self.like(local)
            shape = torch.Size((*local.shape[:d], shape[d], *local.shape[d + 1 :]))
        out = torch.Tensor._make_wrapper_subclass(
            ShardedTensor, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        out._local, out._spec, out._dim, out._manager = local, self._spec, self._dim, self._manager
        out._shape, out._blocks, out._grid = shape, self._blocks, self._grid
        out._spectral = self._spectral
        return out

    def rows_of(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of a plain tensor ``t`` whose ``dim`` runs along this tensor's
        sharded dim (its global length there; a block's latitude): the same rows this rank
        holds."""
        g = self._grid
        if isinstance(g, BlockSpec):  # its latitude: this rank's rows of each of its lead runs
            i_lat = self._manager.grid_coords[0]
            return pl.Cut(self._dim, self._spec, i_lat, g.lead[0]).part(t, dim)
        return pl.Cut(self._dim, self._spec, self.rank, self._blocks).part(t, dim)

    def unblocked(self) -> tuple[torch.Tensor, int]:
        """The band with its blocks as a dim of their own: (local, sharded dim), the sharded
        dim cut by ``spec`` exactly (``blocks`` 1: the band itself)."""
        if self._blocks == 1:
            return self._local, self._dim
        d = self._dim
        return self._local.unflatten(d, (self._blocks, self._spec.sizes[self.rank])), d + 1

    @property
    def transport(self) -> Transport:
        return self._manager.transport(None, self._local.device)

    @property
    def rank(self) -> int:
        return self._manager.domain_rank

    @property
    def start(self) -> int:
        """This rank's first global row."""
        return self._spec.start(self.rank)

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        blocks = f", blocks={self._blocks}" if self._blocks > 1 else ""
        if self._grid is not None:
            blocks += f", lon_dim={self._grid.dims[1]}, lon_spec={list(self._grid.lon.sizes)}"
        if self._spectral:
            blocks += ", spectral=True"
        return (
            f"ShardedTensor(shape={tuple(self.shape)}, shard_dim={self._dim}, "
            f"spec={list(self._spec.sizes)}{blocks}, rank={self.rank}, local=\n{self._local!r})"
        )

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_local(
        cls,
        local: torch.Tensor,
        device_mesh: Any = None,
        placements: Sequence[Any] | None = None,
        sharding_shapes: str | dict[int, list[tuple[int, ...]]] = "infer",
        *,
        dim: int | Sequence[int] | None = None,
        spec: ShardSpec | Sequence[int] | BlockSpec | None = None,
        manager: DistributedManager | None = None,
        global_shape: Sequence[int] | None = None,
    ) -> Any:
        """Wrap this rank's ``local`` part (no copy: a leaf's own ``.grad`` is the gradient).

        The layout is ``dim=`` (a band along it) or DTensor's ``placements`` on the manager's
        1-D domain ``device_mesh`` (None: the default manager's): ``[Shard(d)]`` a band,
        ``[Replicate()]`` a value every rank holds (a :class:`Replicated`), ``[Partial()]``
        a summand per rank (reduced here, one all-reduce). With neither, a band along -2
        (mpidp's default; DTensor's is Replicate). The ranks' extents: ``spec``,
        ShardTensor's ``sharding_shapes`` (``{0: [shape per rank]}``, or ``"chunk"`` with
        ``global_shape``: torch.chunk's cut), else learned in one small all-gather
        (``"infer"``). On a grid that cuts the longitude, ``local`` is this rank's block along
        ``dim=(lat, lon)`` (default ``(-2, -1)``), ``spec`` a
        :class:`~mpidp.runtime.grid.BlockSpec` or, when None, learned along each axis. Bands
        and blocks alike, the ranks then agree on the extents (one small all-gather): a part
        that does not fit them, or extents that differ by rank, raise the same ConfigError on
        every rank. Collective over the domain group (but for ``placements``)."""
        if isinstance(device_mesh, int):
            raise ConfigError(
                f"from_local(band, {device_mesh}): the second argument is the device mesh; "
                f"pass the sharded dim as dim={device_mesh}"
            )
        m = pl.manager_of(device_mesh, manager)
        if placements is not None:
            p = pl.one_placement(placements, "from_local", m.rank)
            if isinstance(p, Replicate):
                return replicated(local, m.transport(None, local.device))
            if isinstance(p, Partial):
                return replicated(pl.partial_sum_of(local, p, m), m.transport(None, local.device))
            dim = cast(Any, p).dim
        if m._blocks and dim is None:
            dim = (-2, -1)
        if bl.is_pair(dim) and m._blocks:
            bs = bl.blocks_of_parts(local, dim, m, spec)
            return cls(local, bs.lat, bs.dims[0], m, grid=bs)
        if bl.is_pair(dim):  # bands are the grid (P, 1): the latitude alone is cut
            dim = cast(Any, dim)[0]
        d = pl.normal_dim(local, -2 if dim is None else cast(int, dim))
        if spec is None:
            spec = pl.spec_of_band(sharding_shapes, d, local, m, global_shape)
        if isinstance(spec, BlockSpec):
            spec = spec.lat
        spec = spec if isinstance(spec, ShardSpec) else ShardSpec(tuple(spec))
        pl.check_spec(spec, m, local.size(d), "from_local", local)
        return cls(local, spec, d, m)

    def to_local(self, *, grad_placements: Sequence[Any] | None = None) -> torch.Tensor:
        """This rank's part, a plain tensor with its autograd history (DTensor's name for
        :attr:`local`). ``grad_placements`` must be None or this tensor's placements."""
        if grad_placements is not None and tuple(grad_placements) != self.placements:
            raise ConfigError(
                f"rank {self.rank}: to_local(grad_placements={grad_placements!r}): the "
                f"gradient of a band is a band ({self.placements})"
            )
        return self._local

    @property
    def placements(self) -> tuple[Any, ...]:
        """DTensor's placements on :attr:`device_mesh`: ``(Shard(shard_dim),)``, or
        ``(_StridedShard(shard_dim, split_factor=blocks),)`` when merged dims hold the band;
        on an adopted 2-D mesh a block's ``(Shard(lat_dim), Shard(lon_dim))`` (strided along
        an axis whose ``grid.lead`` is above 1: a batch merged before its cut), a band's (the
        mesh ``(P, 1)``) ``(Shard(shard_dim), Replicate())``."""
        from torch.distributed.tensor.placement_types import _StridedShard

        def cut(d: int, lead: int) -> Any:
            return Shard(d) if lead == 1 else _StridedShard(d, split_factor=lead)

        if mesh_ndim(self._manager) == 2:  # a 2-D mesh's block, or band when it is (P, 1)
            g = self._grid
            if isinstance(g, BlockSpec):  # a lead above 1: strided along that axis
                return cut(self._dim, g.lead[0]), cut(g.dims[1], g.lead[1])
            return (Shard(self._dim), Shard(g.dims[1]) if g is not None else Replicate())
        return (cut(self._dim, self._blocks),)

    @property
    def device_mesh(self) -> Any:
        """The manager's domain mesh (a torch DeviceMesh: 1-D, or the 2-D mesh adopted)."""
        return self._manager.domain_mesh

    def offsets(self, mesh_dim: int | None = None) -> list[int] | int:
        """This rank's first row along the sharded dim, per mesh dim (``[start]``; on a 2-D
        mesh ``[first row, first column]`` of its block), or for ``mesh_dim`` alone."""
        g = self._grid
        i, j = g.coords(self.rank) if g is not None else (self.rank, 0)
        offs = [
            self._spec.start(i),
            *([g.lon.start(j) if g else 0] * (mesh_ndim(self._manager) - 1)),
        ]
        if mesh_dim is None:
            return offs
        if not -len(offs) <= mesh_dim < len(offs):
            raise ConfigError(
                f"rank {self.rank}: offsets(mesh_dim={mesh_dim}): the mesh is {len(offs)}-D"
            )
        return offs[mesh_dim]

    def full_tensor(self, *, grad_placements: Sequence[Any] | None = None) -> Replicated:
        """The whole tensor on every rank (an all-gather; differentiable: the gradient of
        every rank's use comes back to the band once, the replicated rule)."""
        del grad_placements  # the band's gradient is always a band
        t = self.transport
        if self._grid is not None:
            return replicated(bl.whole_of(self._local, self._grid, self._manager), t)
        local, d = self.unblocked()
        whole = all_gather_v_replicated(local, self._spec, d, group=t)
        return replicated(whole.flatten(d - 1, d) if d != self._dim else whole, t)

    def redistribute(
        self,
        device_mesh: Any = None,
        placements: Sequence[Any] | None = None,
        *,
        async_op: bool = False,
        spec: ShardSpec | Sequence[int] | PartitionPolicy | None = None,
        dim: int | None = None,
    ) -> Any:
        """The same global tensor in another layout: DTensor's ``placements`` on the domain
        mesh (``[Shard(d)]``: a band along ``d`` on the manager's partition; ``[Replicate()]``:
        :meth:`full_tensor`), or mpidp's ``spec`` (a ShardSpec, sizes or a policy: another cut
        of the same dim) and ``dim`` (sharded along another dim). Only the rows that change
        owner travel (one ``all_to_all_v``). ``async_op`` is accepted for DTensor's signature;
        the move completes before the call returns. Collective."""
        del async_op
        return pl.redistribute(self, device_mesh, placements, spec, dim)

    # -- DTensor -----------------------------------------------------------------------------

    def to_dtensor(self) -> Any:
        """A DTensor ``Shard(shard_dim)`` on the manager's domain mesh, the rows first moved to
        DTensor's ``torch.chunk`` cut (:func:`mpidp.sharded.layout.to_dtensor`). Collective."""
        return pl.to_dtensor(self)

    @classmethod
    def from_dtensor(
        cls, dt: Any, manager: DistributedManager | None = None, spec: Any = None
    ) -> ShardedTensor:
        """The ShardedTensor of a DTensor ``Shard(d)`` on a 1-D mesh over the domain group,
        moved to ``spec`` (a ShardSpec, sizes or policy; default: the manager's policy).
        Differentiable. Collective."""
        m = manager if manager is not None else get_manager()
        d, n = pl.dtensor_dim(dt, m)
        x = cls(dt.to_local(), chunk_spec(n, m.domain_world_size), d, m)
        return x.redistribute(spec=spec if spec is not None else m.partition)

    # -- dispatch ----------------------------------------------------------------------------

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in META_METHODS or (
            getattr(func, "__name__", "") == "__get__"
            and getattr(getattr(func, "__self__", None), "__name__", "") in META_GETTERS
        ):  # global metadata (shape, dim(), dtype): the wrapper's own, without the registry
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return _DISPATCHER[0](func, tuple(args), kwargs or {})

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise MpidpError(
            f"internal error: {func} reached torch's dispatcher with a ShardedTensor (an op "
            f"ran with __torch_function__ disabled); report it with the traceback"
        )


class Replicated(torch.Tensor):
    """A value every rank of the domain group holds, the same (a reduction over the sharded
    dim, ``full_tensor()``). A real tensor: ``loss.backward()``, ``loss.item()`` work. Ops on
    it stay Replicated; a plain tensor that requires grad and joins it gives its gradient to
    rank 0 only (the shares rule: ``sync_gradients`` sums them)."""

    _t: Transport

    # DTensor's vocabulary: a value every rank holds is Replicate() on the domain mesh

    @property
    def placements(self) -> tuple[Any, ...]:
        """``(Replicate(),)``."""
        return (Replicate(),)

    def to_local(self, *, grad_placements: Sequence[Any] | None = None) -> torch.Tensor:
        """The value. Under PhysicsNeMo's and DTensor's gradient convention (``"whole"``,
        :mod:`mpidp.runtime.adopt`) a plain tensor, as theirs; under mpidp's, this Replicated value
        itself, so that what is computed from it keeps the shares rule."""
        del grad_placements  # a value every rank holds has a gradient every rank holds
        return self.as_subclass(torch.Tensor) if self._t.whole else self

    def full_tensor(self, *, grad_placements: Sequence[Any] | None = None) -> torch.Tensor:
        """The value (it is whole already): see :meth:`to_local`."""
        return self.to_local(grad_placements=grad_placements)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if has_sharded(args, kwargs):
            return _DISPATCHER[0](func, tuple(args), kwargs)
        ref = first((args, kwargs), _is_replicated)  # (builtin containers, without pytree)
        if ref is None:  # inside another container pytree knows
            ref = next(a for a in tree_flatten((args, kwargs))[0] if _is_replicated(a))
        t = ref._t
        _adopt_written(func, args, kwargs, t)
        # (a plain tensor's share differs from the value on a group of several ranks only)
        if t.size > 1 and not t.whole and func not in _NO_SHARES and torch.is_grad_enabled():
            args, kwargs = tree_map(lambda a: _share(a, t), (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _KEEP_PLAIN:
            return out
        if isinstance(out, torch.Tensor):  # (the commonest result: no walk)
            return replicated(out, t) if _is_plain(out) else out
        return tree_map(lambda o: replicated(o, t) if _is_plain(o) else o, out)


def _is_replicated(a: Any) -> bool:
    return isinstance(a, Replicated)


def _is_plain(o: Any) -> bool:
    return isinstance(o, torch.Tensor) and not isinstance(o, (Replicated, ShardedTensor))


# functions whose tensor arguments are not values of the computation
_NO_SHARES = {torch.Tensor.backward, torch.Tensor.detach, torch.Tensor.copy_}
_KEEP_PLAIN = {torch.Tensor.detach}


#: in-place writes whose names do not end in ``_``
_WRITES = {
    getattr(torch.Tensor, f"__{n}__")
    for n in ("setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow")
}


def written(func: Any, args: Any, kwargs: Any) -> Any:
    """The tensor ``func`` writes in place: the first argument of an in-place method or
    operator (``add_``, ``x[i] = v``, ``+=``), else its ``out=`` (None when it writes none)."""
    name = getattr(func, "__name__", "")
    if args and (func in _WRITES or (name.endswith("_") and name not in _NOT_WRITES)):
        return args[0]
    return kwargs.get("out")


#: methods named like in-place ones that change no value
_NOT_WRITES = {"requires_grad_", "share_memory_"}


def _adopt_written(func: Any, args: Any, kwargs: Any, t: Transport) -> None:
    """A value every rank holds written in place into a plain tensor (``out = torch.zeros(..);
    out[..., 0] = einsum over the cut dim``, torch-harmonics' SHT; ``buf.copy_(v)``,
    ``out=buf``) makes the plain tensor, and the tensor it is a view of, Replicated in place:
    they hold the same value on every rank now. Left plain, the write's gradient would be
    counted once per rank (a parameter downstream P times: silently wrong). A target that
    requires grad already holds a history of plain shares, which no in-place change can mark:
    refused."""
    name = getattr(func, "__name__", "")
    target = written(func, args, kwargs)
    if not _is_plain(target):
        return
    base = target._base
    for x in (target, base) if _is_plain(base) else (target,):
        if x.requires_grad and t.size > 1 and not t.whole:
            raise ConfigError(
                f"rank {t.rank}: {name or func}: a value every rank holds (Replicated) written "
                f"in place into a plain tensor of shape {tuple(x.shape)} that requires grad: "
                f"its gradient would be counted once per rank. Write into a tensor that does "
                f"not require grad (torch.zeros(...), as the serial code makes it) or build the "
                f"result out of place (torch.stack / torch.cat)"
            )
        x.__class__ = Replicated
        cast(Replicated, x)._t = t


def replicated(x: torch.Tensor, t: Transport) -> Replicated:
    """``x`` (the same on every rank of ``t``'s group) marked as Replicated (no copy, the
    autograd history kept)."""
    if isinstance(x, Replicated):
        return x
    out = x.as_subclass(Replicated)
    out._t = t
    return out


class _RankZeroGrad(torch.autograd.Function):
    """Identity forward; backward keeps the gradient on rank 0 of the group, zeros elsewhere:
    a plain tensor's share of a computation every rank repeats identically."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rank: int) -> torch.Tensor:
        ctx.rank = rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return (g if ctx.rank == 0 else torch.zeros_like(g)), None


def _share(a: Any, t: Transport) -> Any:
    plain = isinstance(a, torch.Tensor) and not isinstance(a, (Replicated, ShardedTensor))
    if plain and a.requires_grad and t.size > 1 and not t.whole:
        return _RankZeroGrad.apply(a, t.rank)
    return a


def shard(
    x: torch.Tensor,
    dim: int | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    spec: ShardSpec | Sequence[int] | BlockSpec | None = None,
) -> ShardedTensor:
    """This rank's band of the full tensor ``x`` (the same on every rank) as a ShardedTensor:
    cut along ``dim`` by ``spec`` (default: the manager's partition policy). No communication.
    When ``x`` requires grad the band stays attached to it (``x.grad`` then holds this rank's
    rows of the gradient); otherwise the band is a new leaf.

    ``dim=(lat, lon)`` gives this rank's latitude x longitude block on a grid that cuts the
    longitude (``spec`` a :class:`~mpidp.runtime.grid.BlockSpec`), and the band along ``lat``
    on bands (the grid ``(P, 1)``). ``dim`` None: ``-2`` on bands, ``(-2, -1)`` on blocks; an
    int on blocks is refused (a band of a grid is no block)."""
    if isinstance(x, ShardedTensor):
        raise ConfigError(f"rank {x.rank}: shard() of a ShardedTensor; use .redistribute()")
    m = manager if manager is not None else get_manager()
    whole = isinstance(x, Replicated)  # its gradient must come back whole: all-gathered
    if whole:
        x = x.as_subclass(torch.Tensor)  # a partial value sums itself here (PartialSum.as_subclass)
    if m._blocks and not bl.is_pair(dim) and dim is not None:
        raise blocks_refused(
            m, f"mpidp.shard(x, dim={dim}), a ShardedTensor of one cut dim (blocks: dim=(-2, -1)),"
        )
    if m._blocks:
        block, bs = bl.block_of(x, (-2, -1) if dim is None else dim, m, spec, whole)
        return ShardedTensor(block, bs.lat, bs.dims[0], m, grid=bs)
    band, s, d = pl.band_of(x, dim, m, spec, whole)
    return ShardedTensor(band, s, d, m)
