"""Writing a field cut into latitude bands (or latitude x longitude blocks) to a Zarr store
that xarray opens (``xarray.open_zarr``), every rank writing its rows at once, no two ranks
ever writing one chunk.

Zarr writes whole chunks: a rank writing part of a chunk reads it, changes its rows and writes
it back, and two ranks doing that at once lose one's rows. So the rows are cut into chunks of
``chunk_rows`` (default: the tallest band, about one band per chunk), each chunk is owned by
the rank whose band holds its first row, and the few rows of a chunk that another rank holds
are moved to the owner first (:func:`~mpidp.ops.collectives.repartition`, one all-to-all of the
boundary rows; none when the bands are a chunk each). Blocks do the same along each axis: the
columns are cut into chunks of the widest block's columns, owned by the block holding their
first column, and moved within each grid row. Then every rank writes its chunks.

The store is written under a temporary name beside the target and put in place when every
rank succeeded (:func:`~mpidp.io._common.commit`); the writers in ``writer.py`` call this
module for targets ending in ``.zarr``. The layout is xarray's: dimension names
(``dimension_names`` in Zarr format 3, ``_ARRAY_DIMENSIONS`` in format 2), 1-D coordinate
arrays named after their dimensions, consolidated metadata.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from mpidp.comm import Transport
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "FORMATS",
    "aligned_sizes",
    "consolidate",
    "create_array",
    "in_parallel",
    "is_zarr_target",
    "open_rows",
    "write_rows",
]

#: The output formats of the writers: ``"auto"`` picks Zarr for a path ending in ``.zarr``.
FORMATS = ("auto", "netcdf", "zarr")


def is_zarr_target(path: Path, format: str) -> bool:
    """Whether a writer given ``path`` and ``format`` writes a Zarr store."""
    return format == "zarr" or (format == "auto" and path.suffix == ".zarr")


def create_array(
    root: Any,
    name: str,
    shape: Sequence[int],
    dtype: Any,
    dims: Sequence[str],
    chunks: Sequence[int],
    attrs: Mapping[str, Any],
) -> Any:
    """An array of group ``root`` in xarray's layout: dimension names where its Zarr format
    keeps them, ``attrs``, NaN as the fill value of floats. Replaces an array of that name.

    Other types get none in format 2 (xarray reads a format-2 fill value as ``_FillValue``
    and would turn every stored 0 into NaN) and zarr's default in format 3 (which xarray does
    not mask)."""
    if name in root:
        del root[name]
    fmt = root.metadata.zarr_format
    kind = np.dtype(dtype).kind
    array = root.create_array(
        name,
        shape=tuple(shape),
        dtype=dtype,
        chunks=tuple(max(1, c) for c in chunks),
        fill_value=np.nan if kind == "f" else None if fmt == 2 else 0,
        dimension_names=tuple(dims) if fmt == 3 else None,
    )
    extra = {"_ARRAY_DIMENSIONS": list(dims)} if fmt == 2 else {}
    array.attrs.update({**_plain(attrs), **extra})
    return array


def _plain(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes as JSON takes them (NumPy scalars and arrays as Python values)."""
    out = {}
    for k, v in attrs.items():
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        elif isinstance(v, bytes):
            v = v.decode()
        out[str(k)] = v
    return out


def aligned_sizes(sizes: Sequence[int], chunk_rows: int) -> list[int]:
    """The partition of the same rows in which every chunk of ``chunk_rows`` rows lies in one
    rank's band: a chunk goes to the rank whose band (in ``sizes``) holds its first row.
    Equal to ``sizes`` when every band boundary is a chunk boundary."""
    spec = ShardSpec.from_sizes(list(sizes))
    out = [0] * len(sizes)
    for start in range(0, spec.total, chunk_rows):
        owner = next(r for r in range(len(sizes)) if spec.start(r) <= start < spec.stop(r))
        out[owner] += min(chunk_rows, spec.total - start)
    return out


