"""Reading each rank's band from a Zarr store in the xarray/CF layout (ERA5, WeatherBench2).

The layout is what ``xarray.Dataset.to_zarr`` writes, Zarr format 2 or 3: one array per
variable with dimensions ``(time, [level,] latitude, longitude)`` (named by
``_ARRAY_DIMENSIONS`` in format 2's attributes, by ``dimension_names`` in format 3), and 1-D
coordinate arrays named after the dimensions. A read asks Zarr for exactly the rows a rank
needs, so only the chunks that overlap them are fetched.

The items, halo rows and normalisation are :class:`~mpidp.io.band.BandDataset`'s; this module
is the Zarr :class:`~mpidp.io.source.FieldSource`. ``zarr>=3`` is an optional dependency
(``pip install 'mpidp[zarr]'``), imported when a store is opened.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpidp.io import band, source
from mpidp.io._common import describe_error

__all__ = ["ShardedZarrDataset", "zarr_available"]

#: What to run when zarr is missing or too old.
INSTALL = "pip install 'mpidp[zarr]' (or pip install 'zarr>=3')"

Store = Any  # a path, or an opened zarr.Group
Opener = Callable[[str], Any]


def zarr_available() -> bool:
    """Whether ``zarr>=3`` can be imported (what :class:`ShardedZarrDataset` needs)."""
    return _zarr_problem() is None


def _zarr_problem() -> str | None:
    try:
        import zarr
    except ImportError as err:
        return f"zarr is not installed ({describe_error(err)}); install it: {INSTALL}"
    major = int(str(zarr.__version__).split(".")[0])
    if major < 3:
        return f"zarr {zarr.__version__} is installed, mpidp reads with zarr>=3: {INSTALL}"
    return None


def open_store(path: str) -> Any:
    """The root group of the Zarr store at ``path`` (a directory, or a ``.zip`` file), read
    only."""
    import zarr

    if os.path.isfile(path) and path.endswith(".zip"):
        store: Any = zarr.storage.ZipStore(path, mode="r")
    elif not os.path.exists(path):
        raise FileNotFoundError(path)
    else:
        store = zarr.storage.LocalStore(path, read_only=True)
    try:
        return zarr.open_group(store, mode="r")
    except (zarr.errors.GroupNotFoundError, zarr.errors.ContainsArrayError):
        try:
            array = zarr.open_array(store, mode="r")
        except Exception:
            raise  # neither a group nor an array: zarr's own message
        raise TypeError(_NOT_A_GROUP.format(type(array).__name__)) from None


_NOT_A_GROUP = (
    "a zarr {}, not a group holding a dataset; pass the store's root group (zarr.open_group) "
    "or its path"
)


def _label(store: Store) -> str:
    """How messages name a store: its path; for an opened group, its store and path, without
    an object address (the label is compared across ranks)."""
    if isinstance(store, (str, os.PathLike)):
        return os.fspath(store)
    where = re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", str(getattr(store, "store", store)))
    inner = getattr(store, "path", "")
    return f"{where}/{inner}" if inner else where


def dims_of(array: Any) -> tuple[str, ...] | None:
    """The dimension names of a Zarr array as xarray records them; None without."""
    names = getattr(array.metadata, "dimension_names", None)  # format 3
    if names is None:
        names = array.attrs.get("_ARRAY_DIMENSIONS")  # format 2 (xarray's convention)
    if names is None or len(names) != array.ndim or any(n is None for n in names):
        return None
    return tuple(str(n) for n in names)


def _coordinate(group: Any, dim: str, n: int, names: Sequence[str]) -> Any:
    """The 1-D array of coordinate ``dim`` (else one of the conventional ``names``) of length
    ``n``; None without one."""
    for name in (dim, *names):
        node = group.get(name)
        if node is not None and getattr(node, "shape", None) == (n,):
            return node
    return None


class _ZarrSource(source.FieldSource):
    """Zarr stores (paths or opened groups), concatenated along time. Arrays are opened once
    per process; a store given as a path is reopened by each DataLoader worker, an opened
    group travels to the workers pickled."""

    part_word = "store"
    kind = "Zarr store"
    errors = (Exception,)  # zarr's errors share no base with OSError
    expected = (
        "Zarr stores in the xarray layout (a directory, a .zip file or an opened zarr.Group; "
        "variables with dimensions (time, [level,] latitude, longitude)), the same data on "
        "every rank"
    )
    breakage = "chunks deleted or rewritten, an object store that went away?"

    def __init__(self, stores: Sequence[Store], opener: Opener) -> None:
        self.stores = list(stores)
        self.labels = [_label(s) for s in self.stores]
        self.opener = opener

    def _group(self, part: int) -> Any:
        store = self.stores[part]
        return self.opener(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else store

    def inspect(
        self, inputs: Sequence[str], outputs: Sequence[str], problems: list[str]
    ) -> list[source.PartInfo]:
        missing = _zarr_problem()
        if missing:
            problems.append(missing)
            return []
        return super().inspect(inputs, outputs, problems)

    def open_part(self, part: int) -> contextlib.nullcontext[Any]:
        import zarr

        node = self._group(part)
        if not isinstance(node, zarr.Group):
            raise TypeError(_NOT_A_GROUP.format(type(node).__name__))
        return contextlib.nullcontext(node)

    def data_variables(self, node: Any) -> list[str]:
        """The 3-D and 4-D arrays, in name order (as HDF5 lists them; a store's listing
        order depends on where it lives)."""
        return sorted(name for name, a in node.arrays() if a.ndim in (3, 4))

    def shapes(self, node: Any) -> dict[str, tuple[int, ...]]:
        return {name: tuple(a.shape) for name, a in node.arrays()}

    def layout_problem(self, label: str, node: Any, names: Sequence[str]) -> str | None:
        """A variable without dimension names (not xarray's layout) or with latitude and
        longitude swapped."""
        for name in names:
            dims = dims_of(node[name])
            if dims is None:
                return (
                    f"{label}: {name!r} carries no dimension names (_ARRAY_DIMENSIONS in Zarr 2 "
                    f"attributes, dimension_names in Zarr 3): not an xarray/CF dataset; write "
                    f"it with xarray (Dataset.to_zarr), or give its arrays dimension names"
                )
            if dims[-2] in source.LON_NAMES or dims[-1] in source.LAT_NAMES:
                return (
                    f"{label}: {name!r} has dimensions {dims}, the reader needs (time, "
                    f"[level,] latitude, longitude); transpose it (xarray: ds.transpose('time', "
                    f"..., 'latitude', 'longitude')) and write it again"
                )
        return None

    def describe(self, part: int, node: Any, names: Sequence[str]) -> source.PartInfo:
        arrays = {n: node[n] for n in names}
        first = arrays[names[0]]
        dims = dims_of(first) or ()
        axes = ((-2, source.LAT_NAMES), (-1, source.LON_NAMES), (0, ()))
        store, label = self.stores[part], self.labels[part]
        path = isinstance(store, (str, os.PathLike))
        return source.part_info(
            label,
            self.data_variables(node),
            arrays,
            tuple(_coordinate(node, dims[axis], first.shape[axis], where) for axis, where in axes),
            {
                n: _coordinate(node, (dims_of(a) or ())[1], a.shape[1], source.LEVEL_NAMES)
                for n, a in arrays.items()
                if a.ndim == 4
            },
            (
                os.path.realpath(store) if path else label,
                {n: tuple(a.chunks) for n, a in arrays.items()},
            ),
        )

    def read(self, part: int, name: str, time: int, levels: Any, lo: int, hi: int) -> np.ndarray:
        array = self.handle((part, name), part, time, lambda: self._group(part)[name])
        if levels is None:
            return np.asarray(array[time, lo:hi, :])[None]
        return np.asarray(array.oindex[time, levels, lo:hi, :])


class ShardedZarrDataset(band.BandDataset):
    """Input/target pairs of one latitude band, read from Zarr stores in the xarray/CF
    layout: the items, parameters and errors of :class:`~mpidp.io.ShardedH5Dataset`, so a
    training script switches format by changing the class name.

    Each rank asks Zarr for the rows it needs (band plus halo, plus the rows across the pole
    under ``boundary="polar"``): only the chunks that overlap them are fetched. A chunk that
    spans the whole field is therefore fetched whole by every rank, for every item; chunk
    latitude in a few rows per chunk.

    Parameters
    ----------
    paths:
        A store's path (a directory, or a ``.zip`` file), an opened ``zarr.Group`` (any
        zarr store: fsspec or object-store, consolidated, caching, wrapping), or several,
        concatenated along time. Variables have the dimensions ``(time, [level,] latitude,
        longitude)``; rows are presented north to south as by the HDF5 reader.
    variables, manager:
        As :class:`~mpidp.io.ShardedH5Dataset`; default variables: every 3-D and 4-D array,
        in name order.
    opener:
        Opens a store given as a path (default: read only, ``.zip`` files as a
        ``zarr.storage.ZipStore``); returns a ``zarr.Group``.
    targets, lead_time, input_steps, halo, boundary, spec, grid, normalize, lat_order, dtype:
        As :class:`~mpidp.io.ShardedH5Dataset` (``normalize="stored"``: the arrays' ``mean``
        and ``std`` attributes, as xarray keeps them).

    Construction is collective over the world: a missing zarr, a missing store or variable,
    a group that is not a dataset, a non-monotonic latitude coordinate raise the same
    :class:`~mpidp.DataError` on every rank, naming the store and the fix.
    """

    def _source(self, paths: Store | Sequence[Store], opener: Opener | None) -> source.FieldSource:
        if isinstance(paths, (str, os.PathLike)) or not isinstance(paths, (list, tuple)):
            paths = [paths]
        self.stores = list(paths)
        return _ZarrSource(self.stores, opener or open_store)
