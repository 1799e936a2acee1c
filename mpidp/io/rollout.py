"""RolloutWriter: a forecast written step by step to one HDF5 file (or Zarr store) that
xarray opens, one variable per channel, grown by a time step per write, with no rank holding
the full field; the file appears atomically when the writer is closed."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from mpidp.errors import DataError
from mpidp.io import zarr_writer as zw
from mpidp.io._common import (
    attach_dims,
    check_everywhere,
    commit,
    declare_dims,
    discard,
    ensure_space,
    explain_os_error,
    io_transport,
    shared_token,
    temporary_name,
)
from mpidp.io.write_paths import (
    COORDINATE_ATTRS,
    WriteGrid,
    as_numpy,
    choose_method,
    consolidated,
    content_digest,
    in_turns,
    sharded_cut,
    whose_band,
    writes_zarr,
)
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.manager import DistributedManager
from mpidp.sharded import ShardedTensor

__all__ = ["RolloutWriter"]


def _cut_problems(x: Any) -> tuple[tuple[int, int] | None, list[str]]:
    """The global ``(rows, columns)`` of a ShardedTensor step (None for a plain one: its
    extent is learned from the ranks' parts) and what keeps ``x`` from being a rank's block or
    band of a step (:func:`~mpidp.io.write_paths.sharded_cut`), or cut along other dims than
    its last two (blocks) or its rows (a band)."""
    cut, _, problems = sharded_cut(x)
    if cut is None:
        return None, problems
    n = x.dim()
    if cut not in ((n - 2, n - 1), (n - 2,)):
        return None, [
            f"a ShardedTensor cut along dims {cut} of {n}: a step is cut along its rows "
            f"(bands) or its last two dims (blocks); pass a field so cut"
        ]  # fmt: skip
    return (x.shape[-2], x.shape[-1]), []


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

    Each rank writes its own block of the domain grid (``domain_parallel_size=(P_lat,
    P_lon)``): its rows x columns of every channel; on bands (``P_lon = 1``, or another
    ``group``: its ranks in a column) its rows of every longitude. The ranks' blocks are
    learned at each step from their sizes and checked to tile the grid, whose size the
    coordinates give, else a ShardedTensor step's shape; a first plain step without them is
    refused when the ranks of each latitude column (longitude row) pass the same values: each
    passed the whole field, which the file would hold P times over.

    A ``path`` ending in ``.zarr`` (or ``format="zarr"``) is written as a Zarr store (format
    ``zarr_format``), chunked one step by ``chunk_rows`` rows (default: the first step's
    tallest block) by the first step's widest block's columns (bands: every longitude); every
    rank writes its chunks at once (the entries of a chunk that starts in another rank's block
    go to that rank first: no two ranks ever write one chunk), and ``xarray.open_zarr`` opens
    it. Use as a context manager::

        with RolloutWriter("forecast.nc", ["t2m", "z500"], lat, lon,
                           variable_attrs=dataset.attributes) as out:
            for step in range(n):
                x = model(x)
                out.write(x[0], time=6 * (step + 1))

    The partition may change between steps (``manager.set_partition``, rebalancing): each
    step is written with the blocks it is given (the file's chunks stay as they were made);
    move the rollout's state to the new cut with :func:`mpidp.repartition`, which sends only
    the rows that change owner.

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
        self.grid = WriteGrid(manager, group, self.t)
        self.path = Path(path)
        self.channels = list(channels)
        problems: list[str] = []
        if not self.path.parent.is_dir():
            problems.append(f"the folder {self.path.parent} does not exist")
        if len(set(self.channels)) != len(self.channels) or "time" in self.channels:
            problems.append(f"channel names {self.channels} must be distinct and not 'time'")
        self.zarr = writes_zarr(self.path, format, method, zarr_format, chunk_rows, problems)
        self.method = "zarr" if self.zarr else choose_method(method, self.t, problems)
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
        self.blocks: BlockSpec | None = None
        self.chunks: tuple[int, int] | None = None
        self._closed = False

    def write(self, x_local: torch.Tensor | np.ndarray, time: float | None = None) -> None:
        """Append one time step: ``x_local`` is this rank's block, ``(channels, rows,
        columns)`` (on bands every column; a leading batch dimension of 1 is accepted), or
        the ShardedTensor whose block (band) it is: a converted model's output. Collective."""
        grid, problems = _cut_problems(x_local)
        if isinstance(x_local, ShardedTensor):
            x_local = x_local.to_local()
        x = as_numpy(x_local)
        if x.ndim == 4 and x.shape[0] == 1:
            x = x[0]
        if self._closed:
            problems.append("the writer is closed")
        if x.ndim != 3 or x.shape[0] != len(self.channels):
            problems.append(
                f"a step of shape {x.shape}; expected ({len(self.channels)} channels, rows, "
                f"columns)"
            )
        facts = {"channels": x.shape[0] if x.ndim == 3 else x.shape, "time": time}
        step, me = self.steps, 0 if self.t is None else self.t.rank
        where = f"RolloutWriter({str(self.path)!r}).write, step {step}"
        # a plain step on a grid nothing sizes yet (no coordinates, no earlier step): its
        # digest finds ranks that each passed the whole field
        known = (
            grid is not None or "latitude" in self.coords,
            grid is not None or "longitude" in self.coords,
        )
        copies = self.blocks is None and self.grid.unsized(known) and x.ndim == 3
        table = check_everywhere(
            self.t,
            problems,
            facts,
            where,
            "every rank writes its own block (band) of every channel at each step",
            [*x.shape[1:], content_digest(x, copies)] if x.ndim == 3 else [0, 0, -1],
        )
        bs = self.grid.blocks(table, where, me)
        self.grid.refuse_copies([row[2] for row in table], known, where, me)
        self._check_grid(bs, step, me, grid)
        self.blocks = bs  # a new cut of the same grid (manager.set_partition) is written as is
        if self.zarr:
            error = self._write_zarr(x, step, time, bs)
        else:
            error = self._write_hdf5(x, step, time, bs, bs.block(me))
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

    def _check_grid(
        self, bs: BlockSpec, step: int, me: int, known: tuple[int, int] | None = None
    ) -> None:
        """That the blocks ``bs`` of step ``step`` tile the grid of the coordinates (else the
        ``known`` grid of a ShardedTensor step) and of the earlier steps (the same
        :class:`~mpidp.DataError` on every rank: ``bs`` is agreed)."""
        (h, w), bands = bs.shape, bs.lon.parts == 1
        lat, lon = list(bs.lat.sizes), list(bs.lon.sizes)
        kind = "bands" if bands else "blocks"
        if self.blocks is not None and bs.shape != self.blocks.shape:
            before = self.blocks.shape
            raise DataError(
                f"rank {me}: step {step} has {kind} of {lat} rows ({h} in all) by {lon} "
                f"columns ({w}), earlier steps a {before[0]} x {before[1]} grid; fix: write "
                f"{kind} of the same grid at every step"
            )
        grid = tuple(
            len(self.coords[k]) if k in self.coords else n if known is None else known[i]
            for i, (k, n) in enumerate((("latitude", h), ("longitude", w)))
        )
        if grid == (h, w):
            return
        if bands:
            held = f"bands have {lat} rows ({h} in all) of {w} longitudes"
            which = whose_band(lat, grid[0])
            fix = f"band of that grid (manager.spec({grid[0]}).sizes gives each rank's rows)"
        else:
            held, which = f"blocks have {lat} rows ({h} in all) by {lon} columns ({w})", ""
            fix = (
                f"block of that grid (manager.block_spec(({grid[0]}, {grid[1]})) gives each "
                f"rank's rows and columns)"
            )
        raise DataError(
            f"rank {me}: RolloutWriter({str(self.path)!r}).write, step {step}: the ranks' "
            f"{held}, but the coordinates give a {grid[0]} x {grid[1]} grid{which}; fix: pass "
            f"each rank its own {fix}, or the coordinates of the grid the {kind} come from"
        )

    def _write_hdf5(
        self,
        x: np.ndarray,
        step: int,
        time: float | None,
        bs: BlockSpec,
        block: tuple[slice, slice],
    ) -> BaseException | None:
        """Step ``step`` into the temporary HDF5 file at this rank's ``block`` (rows,
        columns), the ranks in turn (or collectively). Returns this rank's error."""
        h, w = bs.shape

        def create(f: h5py.File) -> None:
            if step == 0:
                coords = {**self.coords, "time": np.zeros(0)}
                scales = declare_dims(
                    f, ("time", "latitude", "longitude"), (0, h, w), coords, unlimited=("time",)
                )
                for k in self.coords:
                    f[k].attrs.update(COORDINATE_ATTRS[k])
                f["time"].attrs.update(self._time_attrs())
                chunk = (1, max(1, *bs.lat.sizes), max(1, *bs.lon.sizes))  # about a block each
                for c in self.channels:
                    ds = f.create_dataset(
                        c, shape=(0, h, w), maxshape=(None, h, w), chunks=chunk, dtype=self.dtype
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
                            ds[(step, *block)] = x[i]
                    elif x[i].size:
                        ds[(step, *block)] = x[i]

            return run

        return in_turns(self.t, self.method, self.tmp, create, prepare, x.nbytes)

    def _write_zarr(
        self, x: np.ndarray, step: int, time: float | None, bs: BlockSpec
    ) -> BaseException | None:
        """Step ``step`` into the temporary Zarr store: rank 0 creates or grows the arrays,
        then every rank writes its chunks (the entries of a chunk that starts in another
        rank's block moved to that rank first: rows within the grid column, then columns
        within the grid row). Returns this rank's error. Collective."""
        h, w = bs.shape
        if self.chunks is None:  # the store's chunks, kept when the cut changes
            self.chunks = (self.chunk_rows or max(1, *bs.lat.sizes), max(1, *bs.lon.sizes))
        rows, cols = self.chunks
        dims = ("time", "latitude", "longitude")

        def create() -> None:
            root = zw.open_group(self.tmp, "w" if step == 0 else "a", self.zarr_format)
            if step == 0:
                for k, values in self.coords.items():
                    attrs = COORDINATE_ATTRS[k]
                    coord = zw.create_array(
                        root, k, values.shape, values.dtype, (k,), values.shape, attrs
                    )
                    coord[...] = values
                when = self._time_attrs()
                zw.create_array(root, "time", (0,), np.float64, ("time",), (512,), when)
                for c in self.channels:
                    attrs = {**self.attrs, **self.variable_attrs[c]}
                    zw.create_array(root, c, (0, h, w), self.dtype, dims, (1, rows, cols), attrs)
            root["time"].resize((step + 1,))
            root["time"][step] = step if time is None else time
            for c in self.channels:
                root[c].resize((step + 1, h, w))

        x = x.astype(self.dtype, copy=False)
        moved, lo = zw.to_owners(x, 1, bs.lat.sizes, rows, self.grid.lat)
        moved, c0 = zw.to_owners(moved, 2, bs.lon.sizes, cols, self.grid.lon)

        def write() -> None:
            ensure_space(self.tmp, moved.nbytes)
            for i, c in enumerate(self.channels):
                zw.write_rows(zw.open_rows(self.tmp, c), moved[i], 0, lo, (step,), (1, c0))

        return zw.in_parallel(self.t, create, write)

    def _time_attrs(self) -> dict[str, str]:
        """The time coordinate's attributes: CF ``units`` when given, else a step count."""
        if self.time_units:
            return {**COORDINATE_ATTRS["time"], "units": self.time_units}
        return {"long_name": "forecast step"}

    def close(self) -> Path:
        """Publish the file (rename the temporary file to ``path``). Collective."""
        if self._closed:
            return self.path
        self._closed = True
        error = None if self.steps else DataError("no step was written")
        if self.zarr:
            error = consolidated(self.t, self.tmp, error)
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