def to_owners(
    x: np.ndarray, dim: int, sizes: Sequence[int], chunk_rows: int, t: Transport | None
) -> tuple[np.ndarray, int]:
    """This rank's rows of the chunk-aligned partition (boundary rows moved between
    neighbours) and the global index of the first. Collective over ``t``."""
    new = aligned_sizes(sizes, chunk_rows)
    me = 0 if t is None else t.rank
    if t is None or list(new) == list(sizes):
        return x, sum(sizes[:me])
    from mpidp.ops.collectives import repartition

    moved = repartition(torch.from_numpy(x), list(sizes), new, dim=dim, group=t)
    return np.ascontiguousarray(moved.numpy()), sum(new[:me])


def open_rows(store: Path, name: str) -> Any:
    """Array ``name`` of the store at ``store``, opened for writing (fresh metadata: another
    rank may have resized it)."""
    import zarr

    return zarr.open_array(zarr.storage.LocalStore(store), path=name, mode="r+")


def write_rows(
    array: Any,
    x: np.ndarray,
    dim: int,
    lo: int,
    index: Sequence[Any] = (),
    cols: tuple[int, int] | None = None,
) -> None:
    """Put ``x`` at rows ``[lo, lo + rows)`` along ``dim`` of ``array`` (after the leading
    ``index``), and with ``cols = (col_dim, c0)`` at columns ``[c0, c0 + columns)`` along
    ``col_dim``; nothing for an empty band or block."""
    if not x.size:
        return
    at = {dim: lo} if cols is None else {dim: lo, cols[0]: cols[1]}
    slab = tuple(
        slice(at[i], at[i] + x.shape[i]) if i in at else slice(None) for i in range(x.ndim)
    )
    array[(*index, *slab)] = x


def in_parallel(
    t: Transport | None, create: Callable[[], None], write: Callable[[], None]
) -> BaseException | None:
    """``create`` (the store's metadata) on rank 0 alone; once every rank knows it worked,
    ``write`` (this rank's chunks) on every rank at once. Returns this rank's error (a failed
    ``create`` is every rank's) instead of raising, so that every rank reaches the agreement
    that follows (:func:`~mpidp.io._common.commit`)."""
    error: BaseException | None = None
    if t is None or t.rank == 0:
        try:
            create()
        except Exception as err:
            error = err
    created = t is None or t.all_gather_ints([error is None])[0][0]
    if not created:
        return error or OSError("rank 0 could not create the store's metadata")
    try:
        write()
    except Exception as err:
        error = err
    return error


def consolidate(store: Path) -> None:
    """Consolidated metadata, so ``xarray.open_zarr`` opens the store in one read and without
    a warning. Format 3 has no consolidated metadata in its specification yet; zarr writes
    it anyway and says so, which is silenced here."""
    import zarr

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Consolidated metadata", UserWarning)
        zarr.consolidate_metadata(zarr.storage.LocalStore(store))


def open_group(store: Path, mode: str, zarr_format: int = 3) -> Any:
    """The root group of the store at ``store``: created in format ``zarr_format``
    (``mode="w"``), or opened for changes in the format it has (``"a"``)."""
    import zarr

    fmt = zarr_format if mode == "w" else None
    return zarr.open_group(
        zarr.storage.LocalStore(store), mode=cast(Any, mode), zarr_format=cast(Any, fmt)
    )


def copy_store(src: Path, dst: Path) -> None:
    """A copy of the store ``src`` at ``dst`` (what ``mode="a"`` changes; the original stays
    as it is until the copy replaces it)."""
    shutil.copytree(src, dst, symlinks=True)


def is_store(path: Path) -> bool:
    """Whether ``path`` is a Zarr store (a folder with a format 3 or 2 root group)."""
    return path.is_dir() and any(
        os.path.exists(path / marker) for marker in ("zarr.json", ".zgroup")
    )
