"""The layout words a ShardedTensor is built from, below the tensor type itself: the manager
of a device mesh, the one placement of a 1-D domain mesh, ``torch.chunk``'s cut, the partition
``from_local`` is told or learns, the checks of a partition against the domain group, and one
cut dim of a layout (:class:`Cut`: a band has one, a latitude x longitude block two).

These need no ShardedTensor, so :mod:`mpidp.sharded.tensor` imports them and
:mod:`mpidp.sharded.placements` (which builds ShardedTensors) re-exports the public ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from mpidp.errors import ConfigError
from mpidp.ops.collectives import all_gather_v_replicated, reduce_from
from mpidp.ops.functions import _call, _Shard
from mpidp.runtime.adopt import axis_manager, manager_for, mesh_ndim
from mpidp.runtime.grid import AXES, BlockSpec, axis_transport, blocks_refused
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import PartitionPolicy, ShardSpec
from mpidp.sharded.rows import move_to_dim, to_spec

__all__ = [
    "Cut",
    "agree_parts",
    "band_of",
    "check_spec",
    "chunk_spec",
    "contiguous_strides",
    "manager_of",
    "normal_dim",
    "one_placement",
    "partial_sum_of",
    "spec_from_shapes",
    "spec_of_band",
]


class Cut(NamedTuple):
    """One cut dim of a layout: ``dim`` (non-negative) holds ``blocks`` blocks of ``spec``'s
    global rows, of which this rank holds part ``own`` of each; or, with ``tokens`` (a
    :class:`~mpidp.sharded.block_layout.TokenSpec`), domain rank ``own``'s tokens of a block,
    ``spec`` every rank's count."""

    dim: int
    spec: ShardSpec
    own: int
    blocks: int
    tokens: Any = None

    @property
    def total(self) -> int:
        """The global length along :attr:`dim`."""
        return self.blocks * self.spec.total

    def part(self, t: torch.Tensor, at: int) -> torch.Tensor:
        """This rank's entries of ``t`` along its dim ``at``, which runs along this cut (the
        global length there): the rows this rank holds, of every block (its tokens)."""
        if self.tokens is not None:
            return self.tokens.part(t, at, self.own)
        start, size = self.spec.start(self.own), self.spec.sizes[self.own]
        if self.blocks == 1:
            return t.narrow(at, start, size)
        blocks = t.unflatten(at, (self.blocks, self.spec.total))
        return blocks.narrow(at + 1, start, size).flatten(at, at + 1)


def band_of(
    x: torch.Tensor, dim: Any, m: DistributedManager, spec: Any, whole: bool
) -> tuple[torch.Tensor, ShardSpec, int]:
    """This rank's band of the full tensor ``x`` along ``dim`` (a pair: its latitude, bands
    being the grid (P, 1)), its partition (``spec`` default: the manager's policy) and the
    dim: :func:`mpidp.shard`'s band. No communication. A ``whole`` (Replicated) ``x`` gets its
    whole gradient back; a plain one that requires grad keeps the band attached, else a new
    leaf."""
    if isinstance(dim, Sequence):
        dim = dim[0]
    d = normal_dim(x, -2 if dim is None else cast(int, dim))
    n = x.size(d)
    if spec is None:
        s = m.partition.spec(n, m.domain_world_size)
    elif isinstance(spec, BlockSpec):
        s = spec.lat
    else:
        s = spec if isinstance(spec, ShardSpec) else ShardSpec(tuple(spec))
    check_spec(s, m, None, "shard")
    if s.total != n:
        raise ConfigError(
            f"rank {m.rank}: shard: spec {list(s.sizes)} covers {s.total} rows, the tensor has "
            f"{n} along dim {d} (shape {tuple(x.shape)}); pass a spec that adds up to {n}"
        )
    if whole:
        return _call(_Shard, x, m.transport(None, x.device), list(s.sizes), d), s, d
    band = x.narrow(d, s.start(m.domain_rank), s.sizes[m.domain_rank])
    band = band if x.requires_grad else band.clone(memory_format=torch.contiguous_format)
    return band, s, d


