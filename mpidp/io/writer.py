"""Writing a field cut into latitude bands, or latitude x longitude blocks, to one HDF5 file
(or Zarr store) that xarray opens, with no rank holding the full field.

The ranks' pieces are the blocks of the domain grid (``domain_parallel_size=(P_lat, P_lon)``):
each rank writes its rows x columns. Bands are the grid ``(P, 1)``: one code path.

A target whose name ends in ``.zarr`` (or ``format="zarr"``) is a Zarr store, which every
rank writes at once, chunk-aligned so that no two ranks write one chunk
(:mod:`mpidp.io.zarr_writer`). An HDF5 file has two write paths:

* ``"mpio"``: HDF5's MPI-IO driver, every rank writing its rows in one collective write. Needs
  an h5py built against MPI (``scripts/setup-phdf5.sh``); chosen by ``method="auto"`` when
  that h5py is present and MPI runs the job.
* ``"ordered"``: ranks take turns (a token passed by a barrier): rank 0 creates the file and
  its metadata and writes its rows, then rank 1 opens it and writes its rows, and so on. Works
  with any h5py; the default without parallel HDF5 (see docs/io.md for the measurements).

All of them write to a temporary name beside the target and rename it when every rank
succeeded; a failure on any rank removes the temporary file (or store) and leaves the previous
one untouched.
Outputs carry netCDF-4 dimension scales and coordinate variables (``latitude``,
``longitude``, ``time``, ...): ``xarray.open_dataset(path, engine="h5netcdf")`` opens them.

This module holds :func:`write_sharded`; the write paths it shares with a rollout are in
:mod:`mpidp.io.write_paths`, and :class:`~mpidp.io.rollout.RolloutWriter` (re-exported here)
in :mod:`mpidp.io.rollout`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from mpidp.comm import Transport
from mpidp.errors import DataError
from mpidp.io import zarr_writer as zw
from mpidp.io._common import (
    agree_or_discard,
    attach_dims,
    check_everywhere,
    commit,
    declare_dims,
    default_dims,
    describe_error,
    digest,
    ensure_space,
    io_transport,
    shared_token,
    temporary_name,
)
from mpidp.io.rollout import RolloutWriter
from mpidp.io.write_paths import (
    COORDINATE_ATTRS,
    METHODS,
    WriteGrid,
    as_numpy,
    choose_method,
    consolidated,
    content_digest,
    in_turns,
    parallel_hdf5_available,
    sharded_cut,
    writes_zarr,
)
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import Replicated, ShardedTensor

__all__ = ["METHODS", "RolloutWriter", "parallel_hdf5_available", "write_sharded"]


Dim = int | tuple[int, int]


def _rows_slab(ndim: int, cuts: Sequence[tuple[int | None, int, int]]) -> tuple[slice, ...]:
    """The index of a rank's rows (and columns) in the file: ``[lo, hi)`` along each
    ``(dim, lo, hi)`` of ``cuts`` (dim None: every entry)."""
    out = [slice(None)] * ndim
    for d, lo, hi in cuts:
        if d is not None:
            out[d] = slice(lo, hi)
    return tuple(out)


def _check_spec(
    spec: ShardSpec | Sequence[int] | BlockSpec, bs: BlockSpec, where: str, dim: int, rank: int
) -> None:
    """That the blocks the ranks hold are ``spec``'s (on bands: a partition of the rows)."""
    if isinstance(spec, BlockSpec):
        if (spec.lat.sizes, spec.lon.sizes) != (bs.lat.sizes, bs.lon.sizes):
            raise DataError(
                f"rank {rank}: {where}: the ranks hold the blocks {bs!r} but spec is {spec!r}; "
                "pass each rank its own block of the spec's grid"
            )
        return
    sizes = list(bs.lat.sizes)
    if bs.lon.parts > 1 or list(spec) != sizes:
        wrong = [
            f"rank {r} holds {n} where spec gives it {want}"
            for r, (n, want) in enumerate(zip(sizes, list(spec), strict=False))
            if n != want
        ]
        if bs.lon.parts > 1:
            wrong = [f"the ranks hold blocks of {bs.grid[0]} x {bs.grid[1]}: pass a BlockSpec"]
        raise DataError(
            f"rank {rank}: {where}: the ranks hold {sizes} rows along dim {dim} but spec is "
            f"{list(spec)} ({'; '.join(wrong)}); pass each rank's own band of the spec's grid"
        )


