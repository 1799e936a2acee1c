"""Reading: every rank reads only its own latitude band, or latitude x longitude block (plus
halo), from HDF5/netCDF-4 files.

Layout of the files: variables shaped ``(time, lat, lon)`` (one channel each) or
``(time, level, lat, lon)`` (one channel per level), or one array ``(time, channel, lat,
lon)`` -- the same thing to this reader. Several files are concatenated along time.

Rows are presented **north to south** (ERA5's order) unless ``lat_order="file"``: a file whose
latitude coordinate increases is read mirrored. Without a latitude coordinate the file's own
row order is used as it is.

The items, halo rows and normalisation are :class:`~mpidp.io.band.BandDataset`'s; this module
is the HDF5 :class:`~mpidp.io.source.FieldSource`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Sampler

from mpidp.io import source
from mpidp.io.band import BandDataset
from mpidp.io.source import CF_ATTRIBUTES
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized

__all__ = ["CF_ATTRIBUTES", "DataParallelSampler", "ShardedH5Dataset"]

Opener = Callable[[str], h5py.File]


def _open(path: str) -> h5py.File:
    return h5py.File(path, "r")


def _coordinate(f: h5py.File, dset: h5py.Dataset, axis: int, names: Sequence[str]) -> Any:
    """The coordinate dataset of ``dset``'s ``axis``: its attached dimension scale, else a
    1-D dataset of a conventional name with the right length; None if neither exists."""
    axis %= dset.ndim  # h5py's dimension proxies take no negative index
    n = dset.shape[axis]
    for scale in dset.dims[axis].values():
        if scale.ndim == 1 and scale.shape[0] == n and not _is_pure_dim(scale):
            return scale
    for name in names:
        if name in f and isinstance(f[name], h5py.Dataset) and f[name].shape == (n,):
            return f[name]
    return None


def _is_pure_dim(ds: h5py.Dataset) -> bool:
    name = ds.attrs.get("NAME", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name.startswith("This is a netCDF dimension")


class _H5Source(source.FieldSource):
    """HDF5/netCDF-4 files, concatenated along time; one handle per file and process."""

    kind = "HDF5/netCDF-4 file"
    expected = (
        "existing, readable files of the same data on every rank (a shared file system, or "
        "identical copies), variables shaped (time, [level,] lat, lon)"
    )
    breakage = "truncated, overwritten, on a file system that went away?"

    def __init__(self, paths: Sequence[str], opener: Opener) -> None:
        self.labels = list(paths)
        self.opener = opener

    def open_part(self, part: int) -> h5py.File:
        return self.opener(self.labels[part])

    def data_variables(self, node: h5py.File) -> list[str]:
        """The 3-D and 4-D datasets that are not dimension scales, in file order."""
        return [
            name
            for name, obj in node.items()
            if isinstance(obj, h5py.Dataset) and obj.ndim in (3, 4) and "CLASS" not in obj.attrs
        ]

    def shapes(self, node: h5py.File) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in node.items() if isinstance(v, h5py.Dataset)}

    def describe(self, part: int, node: h5py.File, names: Sequence[str]) -> source.PartInfo:
        label = self.labels[part]
        first = node[names[0]]
        stat = os.stat(label) if os.path.exists(label) else None
        return source.part_info(
            label,
            self.data_variables(node),
            {n: node[n] for n in names},
            tuple(
                _coordinate(node, first, axis, where)
                for axis, where in (
                    (-2, source.LAT_NAMES),
                    (-1, source.LON_NAMES),
                    (0, source.TIME_NAMES),
                )
            ),
            {
                n: _coordinate(node, node[n], 1, source.LEVEL_NAMES)
                for n in names
                if node[n].ndim == 4
            },
            (
                os.path.realpath(label),
                node.id.get_filesize(),
                None if stat is None else stat.st_mtime_ns,
            ),
        )

    def read(
        self, part: int, name: str, time: int, levels: Any, lo: int, hi: int, c0: int, c1: int
    ) -> np.ndarray:
        d = self.handle(part, part, time, lambda: self.opener(self.labels[part]))[name]
        return d[time, lo:hi, c0:c1][None] if levels is None else d[time, levels, lo:hi, c0:c1]


class ShardedH5Dataset(BandDataset):
    """Input/target pairs of one latitude band (or latitude x longitude block), read from
    HDF5 or netCDF-4 files.

    Item ``i`` is ``(x, y)``: ``x`` holds ``input_steps`` consecutive times starting at time
    ``i`` (channels step-major: ``input_steps * len(channels)``), rows ``[start - before,
    stop + after)`` of this rank's band (rows beyond the poles filled by ``boundary``, exactly
    as :func:`mpidp.halo_exchange` fills them), all longitudes; ``y`` holds
    ``target_channels`` at ``lead_time`` steps after the last input, this rank's own rows.
    Each rank reads only those rows (hyperslab reads); no rank reads the full field.

    On a grid of blocks (``domain_parallel_size=(P_lat, P_lon)``) ``x`` is rows ``ds.rows``
    by columns ``ds.columns`` (this rank's block extended by ``halo`` and ``lon_halo``,
    filled as :func:`~mpidp.ops.block_halo.block_halo_exchange` fills them: latitude first,
    then longitude) and ``y`` this rank's block; bands are the grid ``(P, 1)``. See
    docs/io.md, "Blocks".

    Parameters
    ----------
    paths:
        One file or several, concatenated along time (the first dimension of every variable).
    variables:
        Names of ``(time, lat, lon)`` or ``(time, level, lat, lon)`` datasets, or one
        ``(time, channel, lat, lon)`` array; ``(name, level_indices)`` picks levels. Default:
        every 3-D and 4-D dataset of the first file.
    manager:
        Gives the partition of the rows over the domain group (``manager.spec(H)``) and this
        rank's place in it; default: the initialised manager, or one process.
    targets:
        Variables of ``y``; default the same as ``variables``.
    halo, boundary:
        Extra rows above and below the band (an int, a ``(before, after)`` pair, or a
        :class:`~mpidp.HaloSpec` with per-rank widths) and what fills rows beyond the edges:
        any :class:`~mpidp.Boundary` kind (``"polar"`` rolls along longitude).
    lon_halo, lon_boundary:
        Extra columns left and right of a block (the forms of ``halo``, per longitude rank;
        default none) and what fills columns beyond the edges: any non-polar kind, default
        ``"circular"`` (the sphere wraps).
    spec:
        An explicit partition instead of the manager's: a :class:`~mpidp.ShardSpec` or sizes
        of the rows (bands), or a :class:`~mpidp.runtime.grid.BlockSpec` (blocks).
    grid:
        The ``(lat, lon)`` size the model expects; a file of another size is an error.
    normalize:
        ``"stored"`` (the variables' ``mean``/``std`` attributes), ``"compute"`` (computed in
        parallel at construction: each rank over its band and a share of the times),
        a mapping ``{channel: (mean, std)}``, or None (raw values).
    lat_order:
        ``"north_to_south"`` (rows as ERA5 orders them; a south-to-north file, detected from
        its latitude coordinate, is mirrored) or ``"file"``.
    dtype:
        The dtype of the items (default float32).
    opener:
        Opens one file (default ``h5py.File(path, "r")``); e.g. to count the bytes read.

    ``attributes`` maps every channel read (inputs and targets) to the CF attributes of its
    source variable (:data:`CF_ATTRIBUTES`: ``units``, ``long_name``, ``standard_name`` where
    the file has them; ``long_name`` defaults to the variable's name, and a level's channel
    names its level): pass it to :class:`~mpidp.io.RolloutWriter` as ``variable_attrs``.

    Construction is collective over the world (every rank checks its files; a problem on any
    rank raises the same :class:`~mpidp.DataError` everywhere). Files are opened lazily, once
    per process, so DataLoader workers each open their own handles.
    """

    def _source(
        self, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], opener: Any
    ) -> source.FieldSource:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        self.opener: Opener = opener or _open
        return _H5Source(self.paths, self.opener)


class DataParallelSampler(Sampler[int]):
    """Sample indices for this data-parallel rank: the replicas share out the indices, and
    every rank of one domain group gets the same ones (they read the same sample).

    Deterministic: shuffled by ``seed + epoch`` (call :meth:`set_epoch` each epoch). Every
    replica gets the same number of indices (``drop_last`` drops the remainder; otherwise the
    first indices are repeated), so no replica runs out of batches before the others.
    ``manager`` may be a :class:`~mpidp.parallel.ParallelMesh`: its dp dimension is the
    replicas (tensor-parallel ranks then share samples too).
    """

    def __init__(
        self,
        dataset: Any,
        manager: DistributedManager | Any | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if manager is None and is_initialized():
            manager = get_manager()
        self.n = len(dataset)
        if hasattr(manager, "dp_size"):  # a ParallelMesh: tensor-parallel ranks share samples
            self.dp_rank, self.dp_size = getattr(manager, "dp_rank"), getattr(manager, "dp_size")  # noqa: B009
        else:
            self.dp_rank = 0 if manager is None else manager.dp_rank
            self.dp_size = 1 if manager is None else manager.dp_world_size
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self.per_rank = self.n // self.dp_size if drop_last else math.ceil(self.n / self.dp_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.per_rank * self.dp_size
        while len(order) < total:
            order += order[: total - len(order)]
        return iter(order[self.dp_rank : total : self.dp_size])

    def __len__(self) -> int:
        return self.per_rank