def manager_of(
    device_mesh: Any, manager: DistributedManager | None = None, gradients: str | None = None
) -> DistributedManager:
    """The manager whose domain group ``device_mesh`` (a 1-D DeviceMesh, or a process group)
    is, adopted when mpidp did not build it (:func:`mpidp.runtime.adopt.manager_for`); None:
    ``manager`` or the default one."""
    return manager_for(manager if device_mesh is None else device_mesh, gradients=gradients)


def one_placement(placements: Sequence[Placement] | None, what: str, rank: int) -> Placement:
    """The one placement of a 1-D domain mesh."""
    if placements is None or len(placements) != 1:
        raise ConfigError(
            f"rank {rank}: {what}: placements={placements!r}; a ShardedTensor lives on the "
            f"1-D domain mesh: pass one placement, e.g. [Shard(2)] or [Replicate()]"
        )
    p = placements[0]
    if not isinstance(p, (Shard, Replicate, Partial)):
        raise ConfigError(f"rank {rank}: {what}: unknown placement {p!r}")
    return p


def partial_sum_of(local: torch.Tensor, p: Partial, m: DistributedManager) -> torch.Tensor:
    """The value whose summands the ranks hold (``Partial("sum")`` or ``"avg"``), on every
    rank: one all-reduce now (gradient: the value's, whole, to every summand). Collective
    over the domain group."""
    t = m.transport(None, local.device)
    op = getattr(p, "reduce_op", "sum")
    if op not in ("sum", "avg"):
        raise ConfigError(f"rank {m.rank}: Partial({op!r}): only sum and avg partials reduce")
    whole = reduce_from(local, t)
    return whole / t.size if op == "avg" else whole


