"""A halo exchange's arguments, checked on this rank and agreed across the group: the widths,
dim, dtype, boundary and partition of a call (:func:`_check`), kept by the call's key so that a
repeated call derives nothing again (:func:`_known_of`), and the agreement that turns a bad
argument on any rank into the same error on every rank (:func:`_agree`, :func:`_raise`). The
exchange itself is :mod:`mpidp.ops.halo_band`'s.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from mpidp.comm import Transport
from mpidp.comm.base import facts_checksum
from mpidp.errors import CommError
from mpidp.ops.halo_plan import Boundary
from mpidp.runtime.partition import ShardSpec

if TYPE_CHECKING:
    from mpidp.ops.halo_band import _Op

Widths = int | Sequence[int]


def _widths(w: Widths, p: int, what: str, problems: list[str]) -> tuple[int, ...]:
    try:
        return (operator.index(w),) * p  # type: ignore[arg-type]
    except TypeError:
        pass
    try:
        out = tuple(int(v) for v in w)  # type: ignore[union-attr]
    except TypeError:
        problems.append(f"{what}={w!r} is neither an int nor one int per rank")
        return (0,) * p
    if len(out) != p:
        problems.append(f"{what} has {len(out)} entries {list(out)}, expecting one per rank ({p})")
        return (0,) * p
    return out


def _local_problems(
    x: torch.Tensor, dim: int, spec: ShardSpec | None, b: Boundary, t: Transport
) -> tuple[list[str], int, int]:
    problems = []
    nd = x.dim()
    d = dim % nd if -nd <= dim < nd else None
    if d is None:
        problems.append(f"dim {dim} is out of range for shape {tuple(x.shape)}")
    if spec is not None and d is not None:
        if spec.parts != t.size:
            problems.append(f"spec {spec} has {spec.parts} shards for a group of {t.size} ranks")
        elif x.size(d) != spec.sizes[t.rank]:
            problems.append(
                f"tensor of shape {tuple(x.shape)} has {x.size(d)} rows along dim {d} but the "
                f"spec gives this rank {spec.sizes[t.rank]} ({spec})"
            )
    rd = b.roll_dim % nd if -nd <= b.roll_dim < nd else None
    if b.polar:
        if rd is None or rd == d:
            problems.append(
                f"polar boundary: roll_dim {b.roll_dim} must be a dim of shape {tuple(x.shape)} "
                f"other than the sharded dim {dim}"
            )
        elif x.size(rd) % 2:
            problems.append(
                f"polar boundary: the extent along roll_dim {rd} is {x.size(rd)}, odd; rows "
                f"across a pole are rolled by half the circle, which needs an even size"
            )
    return problems, (d if d is not None else 0), (rd if rd is not None else 0)


#: what every rank's call must share; "strips": only the rows the halo adds (halo_strips, and a
#: converted convolution with ``manager.overlap`` on) or the extended band
_FACTS = (
    "dim",
    "shape without dim",
    "dtype",
    "grad",
    "before",
    "after",
    "boundary",
    "spec",
    "strips",
)


def _agree(t: Transport, n: int, problems: list[str], facts: tuple[Any, ...]) -> list[int]:
    """Every rank's local size; raises one CommError on every rank when any rank found a
    problem or the ranks' shared arguments (``facts``) differ. One all-gather of 3 ints."""
    table, lines = t.agree(problems, dict(zip(_FACTS, facts, strict=True)), [n])
    if lines:
        _raise(t, lines)
    return [row[0] for row in table]


def _raise(t: Transport, lines: list[str]) -> NoReturn:
    raise CommError(
        f"rank {t.rank}: halo_exchange over {t.size} ranks got bad or inconsistent arguments:\n  "
        + "\n  ".join(lines)
        + "\nfix: every rank passes the same widths, dim, boundary and spec, and a tensor whose "
        "extent along dim is its own shard size (strips differ: set manager.overlap alike on "
        "every rank, or call halo_strips on every rank)"
    )


@dataclasses.dataclass
class _Known:
    """A call's checked arguments, kept by the call's key (:func:`_key`): what the next call
    with the same key would derive again, its agreement checksum, and its ops by partition."""

    facts: tuple[Any, ...]
    checksum: int  # what Transport.agree all-gathers for these facts (facts_checksum)
    d: int
    rd: int
    bw: tuple[int, ...]
    aw: tuple[int, ...]
    b: Boundary
    spec: ShardSpec | None
    ops: dict[tuple[int, ...], _Op] = dataclasses.field(default_factory=dict)
    #: the learned-partition path's neighbour exchange, prepared (mpidp.ops.halo_band._Near)
    near: Any = None
    #: that path's last agreement and what it gave: (agreed ints, partition, op, whether the
    #: neighbours' rows were the halo, their concatenation recipe or None)
    last: Any = None


def _hashable(w: Any) -> Any:
    return w if isinstance(w, (int, str, tuple, ShardSpec, Boundary)) or w is None else tuple(w)


def _key(
    x: torch.Tensor,
    before: Any,
    after: Any,
    dim: int,
    spec: Any,
    boundary: Any,
    grad: bool,
    roll_dim: int,
    strips: bool,
) -> tuple[Any, ...] | None:
    """What a call's checked facts depend on, or None when an argument is not a plain value
    (then the call derives everything afresh)."""
    key = (x.shape, x.dtype, grad, dim, before, after, spec, boundary, roll_dim, strips)
    try:
        hash(key)  # the common call: ints and strings, hashable as they are
        return key
    except TypeError:  # lists of widths, a (low, high) list of kinds
        pass
    try:
        key = (*key[:4], *(_hashable(v) for v in (before, after, spec, boundary)), *key[8:])
        hash(key)
    except TypeError:
        return None
    return key


def _check(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int,
    spec: Any,
    boundary: Any,
    roll_dim: int,
    t: Transport,
    grad: bool,
    strips: bool,
) -> tuple[_Known, list[str]]:
    """Every local check of a call's arguments, and its facts for the agreement."""
    if spec is not None and not isinstance(spec, ShardSpec):
        spec = ShardSpec.from_sizes(spec)
    b = Boundary.of(boundary, roll_dim)
    problems, d, rd = _local_problems(x, dim, spec, b, t)
    bw = _widths(before, t.size, "before", problems)
    aw = _widths(after, t.size, "after", problems)
    others = tuple(s for i, s in enumerate(x.shape) if i != d)
    facts = (d, others, x.dtype, grad, bw, aw, b, None if spec is None else spec.sizes, strips)
    checksum = facts_checksum(dict(zip(_FACTS, facts, strict=True)))
    return _Known(facts, checksum, d, rd, bw, aw, b, spec), problems


def _known_of(
    t: Transport,
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int,
    spec: ShardSpec | Sequence[int] | None,
    boundary: Any,
    roll_dim: int,
    strips: bool,
) -> tuple[_Known, list[str]]:
    """The call's checked arguments: kept by its key after the first call without problems."""
    grad = torch.is_grad_enabled() and x.requires_grad
    key = _key(x, before, after, dim, spec, boundary, grad, roll_dim, strips)
    cache: dict[Any, _Known] = t.__dict__.setdefault("_halo_known", {})
    k = cache.get(key) if key is not None else None
    if k is not None:
        return k, []
    k, problems = _check(x, before, after, dim, spec, boundary, roll_dim, t, grad, strips)
    if key is not None and not problems:
        if len(cache) > 1024:  # many distinct calls: start over
            cache.clear()
        cache[key] = k
    return k, problems
