"""The write paths that :func:`~mpidp.io.writer.write_sharded` and
:class:`~mpidp.io.rollout.RolloutWriter` share: the grid of blocks the ranks write (bands are
the grid ``(P, 1)``), the checks of the method and format asked for, ranks taking turns on one
HDF5 file (or writing it at once through MPI-IO), a Zarr store's metadata consolidated, and
the CF attributes of the coordinates written.
"""

from __future__ import annotations

import errno
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from mpidp.comm import Transport
from mpidp.errors import DataError
from mpidp.io import zarr_writer as zw
from mpidp.io._common import (
    ensure_space,
)
from mpidp.io.source import LON_NAMES
from mpidp.runtime.grid import BlockSpec, axis_transport
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import ShardSpec, balanced_sizes
from mpidp.sharded import Replicated, ShardedTensor

__all__ = [
    "COORDINATE_ATTRS",
    "METHODS",
    "WriteGrid",
    "as_numpy",
    "choose_method",
    "consolidated",
    "content_digest",
    "in_turns",
    "parallel_hdf5_available",
    "sharded_cut",
    "whose_band",
    "writes_zarr",
]

METHODS = ("auto", "mpio", "ordered")

#: CF attributes of the coordinate variables a rollout writes (time: when it has units).
COORDINATE_ATTRS = {
    "time": {"standard_name": "time", "long_name": "time"},
    "latitude": {"units": "degrees_north", "standard_name": "latitude", "long_name": "latitude"},
    "longitude": {
        "units": "degrees_east",
        "standard_name": "longitude",
        "long_name": "longitude",
    },
}


