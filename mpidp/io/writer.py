"""Writing a field cut into latitude bands to one HDF5 file (or Zarr store) that xarray
opens, with no rank holding the full field.

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
    as_numpy,
    choose_method,
    consolidated,
    in_turns,
    parallel_hdf5_available,
    writes_zarr,
)
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec

__all__ = ["METHODS", "RolloutWriter", "parallel_hdf5_available", "write_sharded"]


def _rows_slab(ndim: int, dim: int, lo: int, hi: int) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) if i == dim else slice(None) for i in range(ndim))


def write_sharded(
    path: str | os.PathLike[str],
    name: str,
    x_local: torch.Tensor | np.ndarray,
    dim: int = -2,
    spec: ShardSpec | Sequence[int] | None = None,
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
    """Write the field whose band along ``dim`` this rank holds (``x_local``) as variable
    ``name`` of the HDF5/netCDF-4 file (or Zarr store) ``path``; returns the path.

    ``dims`` names the dimensions (default ``(..., "latitude", "longitude")``); ``coords``
    maps dimension names to global coordinate values (each becomes a coordinate variable);
    ``attrs`` become the variable's attributes. ``mode="w"`` replaces the file; ``mode="a"``
    adds (or replaces) a variable in an existing file, keeping its other contents. The
    partition is learned from the ranks' local sizes unless ``spec`` is given. ``method``:
    ``"auto"``, ``"mpio"`` or ``"ordered"`` (module docstring).

    ``format``: ``"auto"`` (a Zarr store when ``path`` ends in ``.zarr``, else netCDF-4),
    ``"netcdf"`` or ``"zarr"``. A Zarr store (format ``zarr_format``, 2 or 3) is chunked one
    step of the leading dimensions by ``chunk_rows`` rows (default: the tallest band) by the
    whole trailing ones; each rank writes the chunks that start in its band, after the rows of
    those chunks it does not hold came from its neighbours. ``xarray.open_zarr`` opens it.

    Collective over ``group`` (default: the domain group); atomic (a temporary file renamed on
    success). Bad arguments on any rank raise the same :class:`~mpidp.DataError` everywhere.
    """
    t = io_transport(manager, group)
    path = Path(path)
    x = as_numpy(x_local)
    problems: list[str] = []
    d = dim % x.ndim if x.ndim and -x.ndim <= dim < x.ndim else 0
    if not x.ndim or not -x.ndim <= dim < x.ndim:
        problems.append(f"dim {dim} is not a dimension of a tensor of shape {x.shape}")
    names = tuple(dims) if dims is not None else default_dims(x.ndim)
    if len(names) != x.ndim:
        problems.append(f"dims {list(names)} name {len(names)} dimensions, the tensor has {x.ndim}")
    if mode not in ("w", "a"):
        problems.append(f"mode={mode!r} is not 'w' (replace the file) or 'a' (add a variable)")
    zarr = writes_zarr(path, format, method, zarr_format, chunk_rows, problems)
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
    how = "zarr" if zarr else choose_method(method, t, problems)
    coords = dict(coords or {})
    facts = {
        "path": os.path.realpath(path),
        "name": name,
        "dim": d,
        "shape without dim": tuple(s for i, s in enumerate(x.shape) if i != d),
        "dtype": str(x.dtype),
        "dims": names,
        "coords": {k: (np.shape(v), digest(v)) for k, v in coords.items()},
        "attrs": repr(sorted((attrs or {}).items())),
        "mode": mode,
        "method": how,
        "spec": None if spec is None else list(spec),
        "chunk_rows": chunk_rows,
        "zarr_format": zarr_format,
    }
    table = check_everywhere(
        t,
        problems,
        facts,
        f"write_sharded({str(path)!r}, {name!r}) got bad or inconsistent arguments",
        "every rank passes the same path, name, dims, coords and mode, and its own band along dim",
        [x.shape[d] if x.ndim else 0, 0],
    )
    sizes = [row[0] for row in table]
    if spec is not None and list(spec) != sizes:
        wrong = [
            f"rank {r} holds {n} where spec gives it {want}"
            for r, (n, want) in enumerate(zip(sizes, list(spec), strict=False))
            if n != want
        ]
        raise DataError(
            f"rank {0 if t is None else t.rank}: write_sharded({str(path)!r}, {name!r}): the "
            f"ranks hold {sizes} rows along dim {d} but spec is {list(spec)} ({'; '.join(wrong)}); "
            "pass each rank's own band of the spec's grid"
        )
    shape = tuple(sum(sizes) if i == d else s for i, s in enumerate(x.shape))
    for k, v in coords.items():
        if k in names and np.asarray(v).shape != (shape[names.index(k)],):
            raise DataError(
                f"rank {0 if t is None else t.rank}: coordinate {k!r} has shape "
                f"{np.asarray(v).shape}, its dimension has {shape[names.index(k)]} entries; "
                f"pass one value per entry"
            )
    me = 0 if t is None else t.rank
    lo = sum(sizes[:me])
    tmp = temporary_name(path, shared_token(t))
    copied: BaseException | None = None
    if me == 0 and mode == "a":
        try:
            (zw.copy_store if zarr else shutil.copy2)(path, tmp)
        except OSError as err:  # a full disk: every rank learns of it, nothing is left
            copied = err
    agree_or_discard(t, tmp, path, copied, f"write_sharded({str(path)!r}, mode='a')")
    if zarr:
        rows = chunk_rows or max(1, *sizes)
        field = _ZarrField(tmp, name, x, d, shape, names, coords, attrs or {}, rows)
        error = field.write(t, sizes, "a" if mode == "a" else "w", zarr_format)
        commit(t, tmp, path, error, f"write_sharded({str(path)!r}, {name!r})")
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
        slab = _rows_slab(x.ndim, d, lo, lo + x.shape[d])

        def run() -> None:
            if how == "mpio":
                with ds.collective:
                    ds[slab] = x
            elif x.shape[d]:
                ds[slab] = x

        return run

    error = in_turns(t, how, tmp, create, prepare, x.nbytes)
    commit(t, tmp, path, error, f"write_sharded({str(path)!r}, {name!r})")
    return path


class _ZarrField:
    """One variable of :func:`write_sharded` written into the Zarr store ``tmp``."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        x: np.ndarray,
        dim: int,
        shape: tuple[int, ...],
        dims: tuple[str, ...],
        coords: Mapping[str, Any],
        attrs: Mapping[str, Any],
        rows: int,
    ) -> None:
        self.tmp, self.name, self.x, self.dim, self.shape = tmp, name, x, dim, shape
        self.dims, self.coords, self.attrs, self.rows = dims, coords, attrs, rows

    def create(self, mode: str, zarr_format: int) -> None:
        """The group, the coordinates it lacks and the (empty) variable: rank 0."""
        root = zw.open_group(self.tmp, mode, zarr_format)
        for k, n in zip(self.dims, self.shape, strict=True):
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
        chunks = tuple(
            self.rows if i == self.dim else 1 if i < self.dim else n
            for i, n in enumerate(self.shape)
        )
        zw.create_array(root, self.name, self.shape, self.x.dtype, self.dims, chunks, self.attrs)

    def write(
        self, t: Transport | None, sizes: Sequence[int], mode: str, zarr_format: int
    ) -> BaseException | None:
        """Create (rank 0), move the boundary rows to their chunk's owner, write every rank's
        chunks, consolidate (rank 0). Returns this rank's error. Collective."""
        moved, lo = zw.to_owners(self.x, self.dim, sizes, self.rows, t)

        def write() -> None:
            ensure_space(self.tmp, moved.nbytes)
            zw.write_rows(zw.open_rows(self.tmp, self.name), moved, self.dim, lo)

        error = zw.in_parallel(t, lambda: self.create(mode, zarr_format), write)
        return consolidated(t, self.tmp, error)