def chunk_spec(n: int, parts: int) -> ShardSpec:
    """``torch.chunk``'s (and DTensor's) cut of ``n`` rows: ``ceil(n / parts)`` each, the
    remainder on the last non-empty rank, empty ranks after it."""
    size = -(-n // parts) if n else 0
    return ShardSpec(tuple(max(0, min(size, n - i * size)) for i in range(parts)))


def spec_of_band(
    sharding_shapes: Any, d: int, local: torch.Tensor, m: DistributedManager, global_shape: Any
) -> ShardSpec:
    """The partition of the bands ``local`` along ``d`` that ``from_local`` is told, or learns
    (:func:`spec_from_shapes`). Collective when it learns (one small all-gather)."""
    spec = spec_from_shapes(sharding_shapes, d, m, global_shape)
    if spec is not None:
        return spec
    t = m.transport(None, local.device)
    spec = ShardSpec(tuple(row[0] for row in t.all_gather_ints([local.size(d)])))
    if sharding_shapes == "chunk" and spec != chunk_spec(spec.total, spec.parts):
        raise ConfigError(
            f"rank {m.rank}: from_local(sharding_shapes='chunk'): the parts are "
            f"{list(spec.sizes)}, not torch.chunk's cut of {spec.total}; use 'infer'"
        )
    return spec


def spec_from_shapes(
    sharding_shapes: Any, d: int, m: DistributedManager, global_shape: Any
) -> ShardSpec | None:
    """The partition ``from_local`` is told (``"chunk"`` with ``global_shape``, or ShardTensor's
    ``{mesh_dim: [shape per rank]}``); None: learn it (``"infer"``, or ``"chunk"`` without a
    global shape, which is then checked to be torch.chunk's cut)."""
    if isinstance(sharding_shapes, dict):
        shapes = sharding_shapes.get(0)
        if shapes is None or len(shapes) != m.domain_world_size:
            raise ConfigError(
                f"rank {m.rank}: from_local: sharding_shapes={sharding_shapes!r}; pass "
                f"{{0: [shape of each of the {m.domain_world_size} ranks' parts]}}"
            )
        return ShardSpec(tuple(int(s[d]) for s in shapes))
    if sharding_shapes == "chunk" and global_shape is not None:
        return chunk_spec(int(global_shape[d]), m.domain_world_size)
    if sharding_shapes not in ("infer", "chunk"):
        raise ConfigError(
            f"rank {m.rank}: from_local: sharding_shapes={sharding_shapes!r}; pass 'infer', "
            f"'chunk' or a dict of shapes"
        )
    return None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def normal_dim(x: torch.Tensor, dim: int) -> int:
    """``dim`` of ``x`` counted from 0."""
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ConfigError(f"dim {dim} is out of range for a {x.dim()}-d tensor {tuple(x.shape)}")
    return dim % x.dim()


def check_spec(
    spec: ShardSpec,
    m: DistributedManager,
    rows: int | None,
    what: str,
    local: torch.Tensor | None = None,
) -> None:
    """``spec`` has one part per domain rank and, given ``rows``, this rank's part is that
    long. With ``local`` (a rank's own band: its rows, and a spec passed to each rank, can
    differ by rank) the ranks agree first, as on blocks (:func:`agree_parts`: bands are the
    grid (P, 1)); collective then."""
    problems = []
    if spec.parts != m.domain_world_size:
        problems.append(
            f"spec {list(spec.sizes)} has {spec.parts} parts but the domain group has "
            f"{m.domain_world_size} ranks; pass one size per rank"
        )
    elif rows is not None and spec.sizes[m.domain_rank] != rows:
        me, sizes = m.domain_rank, list(spec.sizes)
        lo = sum(sizes[:me])
        problems.append(
            f"the band has {rows} rows but spec {sizes} ({sum(sizes)} rows) gives domain rank "
            f"{me} {sizes[me]}; fix: pass this rank rows {lo}..{lo + sizes[me] - 1} of the "
            f"field (its band of that spec), or the spec of the partition this band belongs "
            f"to, or none (then it is learned from the bands)"
        )
    fix = "pass each rank its band of one spec (the same sizes on every rank), or none"
    agree_parts(m, what, problems, {"bands": list(spec.sizes)}, local, fix)


def agree_parts(
    m: DistributedManager,
    what: str,
    problems: list[str],
    facts: dict[str, Any],
    local: torch.Tensor | None,
    fix: str,
) -> None:
    """Raise this rank's first problem with the layout of its part (bands or blocks) or, given
    ``local`` (the rank's own part, whose shape and layout can differ by rank), what any rank
    found or passed otherwise: the ranks agree first (:meth:`~mpidp.comm.Transport.agree`: one
    all-gather of two ints over the domain group, collective), so one rank's bad part raises
    the same ConfigError, naming it, on every rank instead of leaving the others waiting in
    their next collective. ``facts`` (``{"bands": sizes}``, ``{"blocks": ...}``) must be the
    same everywhere; ``fix`` ends the message."""
    if local is None or m.domain_world_size == 1:  # from arguments: the same everywhere
        if problems:
            raise ConfigError(f"rank {m.rank}: {what}: {problems[0]}")
        return
    _, lines = m.transport(None, local.device).agree(problems, facts)
    if lines:
        kind = next(iter(facts))
        raise ConfigError(
            f"rank {m.rank}: {what}: the ranks' {kind} do not tile the {m.grid[0]} x "
            f"{m.grid[1]} grid:\n  " + "\n  ".join(lines) + f"\nfix: {fix}"
        )


def to_dtensor(x: Any) -> Any:
    """A ShardedTensor band as a DTensor ``Shard(shard_dim)`` on the manager's domain mesh.
    DTensor cuts a dim as ``torch.chunk`` does (``ceil(n / P)`` rows per rank, the last ranks
    short or empty) and its uneven ``from_local`` is not reliable, so the rows first move to
    exactly that cut (only boundary rows travel; a block is refused there); differentiable.
    Collective."""
    from torch.distributed.tensor import DTensor

    n, p = x.spec.total, x.spec.parts
    moved = x.redistribute(spec=chunk_spec(n, p))
    return DTensor.from_local(
        moved.local,
        x.manager.domain_mesh,
        [Shard(x.shard_dim)],
        run_check=False,
        shape=x.shape,
        stride=contiguous_strides(tuple(x.shape)),
    )


def _on_mesh2d(x: Any, device_mesh: Any, placements: tuple[Any, ...]) -> Any:
    """A tensor on its 2-D mesh in DTensor's ``placements`` there. A block: ``(Shard(h),
    Shard(w))`` itself; ``(Shard(h), Replicate())`` the band along ``h`` over mesh dim 0's
    group, the columns all-gathered along the longitude row; ``(Replicate(), Shard(w))`` the
    converse; ``(Replicate(), Replicate())`` the whole tensor. Every rank of the gathering
    axis then holds the same band and computes the same from it (the replicated downstream:
    the backward hands each rank its own block's gradient once). A band (the mesh ``(P, 1)``)
    is the block whose columns one rank holds. Collective along the gathering axis."""
    m, ndim = x._manager, x._local.dim()
    if device_mesh is not None:
        other = manager_of(device_mesh, gradients=m.gradients)  # (m itself, when it is m's)
        if (other.domain_ranks, other.grid) != (m.domain_ranks, m.grid):
            raise ConfigError(
                f"rank {x.rank}: redistribute to another mesh: a ShardedTensor stays on its "
                f"mesh; pass device_mesh=None or x.device_mesh"
            )
    want = tuple(p.dim % ndim if isinstance(p, Shard) else p for p in placements)
    g = x._grid
    if want == (Replicate(), Replicate()):
        return x.full_tensor()
    if g is None and len(want) == 2 and want[0] == Replicate() and isinstance(want[1], int):
        g = BlockSpec(x._spec, ShardSpec((x._local.size(want[1]),)), (x._dim, want[1]))
    dims = g.dims if g is not None else (x._dim, None)
    if len(want) == 2 and want[0] == dims[0] and want[1] != dims[0]:
        if g is None or want[1] == g.dims[1]:
            return x
    for k, axis in enumerate(AXES):
        if g is not None and want == tuple(
            Replicate() if j == k else d for j, d in enumerate(dims)
        ):
            cut, kept = (g.lat, g.lon), 1 - k
            t = axis_transport(m, axis, x._local.device)
            band = all_gather_v_replicated(x._local, cut[k], g.dims[k], group=t)
            return type(x)(band, cut[kept], g.dims[kept], axis_manager(m, kept))
    raise ConfigError(
        f"rank {x.rank}: redistribute of a tensor cut along dims {dims} on a 2-D mesh "
        f"{m.grid} to {placements}: it goes to (Shard({dims[0]}), Shard(w)), "
        f"(Shard({dims[0]}), Replicate()), (Replicate(), Shard(w)) or (Replicate(), "
        f"Replicate()), w its longitude dim; pass one of those"
    )


def _back_on_mesh2d(x: Any, device_mesh: Any, placements: Any) -> Any:
    """A band along one dim of a 2-D mesh (as :func:`_on_mesh2d` leaves it) in ``placements``
    on that mesh: to the blocks, each rank keeps its part of the dim the other mesh dim cuts,
    by the mesh's partition (no communication; the backward all-gathers along that axis, the
    band's ranks holding it alike); ``Replicate()`` on the band's dim: the whole tensor; the
    band itself where its dim stays cut and the other is replicated. None when ``x`` is no
    band of ``device_mesh``'s axes. Local."""
    if device_mesh is None or placements is None or len(placements) != 2:
        return None
    target = manager_of(device_mesh, gradients=x._manager.gradients)
    if mesh_ndim(target) != 2:
        return None
    ks = [k for k in (0, 1) if axis_manager(target, k) is x._manager]
    if not ks:
        return None
    ndim = x._local.dim()
    want = [p.dim % ndim if isinstance(p, Shard) else p for p in placements]
    k = next((k for k in ks if want[k] == x._dim), ks[0])  # both, on a mesh of one rank
    other = 1 - k
    if want[k] == Replicate() and want[other] in (Replicate(), x._dim):
        return x.full_tensor()
    if want[k] == x._dim and want[other] == Replicate():
        return x
    w = want[other]
    if want[k] != x._dim or not isinstance(w, int) or w == x._dim or (w < x._dim) == (k == 0):
        raise ConfigError(
            f"rank {x.rank}: redistribute of a band along dim {x._dim} of mesh dim {k} to "
            f"{placements}: it goes to the blocks (Shard(h), Shard(w)) with h < w (mesh dim 0 "
            f"cuts the rows), keeps Shard({x._dim}) on mesh dim {k}, or to Replicate(); pass "
            f"one of those"
        )
    cut = target.partition.spec(x._local.size(w), target.grid[other])
    t = axis_transport(target, AXES[other], x._local.device)
    local = _call(_Shard, x._local, t, list(cut.sizes), w)
    lat, lon = (x._spec, cut) if k == 0 else (cut, x._spec)
    bs = BlockSpec(lat, lon, (x._dim, w) if k == 0 else (w, x._dim))
    return type(x)(local, lat, bs.dims[0], target, grid=bs if target._blocks else None)


def dtensor_dim(dt: Any, m: DistributedManager) -> tuple[int, int]:
    """The sharded dim of a DTensor ``Shard(d)`` on a 1-D mesh and its global length."""
    placements = tuple(dt.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard):
        raise ConfigError(
            f"rank {m.rank}: from_dtensor needs one Shard(dim) placement on a 1-D mesh; got "
            f"{placements}: redistribute the DTensor to Shard(dim) first"
        )
    d = placements[0].dim % dt.dim()
    return d, int(dt.shape[d])


def redistribute(x: Any, device_mesh: Any, placements: Any, spec: Any, dim: int | None) -> Any:
    """The body of :meth:`mpidp.ShardedTensor.redistribute` (its docstring says what it does).
    Collective."""
    g = x._grid
    if isinstance(g, BlockSpec) and g.merged:  # (the ranks' grids are one: refused on all)
        raise ConfigError(
            f"rank {x.rank}: redistribute of a block whose cuts hold merged blocks ({g!r}): "
            f"each rank holds a strided part of those dims; fix: .full_tensor(), or reshape "
            f"the merged blocks out of the cut dims (window_reverse) first"
        )
    if mesh_ndim(x._manager) == 2 and placements is not None and spec is dim is None:
        return _on_mesh2d(x, device_mesh, tuple(placements))
    if x._grid is not None:
        raise blocks_refused(x._manager, "redistribute of a block ShardedTensor")
    back = _back_on_mesh2d(x, device_mesh, placements)
    if back is not None:
        return back
    if device_mesh is not None and manager_of(device_mesh).domain_ranks != x._manager.domain_ranks:
        raise ConfigError(
            f"rank {x.rank}: redistribute to another mesh: a ShardedTensor stays on its "
            f"manager's domain mesh; pass device_mesh=None or x.device_mesh"
        )
    if isinstance(device_mesh, (ShardSpec, PartitionPolicy)):
        raise ConfigError(f"rank {x.rank}: redistribute(spec): pass it as spec=")
    if placements is not None:
        p = one_placement(placements, "redistribute", x.rank)
        if isinstance(p, Replicate):
            return x.full_tensor()
        if isinstance(p, Partial):
            raise ConfigError(
                f"rank {x.rank}: redistribute to Partial: a band is a value, not a "
                f"summand; reduce it (x.sum(dim)) or keep Shard/Replicate"
            )
        dim = cast(Any, p).dim
        spec = x._manager.partition if spec is None else spec
    if dim is not None and normal_dim(x._local, dim) != x._dim:
        x = move_to_dim(x, normal_dim(x._local, dim))
    if spec is None:
        return x
    n, p_ = x.spec.total, x.spec.parts
    if isinstance(spec, PartitionPolicy):
        target = spec.spec(n, p_)
    else:
        target = spec if isinstance(spec, ShardSpec) else ShardSpec(tuple(spec))
    if target.total != n or target.parts != p_:
        raise ConfigError(
            f"rank {x.rank}: redistribute to {list(target.sizes)}: the tensor has {n} rows "
            f"along dim {x.shard_dim} over {p_} ranks; pass sizes that add up to {n}"
        )
    return x if target == x.spec else to_spec(x, target)