class WriteGrid:
    """The grid the ranks of a write form and the transports along its axes: the domain grid
    for the domain group (bands: ``(P, 1)``), ``(size, 1)`` for another group."""

    def __init__(self, manager: DistributedManager | None, group: Any, t: Transport | None):
        self.shape: tuple[int, int] = (1, 1)
        self.lat, self.lon = t, None
        if t is None:
            return
        m = None if isinstance(group, Transport) else manager or get_manager()
        if m is not None and (group is None or group == "domain" or group is m.domain_group):
            self.shape = m.grid
            self.lat, self.lon = axis_transport(m, "lat", "cpu"), axis_transport(m, "lon", "cpu")
        else:
            self.shape = (t.size, 1)

    def dims(
        self, x: np.ndarray, dim: Any, names: Sequence[str], problems: list[str]
    ) -> tuple[int, int | None]:
        """``(latitude, longitude)`` dims of ``x``: ``dim`` as a pair; or the int ``dim`` and,
        when the grid cuts the longitude, the dim ``names`` calls a longitude (None on bands:
        every column). What is wrong goes to ``problems``."""
        n = x.ndim
        pair = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        if not n or len(pair) > 2 or not all(isinstance(d, int) and -n <= d < n for d in pair):
            problems.append(
                f"dim {dim} is not a dimension (or a (lat, lon) pair) of a tensor of shape "
                f"{x.shape}"
            )
            return 0, None
        lat = pair[0] % n
        lon = pair[1] % n if len(pair) == 2 else None
        if lon is None and self.shape[1] > 1:
            named = [i for i, k in enumerate(names) if k in LON_NAMES]
            if not named:
                problems.append(
                    f"the domain grid {self.shape} cuts the longitude but no dim of "
                    f"{list(names)} is a longitude ({', '.join(LON_NAMES)}): a variable without "
                    f"the longitude dim cannot be written from blocks; pass dim=(lat_dim, "
                    f"lon_dim), or gather it along the longitude first"
                )
                return lat, None
            lon = named[0]
        if lon == lat:
            problems.append(f"dim {dim}: the latitude and longitude dims are both {lat}")
            return lat, None
        return lat, lon

    def blocks(self, table: list[list[int]], where: str, rank: int) -> BlockSpec:
        """The blocks the ranks hold (``table``: each rank's rows and columns, first), checked to
        tile the grid: the ranks of a grid row hold the same rows, of a column the same
        columns."""
        p_lat, p_lon = self.shape
        lat = [table[i * p_lon][0] for i in range(p_lat)]
        lon = [table[j][1] for j in range(p_lon)]
        off = [
            f"rank {r} holds {row[0]} x {row[1]} where its grid row and column give "
            f"{lat[r // p_lon]} x {lon[r % p_lon]}"
            for r, row in enumerate(table)
            if row[:2] != [lat[r // p_lon], lon[r % p_lon]]
        ]
        if off:
            raise DataError(
                f"rank {rank}: {where}: the ranks' blocks do not tile the {p_lat} x {p_lon} "
                f"grid ({'; '.join(off)}); pass each rank its own block "
                f"(mpidp.shard_tensor(x, dim=(-2, -1)))"
            )
        return BlockSpec(ShardSpec.from_sizes(lat), ShardSpec.from_sizes(lon))

    def unsized(self, known: tuple[bool, bool]) -> bool:
        """Whether an axis the ranks cut has no ``known`` extent (then a plain part's
        :func:`content_digest` is taken, for :meth:`refuse_copies`)."""
        return any(p > 1 and not k for p, k in zip(self.shape, known, strict=True))

    def refuse_copies(
        self, digests: Sequence[int], known: tuple[bool, bool], where: str, rank: int
    ) -> None:
        """Refuse plain parts that are copies of one another (``digests``: each rank's
        :func:`content_digest`, -1 where not taken) along an axis whose extent nothing else
        gives (``known``: a coordinate or a ShardedTensor gives the latitude's, the
        longitude's). When every rank of each latitude column (longitude row) holds the same
        values, each passed the whole field rather than its band (block), and the file would
        hold P copies of it, silently. The same :class:`~mpidp.DataError` on every rank
        (``digests`` are agreed)."""
        p_lat, p_lon = self.shape
        if min(digests, default=-1) < 0:
            return
        lines = {
            "latitude column": [digests[j::p_lon] for j in range(p_lon)],
            "longitude row": [digests[i * p_lon : (i + 1) * p_lon] for i in range(p_lat)],
        }
        for k, (axis, parts) in enumerate(lines.items()):
            if len(parts[0]) == 1 or known[k] or any(len(set(line)) > 1 for line in parts):
                continue
            what, n = ("rows", "latitudes") if k == 0 else ("columns", "longitudes")
            raise DataError(
                f"rank {rank}: {where}: every rank of each {axis} passed the same values (a "
                f"plain tensor): the whole field rather than its own {what}, which the file "
                f"would hold {len(parts[0])} times over; fix: pass the ShardedTensor (a "
                f"converted model's output, mpidp.shard(x, dim=...)), or each rank its own "
                f"{what} (manager.block_spec(shape) gives them), or the {n} (coordinates) so "
                f"that the grid's size is known (also when the ranks' parts are equal indeed)"
            )


def sharded_cut(x: Any) -> tuple[tuple[int, ...] | None, ShardSpec | BlockSpec | None, list[str]]:
    """How a writer takes ``x``: for a ShardedTensor the dims it is cut along (its latitude,
    and its longitude on blocks: non-negative) and its cut (a band's ShardSpec, the
    BlockSpec of blocks), with what keeps it from being written as this rank's band or block
    (a spectrum, tokens, merged dims holding several blocks); for a plain tensor ``(None,
    None, [])``. A :class:`~mpidp.sharded.Replicated` value is refused: every rank would
    write it whole."""
    if isinstance(x, Replicated):
        return None, None, [
            "a value every rank holds (Replicated, e.g. full_tensor()): each rank would write "
            "it whole; pass this rank's band or block: the ShardedTensor itself, or its "
            "to_local()"
        ]  # fmt: skip
    if not isinstance(x, ShardedTensor):
        return None, None, []
    g = x.grid
    if x.spectral or x.blocks > 1 or (g is not None and not isinstance(g, BlockSpec)):
        tokens = g is not None and not isinstance(g, BlockSpec)
        what = (
            "a spectrum" if x.spectral else "tokens" if tokens
            else f"{x.blocks} blocks merged along dim {x.shard_dim}"
        )  # fmt: skip
        return None, None, [
            f"a ShardedTensor of {what}: a writer takes a field cut into bands or blocks; "
            f"pass the field so cut"
        ]  # fmt: skip
    if g is None:
        return (x.shard_dim,), x.spec, []
    n = x.dim()
    return (g.dims[0] % n, g.dims[1] % n), g, []


def content_digest(x: np.ndarray, take: bool) -> int:
    """A checksum of ``x``'s shape and bytes when ``take`` (else -1): the ranks compare it to
    find parts that are copies of one another (:meth:`WriteGrid.refuse_copies`)."""
    if not take:
        return -1
    head = zlib.crc32(repr(x.shape).encode())
    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data, head)


def parallel_hdf5_available() -> bool:
    """Whether this h5py was built with MPI (the ``mpio`` driver)."""
    return bool(h5py.get_config().mpi)


def mpi_comm(t: Transport | None) -> Any:
    return getattr(t, "comm", None)


def choose_method(method: str, t: Transport | None, problems: list[str]) -> str:
    if method not in METHODS:
        problems.append(f"method={method!r} is not one of {', '.join(METHODS)}")
        return "ordered"
    mpio_ok = parallel_hdf5_available() and mpi_comm(t) is not None
    if method == "mpio" and not mpio_ok:
        problems.append(
            "method='mpio' needs an h5py built with MPI (scripts/setup-phdf5.sh) and a job "
            "launched by MPI; use method='ordered'"
        )
    if method == "auto":
        return "mpio" if mpio_ok else "ordered"
    return method


def writes_zarr(
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


def as_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return np.ascontiguousarray(x.numpy())
    return np.ascontiguousarray(x)


def in_turns(
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
            with h5py.File(tmp, "a", driver="mpio", comm=mpi_comm(t)) as f:
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


def consolidated(t: Transport | None, tmp: Path, error: BaseException | None) -> Any:
    """``error``; on rank 0 without one, the store's metadata consolidated first (the
    metadata is complete once rank 0 created it: the other ranks write chunks only; the
    agreement that follows tells whether they failed)."""
    if error is None and (t is None or t.rank == 0):
        try:
            zw.consolidate(tmp)
        except Exception as err:
            return err
    return error


def whose_band(sizes: Sequence[int], rows: int) -> str:
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