def _other_cut(dim: Dim | None, cut: tuple[int, ...], n: int) -> list[str]:
    """What is wrong with a ``dim`` passed beside a ShardedTensor cut along ``cut``."""
    pair = dim if isinstance(dim, (tuple, list)) else (dim,)
    given = [d % n if isinstance(d, int) and n else d for d in pair]
    if dim is None or all(a == b for a, b in zip(given, cut, strict=False)):
        return []
    return [f"dim={dim} but the ShardedTensor is cut along dims {cut}; leave dim out"]


def write_sharded(
    path: str | os.PathLike[str],
    name: str,
    x_local: torch.Tensor | np.ndarray,
    dim: Dim | None = None,
    spec: ShardSpec | Sequence[int] | BlockSpec | None = None,
    manager: DistributedManager | None = None,
    *,
    dims: Sequence[str] | None = None,
    coords: Mapping[str, Any] | None = None,
    attrs: Mapping[str, Any] | None = None,
    mode: str = "w",
    method: str = "auto",
    group: Any = None,
    format: str = "auto",
    chunk_rows: int | None = None,
    zarr_format: int = 3,
) -> Path:
    """Write the field whose block (band) this rank holds (``x_local``) as variable ``name``
    of the HDF5/netCDF-4 file (or Zarr store) ``path``; returns the path. ``x_local`` may be
    the ShardedTensor whose block (band) it is (a converted model's output): its cut gives
    ``dim``, ``spec`` and (without ``manager`` and ``group``) the manager.

    ``dim`` is the latitude dim (default -2), or a ``(latitude, longitude)`` pair. A plain
    tensor is this rank's own block: where no coordinate (nor ``spec``) gives the extent of an
    axis the ranks cut, ranks that all pass the same values there (each the whole field) are
    refused, since the file would hold it P times over. Over the domain group
    the ranks hold the blocks of the domain grid: when it cuts the longitude
    (``domain_parallel_size=(P_lat, P_lon)``, ``P_lon > 1``) the longitude dim is the second
    of ``dim``, else the one ``dims`` names ``longitude`` (or ``lon``); a variable without
    one is refused. On bands (``P_lon = 1``, or another ``group``: its ranks in a column)
    every rank holds every column. ``dims`` names the dimensions (default ``(...,
    "latitude", "longitude")``); ``coords`` maps dimension names to global coordinate values
    (each becomes a coordinate variable); ``attrs`` become the variable's attributes.
    ``mode="w"`` replaces the file; ``mode="a"`` adds (or replaces) a variable in an existing
    file, keeping its other contents. The blocks are learned from the ranks' local sizes
    (checked to tile the grid) unless ``spec`` is given (a row partition on bands, a
    :class:`~mpidp.runtime.grid.BlockSpec` on blocks). ``method``: ``"auto"``, ``"mpio"`` or
    ``"ordered"`` (module docstring).

    ``format``: ``"auto"`` (a Zarr store when ``path`` ends in ``.zarr``, else netCDF-4),
    ``"netcdf"`` or ``"zarr"``. A Zarr store (format ``zarr_format``, 2 or 3) is chunked one
    step of the leading dimensions by ``chunk_rows`` rows (default: the tallest band) by the
    widest block's columns (bands: every column) by the whole trailing ones; each rank writes
    the chunks that start in its block, after the entries of those chunks it does not hold
    came from its neighbours. ``xarray.open_zarr`` opens it.

    Collective over ``group`` (default: the domain group); atomic (a temporary file renamed on
    success). Bad arguments on any rank raise the same :class:`~mpidp.DataError` everywhere.
    """
    cut, held, problems = sharded_cut(x_local)
    if cut is not None and isinstance(x_local, ShardedTensor):  # its cut: dims, blocks, grid
        problems += _other_cut(dim, cut, x_local.dim())
        dim, spec = cut if len(cut) == 2 else cut[0], held if spec is None else spec
        manager = x_local.manager if manager is None and group is None else manager
    if isinstance(x_local, ShardedTensor):  # refused above unless cut: named on every rank
        x_local = x_local.to_local()
    elif isinstance(x_local, Replicated):
        x_local = x_local.as_subclass(torch.Tensor)
    t = io_transport(manager, group)
    grid = WriteGrid(manager, group, t)
    path = Path(path)
    x = as_numpy(x_local)
    names = tuple(dims) if dims is not None else default_dims(x.ndim)
    if len(names) != x.ndim:
        problems.append(f"dims {list(names)} name {len(names)} dimensions, the tensor has {x.ndim}")
    d, d_lon = grid.dims(x, -2 if dim is None else dim, names, problems)
    coords = dict(coords or {})
    known = (  # the extents a spec (a ShardedTensor's cut) or a coordinate gives
        spec is not None or names[d] in coords,
        isinstance(spec, BlockSpec) or d_lon is None or names[d_lon] in coords,
    )
    if mode not in ("w", "a"):
        problems.append(f"mode={mode!r} is not 'w' (replace the file) or 'a' (add a variable)")
    zarr = writes_zarr(path, format, method, zarr_format, chunk_rows, problems)
    _check_target(path, mode, zarr, problems)
    how = "zarr" if zarr else choose_method(method, t, problems)
    facts = {
        "path": os.path.realpath(path),
        "name": name,
        "dim": (d, d_lon),
        "grid": grid.shape,
        "shape without dim": tuple(s for i, s in enumerate(x.shape) if i not in (d, d_lon)),
        "dtype": str(x.dtype),
        "dims": names,
        "coords": {k: (np.shape(v), digest(v)) for k, v in coords.items()},
        "attrs": repr(sorted((attrs or {}).items())),
        "mode": mode,
        "method": how,
        "spec": repr(spec) if isinstance(spec, BlockSpec) else None if spec is None else list(spec),
        "chunk_rows": chunk_rows,
        "zarr_format": zarr_format,
    }
    where = f"write_sharded({str(path)!r}, {name!r})"
    table = check_everywhere(
        t,
        problems,
        facts,
        f"{where} got bad or inconsistent arguments",
        "every rank passes the same path, name, dims, coords and mode, and its own block",
        [
            x.shape[d] if x.ndim else 0,
            x.shape[d_lon] if d_lon is not None else 0,
            content_digest(x, grid.unsized(known)),
        ],
    )
    me = 0 if t is None else t.rank
    bs = grid.blocks(table, where, me)
    if spec is not None:
        _check_spec(spec, bs, where, d, me)
    grid.refuse_copies([row[2] for row in table], known, where, me)
    shape = tuple(
        bs.shape[0] if i == d else bs.shape[1] if i == d_lon else s for i, s in enumerate(x.shape)
    )
    for k, v in coords.items():
        if k in names and np.asarray(v).shape != (shape[names.index(k)],):
            raise DataError(
                f"rank {me}: coordinate {k!r} has shape {np.asarray(v).shape}, its dimension "
                f"has {shape[names.index(k)]} entries; pass one value per entry"
            )
    rows, cols = bs.block(me)
    tmp = temporary_name(path, shared_token(t))
    copied: BaseException | None = None
    if me == 0 and mode == "a":
        try:
            (zw.copy_store if zarr else shutil.copy2)(path, tmp)
        except OSError as err:  # a full disk: every rank learns of it, nothing is left
            copied = err
    agree_or_discard(t, tmp, path, copied, f"write_sharded({str(path)!r}, mode='a')")
    if zarr:
        chunks = (chunk_rows or max(1, *bs.lat.sizes), max(1, *bs.lon.sizes))
        field = _ZarrField(tmp, name, x, (d, d_lon), shape, names, coords, attrs or {}, chunks)
        error = field.write(t, grid, bs, "a" if mode == "a" else "w", zarr_format)
        commit(t, tmp, path, error, where)
        return path

    def create(f: h5py.File) -> None:
        scales = declare_dims(f, names, shape, coords)
        if name in f:
            del f[name]
        ds = f.create_dataset(name, shape=shape, dtype=x.dtype)
        attach_dims(ds, scales)
        for k, v in (attrs or {}).items():
            ds.attrs[k] = v

    def prepare(f: h5py.File) -> Callable[[], None]:
        ds = f[name]
        slab = _rows_slab(x.ndim, [(d, rows.start, rows.stop), (d_lon, cols.start, cols.stop)])

        def run() -> None:
            if how == "mpio":
                with ds.collective:
                    ds[slab] = x
            elif x.size:
                ds[slab] = x

        return run

    error = in_turns(t, how, tmp, create, prepare, x.nbytes)
    commit(t, tmp, path, error, where)
    return path


