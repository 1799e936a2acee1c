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
"""

from __future__ import annotations

import errno
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
    discard,
    ensure_space,
    explain_os_error,
    io_transport,
    shared_token,
    temporary_name,
)
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec, balanced_sizes

__all__ = ["METHODS", "RolloutWriter", "parallel_hdf5_available", "write_sharded"]

METHODS = ("auto", "mpio", "ordered")

#: CF attributes of the coordinate variables a rollout writes (time: when it has units).
_COORDINATE_ATTRS = {
    "time": {"standard_name": "time", "long_name": "time"},
    "latitude": {"units": "degrees_north", "standard_name": "latitude", "long_name": "latitude"},
    "longitude": {
        "units": "degrees_east",
        "standard_name": "longitude",
        "long_name": "longitude",
    },
}


def parallel_hdf5_available() -> bool:
    """Whether this h5py was built with MPI (the ``mpio`` driver)."""
    return bool(h5py.get_config().mpi)


def _mpi_comm(t: Transport | None) -> Any:
    return getattr(t, "comm", None)


def _method(method: str, t: Transport | None, problems: list[str]) -> str:
    if method not in METHODS:
        problems.append(f"method={method!r} is not one of {', '.join(METHODS)}")
        return "ordered"
    mpio_ok = parallel_hdf5_available() and _mpi_comm(t) is not None
    if method == "mpio" and not mpio_ok:
        problems.append(
            "method='mpio' needs an h5py built with MPI (scripts/setup-phdf5.sh) and a job "
            "launched by MPI; use method='ordered'"
        )
    if method == "auto":
        return "mpio" if mpio_ok else "ordered"
    return method


def _format(
    path: Path,
    format: str,
    method: str,
    zarr_format: int,
    chunk_rows: int | None,
    problems: list[str],
) -> bool:
    """Whether ``path`` is written as a Zarr store; what is wrong with the Zarr options goes
    to ``problems``."""
    if format not in zw.FORMATS:
        problems.append(f"format={format!r} is not one of {', '.join(zw.FORMATS)}")
        return False
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        problems.append(f"chunk_rows={chunk_rows!r}: pass a whole number of rows, 1 or more")
    if not zw.is_zarr_target(path, format):
        return False
    from mpidp.io.zarr_reader import _zarr_problem

    missing = _zarr_problem()
    if missing:
        problems.append(f"writing the Zarr store {path}: {missing}")
    if method != "auto":
        problems.append(
            f"method={method!r} chooses how an HDF5 file is written; every rank writes a Zarr "
            f"store at once: leave method='auto'"
        )
    if zarr_format not in (2, 3):
        problems.append(f"zarr_format={zarr_format!r}: Zarr formats 2 and 3 are written")
    return True


def _rows_slab(ndim: int, dim: int, lo: int, hi: int) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) if i == dim else slice(None) for i in range(ndim))


def _as_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return np.ascontiguousarray(x.numpy())
    return np.ascontiguousarray(x)


def _in_turns(
    t: Transport | None,
    method: str,
    tmp: Path,
    create: Callable[[h5py.File], None],
    prepare: Callable[[h5py.File], Callable[[], None]],
    need: int,
) -> BaseException | None:
    """Run ``create`` (metadata: collective in mpio, rank 0 alone otherwise), then
    ``prepare`` (this rank's local part, which may fail) and the write it returns, on the
    temporary file. Returns this rank's error instead of raising, so that every rank reaches
    the agreement that follows. In mpio the ranks agree that every one prepared before any
    enters the collective write: a rank that failed alone would leave the others waiting.
    ``need``: the bytes this rank writes; a disk without that much room is an error before
    HDF5 touches the file (:func:`ensure_space`)."""
    if method == "mpio":
        error: BaseException | None = None
        try:
            ensure_space(tmp, need)
        except OSError as err:
            error = err
        if t is not None and not all(row[0] for row in t.all_gather_ints([error is None])):
            return error or OSError(errno.ENOSPC, "another rank's disk is full")
        try:
            with h5py.File(tmp, "a", driver="mpio", comm=_mpi_comm(t)) as f:
                create(f)
                try:
                    run = prepare(f)
                except Exception as err:
                    error, run = err, None
                ready = t is None or all(row[0] for row in t.all_gather_ints([error is None]))
                if ready and run is not None:
                    run()
        except Exception as err:
            error = error or err
        return error
    error = None
    size, me = (1, 0) if t is None else (t.size, t.rank)
    for turn in range(size):
        if turn == me:
            try:
                ensure_space(tmp, need)
                with h5py.File(tmp, "a") as f:
                    if me == 0:
                        create(f)
                    prepare(f)()
            except Exception as err:
                error = err
        if t is not None:
            t.barrier()  # the token: the next rank opens the file once this one closed it
    return error


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
    x = _as_numpy(x_local)
    problems: list[str] = []
    d = dim % x.ndim if x.ndim and -x.ndim <= dim < x.ndim else 0
    if not x.ndim or not -x.ndim <= dim < x.ndim:
        problems.append(f"dim {dim} is not a dimension of a tensor of shape {x.shape}")
    names = tuple(dims) if dims is not None else default_dims(x.ndim)
    if len(names) != x.ndim:
        problems.append(f"dims {list(names)} name {len(names)} dimensions, the tensor has {x.ndim}")
    if mode not in ("w", "a"):
        problems.append(f"mode={mode!r} is not 'w' (replace the file) or 'a' (add a variable)")
    zarr = _format(path, format, method, zarr_format, chunk_rows, problems)
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
    how = "zarr" if zarr else _method(method, t, problems)
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

    error = _in_turns(t, how, tmp, create, prepare, x.nbytes)
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
                    root, k, (n,), values.dtype, (k,), (n,), _COORDINATE_ATTRS.get(k, {})
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
        return _consolidated(t, self.tmp, error)


def _consolidated(t: Transport | None, tmp: Path, error: BaseException | None) -> Any:
    """``error``; on rank 0 without one, the store's metadata consolidated first (the
    metadata is complete once rank 0 created it: the other ranks write chunks only; the
    agreement that follows tells whether they failed)."""
    if error is None and (t is None or t.rank == 0):
        try:
            zw.consolidate(tmp)
        except Exception as err:
            return err
    return error


def _whose_band(sizes: Sequence[int], rows: int) -> str:
    """Which ranks' bands differ from a balanced split of ``rows`` (the usual partition), as a
    parenthesis; nothing when that split does not exist or every band differs."""
    if rows < len(sizes):
        return ""
    want = balanced_sizes(rows, len(sizes))
    off = [
        f"rank {r} holds {n} rows where a balanced split of {rows} gives it {k}"
        for r, (n, k) in enumerate(zip(sizes, want, strict=True))
        if n != k
    ]
    return f" ({'; '.join(off)})" if 0 < len(off) < len(sizes) else ""


class RolloutWriter:
    """A forecast written step by step: one variable per channel, shaped ``(time, latitude,
    longitude)``, grown by one time step per :meth:`write`; the file appears at ``path`` when
    the writer is closed (atomically), and is discarded if the rollout fails.

    ``channels`` are the variable names (e.g. the dataset's ``target_channels``);
    ``latitudes``/``longitudes`` the global coordinates; ``time_units`` the netCDF units of the
    times passed to :meth:`write` (default step numbers). ``attrs`` are written on every
    variable; ``variable_attrs`` maps a channel to its own attributes (CF ``units`` and
    ``long_name``: pass :attr:`ShardedH5Dataset.attributes <mpidp.io.ShardedH5Dataset>`, so
    the forecast carries the source data's). The coordinates carry their CF ``units``,
    ``standard_name`` and ``long_name``.

    A ``path`` ending in ``.zarr`` (or ``format="zarr"``) is written as a Zarr store (format
    ``zarr_format``), chunked one step by ``chunk_rows`` rows (default: the tallest band) by
    every longitude; every rank writes its chunks at once (the rows of a chunk that starts in
    another rank's band go to that rank first: no two ranks ever write one chunk), and
    ``xarray.open_zarr`` opens it. Use as a context manager::

        with RolloutWriter("forecast.nc", ["t2m", "z500"], lat, lon,
                           variable_attrs=dataset.attributes) as out:
            for step in range(n):
                x = model(x)
                out.write(x[0], time=6 * (step + 1))

    Collective over ``group`` (default: the domain group): every rank calls every method.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        channels: Sequence[str],
        latitudes: Any = None,
        longitudes: Any = None,
        manager: DistributedManager | None = None,
        *,
        time_units: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        variable_attrs: Mapping[str, Mapping[str, Any]] | None = None,
        dtype: Any = np.float32,
        method: str = "auto",
        group: Any = None,
        format: str = "auto",
        chunk_rows: int | None = None,
        zarr_format: int = 3,
    ) -> None:
        self.t = io_transport(manager, group)
        self.path = Path(path)
        self.channels = list(channels)
        problems: list[str] = []
        if not self.path.parent.is_dir():
            problems.append(f"the folder {self.path.parent} does not exist")
        if len(set(self.channels)) != len(self.channels) or "time" in self.channels:
            problems.append(f"channel names {self.channels} must be distinct and not 'time'")
        self.zarr = _format(self.path, format, method, zarr_format, chunk_rows, problems)
        self.method = "zarr" if self.zarr else _method(method, self.t, problems)
        self.chunk_rows, self.zarr_format = chunk_rows, zarr_format
        facts = {
            "path": os.path.realpath(self.path),
            "channels": self.channels,
            "method": self.method,
            "chunk_rows": chunk_rows,
            "zarr_format": zarr_format,
            "time_units": time_units,
            "variable_attrs": repr(
                sorted((c, sorted(dict(a).items())) for c, a in (variable_attrs or {}).items())
            ),
        }
        check_everywhere(
            self.t,
            problems,
            facts,
            f"RolloutWriter({str(self.path)!r}) got bad or inconsistent arguments",
            "pass the same arguments on every rank",
        )
        self.coords = {
            k: np.asarray(v)
            for k, v in (("latitude", latitudes), ("longitude", longitudes))
            if v is not None
        }
        self.time_units, self.attrs, self.dtype = time_units, dict(attrs or {}), np.dtype(dtype)
        self.variable_attrs = {c: dict((variable_attrs or {}).get(c, {})) for c in self.channels}
        self.tmp = temporary_name(self.path, shared_token(self.t))
        self.steps = 0
        self.sizes: list[int] | None = None
        self._closed = False

    def write(self, x_local: torch.Tensor | np.ndarray, time: float | None = None) -> None:
        """Append one time step: ``x_local`` is this rank's band, ``(channels, rows, lon)``
        (a leading batch dimension of 1 is accepted). Collective."""
        x = _as_numpy(x_local)
        if x.ndim == 4 and x.shape[0] == 1:
            x = x[0]
        problems = []
        if self._closed:
            problems.append("the writer is closed")
        if x.ndim != 3 or x.shape[0] != len(self.channels):
            problems.append(
                f"a step of shape {x.shape}; expected ({len(self.channels)} channels, rows, lon)"
            )
        facts = {
            "shape without rows": (x.shape[0], x.shape[-1]) if x.ndim == 3 else x.shape,
            "time": time,
            "step": self.steps,
        }
        table = check_everywhere(
            self.t,
            problems,
            facts,
            f"RolloutWriter({str(self.path)!r}).write, step {self.steps}",
            "every rank writes its own band of every channel at each step",
            [x.shape[1] if x.ndim == 3 else 0],
        )
        sizes = [row[0] for row in table]
        if self.sizes is None:
            self.sizes = sizes
        elif sizes != self.sizes:
            raise DataError(
                f"rank {0 if self.t is None else self.t.rank}: step {self.steps} has bands of "
                f"{sizes} rows, earlier steps {self.sizes}; keep the partition fixed"
            )
        h, w = sum(sizes), x.shape[-1]
        step = self.steps
        me = 0 if self.t is None else self.t.rank
        grid = tuple(
            len(self.coords[k]) if k in self.coords else n
            for k, n in (("latitude", h), ("longitude", w))
        )
        if grid != (h, w):
            raise DataError(
                f"rank {me}: RolloutWriter({str(self.path)!r}).write, step {step}: the ranks' "
                f"bands have {sizes} rows ({h} in all) of {w} longitudes, but the coordinates "
                f"give a {grid[0]} x {grid[1]} grid{_whose_band(sizes, grid[0])}; fix: pass "
                f"each rank its own band of that grid (manager.spec({grid[0]}).sizes gives "
                f"each rank's rows), or the coordinates of the grid the bands come from"
            )
        lo = sum(sizes[:me])
        if self.zarr:
            error = self._write_zarr(x, step, time, sizes, w)
        else:
            error = self._write_hdf5(x, step, time, sizes, lo, w)
        problem = [] if error is None else [explain_os_error(error, self.path)]
        try:
            check_everywhere(
                self.t,
                problem,
                {},
                f"writing step {step} of {self.path} failed",
                "see the rank's error; the previous file is untouched",
            )
        except DataError:
            self.abort()
            raise
        self.steps += 1

    def _write_hdf5(
        self, x: np.ndarray, step: int, time: float | None, sizes: list[int], lo: int, w: int
    ) -> BaseException | None:
        """Step ``step`` into the temporary HDF5 file, the ranks in turn (or collectively).
        Returns this rank's error."""
        h = sum(sizes)

        def create(f: h5py.File) -> None:
            if step == 0:
                coords = {**self.coords, "time": np.zeros(0)}
                scales = declare_dims(
                    f, ("time", "latitude", "longitude"), (0, h, w), coords, unlimited=("time",)
                )
                for k in self.coords:
                    f[k].attrs.update(_COORDINATE_ATTRS[k])
                f["time"].attrs.update(self._time_attrs())
                for c in self.channels:
                    ds = f.create_dataset(
                        c,
                        shape=(0, h, w),
                        maxshape=(None, h, w),
                        chunks=(1, max(1, max(sizes)), w),  # about one band per chunk
                        dtype=self.dtype,
                    )
                    attach_dims(ds, scales)
                    ds.attrs.update({**self.attrs, **self.variable_attrs[c]})
            f["time"].resize((step + 1,))
            f["time"][step] = step if time is None else time
            for c in self.channels:
                f[c].resize((step + 1, h, w))

        def prepare(f: h5py.File) -> Callable[[], None]:
            targets = [f[c] for c in self.channels]

            def run() -> None:
                for i, ds in enumerate(targets):
                    if self.method == "mpio":
                        with ds.collective:
                            ds[step, lo : lo + x.shape[1]] = x[i]
                    elif x.shape[1]:
                        ds[step, lo : lo + x.shape[1]] = x[i]

            return run

        return _in_turns(self.t, self.method, self.tmp, create, prepare, x.nbytes)

    def _write_zarr(
        self, x: np.ndarray, step: int, time: float | None, sizes: list[int], w: int
    ) -> BaseException | None:
        """Step ``step`` into the temporary Zarr store: rank 0 creates or grows the arrays,
        then every rank writes its chunks. Returns this rank's error. Collective."""
        h = sum(sizes)
        rows = self.chunk_rows or max(1, *sizes)
        dims = ("time", "latitude", "longitude")

        def create() -> None:
            root = zw.open_group(self.tmp, "w" if step == 0 else "a", self.zarr_format)
            if step == 0:
                for k, values in self.coords.items():
                    attrs = _COORDINATE_ATTRS[k]
                    coord = zw.create_array(
                        root, k, values.shape, values.dtype, (k,), values.shape, attrs
                    )
                    coord[...] = values
                when = self._time_attrs()
                zw.create_array(root, "time", (0,), np.float64, ("time",), (512,), when)
                for c in self.channels:
                    attrs = {**self.attrs, **self.variable_attrs[c]}
                    zw.create_array(root, c, (0, h, w), self.dtype, dims, (1, rows, w), attrs)
            root["time"].resize((step + 1,))
            root["time"][step] = step if time is None else time
            for c in self.channels:
                root[c].resize((step + 1, h, w))

        moved, lo = zw.to_owners(x.astype(self.dtype, copy=False), 1, sizes, rows, self.t)

        def write() -> None:
            ensure_space(self.tmp, moved.nbytes)
            for i, c in enumerate(self.channels):
                zw.write_rows(zw.open_rows(self.tmp, c), moved[i], 0, lo, (step,))

        return zw.in_parallel(self.t, create, write)

    def _time_attrs(self) -> dict[str, str]:
        """The time coordinate's attributes: CF ``units`` when given, else a step count."""
        if self.time_units:
            return {**_COORDINATE_ATTRS["time"], "units": self.time_units}
        return {"long_name": "forecast step"}

    def close(self) -> Path:
        """Publish the file (rename the temporary file to ``path``). Collective."""
        if self._closed:
            return self.path
        self._closed = True
        error = None if self.steps else DataError("no step was written")
        if self.zarr:
            error = _consolidated(self.t, self.tmp, error)
        commit(self.t, self.tmp, self.path, error, f"RolloutWriter({str(self.path)!r})")
        return self.path

    def abort(self) -> None:
        """Discard the temporary file; ``path`` keeps what it had. Local (no communication):
        any rank may call it, alone (an exception on one rank inside ``with``)."""
        self._closed = True
        discard(self.tmp)

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