def _check_target(path: Path, mode: str, zarr: bool, problems: list[str]) -> None:
    """What keeps ``path`` from being written in ``mode`` goes to ``problems``."""
    if mode == "a" and not path.exists():
        problems.append(f"mode='a' but {path} does not exist")
    elif mode == "a" and zarr and not zw.is_store(path):
        problems.append(
            f"mode='a' but {path} is not a Zarr store: restore it, or write a new one with mode='w'"
        )
    elif mode == "a" and not zarr:
        try:
            h5py.File(path, "r").close()
        except OSError as err:
            problems.append(
                f"mode='a' but {path} is not a readable HDF5/netCDF-4 file "
                f"({describe_error(err)}): restore it, or write a new file with mode='w'"
            )
    if not path.parent.is_dir():
        problems.append(f"the folder {path.parent} does not exist")


class _ZarrField:
    """One variable of :func:`write_sharded` written into the Zarr store ``tmp``: chunks of
    ``chunks`` (rows, columns) along ``dims`` (latitude, longitude or None: every column)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        x: np.ndarray,
        dims: tuple[int, int | None],
        shape: tuple[int, ...],
        names: tuple[str, ...],
        coords: Mapping[str, Any],
        attrs: Mapping[str, Any],
        chunks: tuple[int, int],
    ) -> None:
        self.tmp, self.name, self.x, self.dims, self.shape = tmp, name, x, dims, shape
        self.names, self.coords, self.attrs, self.chunks = names, coords, attrs, chunks

    def create(self, mode: str, zarr_format: int) -> None:
        """The group, the coordinates it lacks and the (empty) variable: rank 0."""
        root = zw.open_group(self.tmp, mode, zarr_format)
        for k, n in zip(self.names, self.shape, strict=True):
            if k in root and k != self.name:
                if root[k].shape != (n,):
                    raise DataError(
                        f"dimension {k!r} already has {root[k].shape[0]} entries in the store, "
                        f"the new variable has {n}; use another dimension name or a new store"
                    )
            elif k in self.coords:
                values = np.asarray(self.coords[k])
                coord = zw.create_array(
                    root, k, (n,), values.dtype, (k,), (n,), COORDINATE_ATTRS.get(k, {})
                )
                coord[...] = values
        d, d_lon = self.dims
        chunks = tuple(
            self.chunks[0] if i == d else self.chunks[1] if i == d_lon else 1 if i < d else n
            for i, n in enumerate(self.shape)
        )
        zw.create_array(root, self.name, self.shape, self.x.dtype, self.names, chunks, self.attrs)

    def write(
        self, t: Transport | None, grid: WriteGrid, bs: BlockSpec, mode: str, zarr_format: int
    ) -> BaseException | None:
        """Create (rank 0), move the boundary entries to their chunk's owner (rows within the
        grid column, then columns within the grid row), write every rank's chunks,
        consolidate (rank 0). Returns this rank's error. Collective."""
        d, d_lon = self.dims
        moved, lo = zw.to_owners(self.x, d, bs.lat.sizes, self.chunks[0], grid.lat)
        c0 = 0
        if d_lon is not None:
            moved, c0 = zw.to_owners(moved, d_lon, bs.lon.sizes, self.chunks[1], grid.lon)

        def write() -> None:
            ensure_space(self.tmp, moved.nbytes)
            array = zw.open_rows(self.tmp, self.name)
            cols = None if d_lon is None else (d_lon, c0)
            zw.write_rows(array, moved, d, lo, (), cols)

        error = zw.in_parallel(t, lambda: self.create(mode, zarr_format), write)
        return consolidated(t, self.tmp, error)
