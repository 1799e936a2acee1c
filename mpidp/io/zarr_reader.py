"""Reading each rank's band from a Zarr store: the xarray/CF layout (ERA5, WeatherBench2) and
anemoi-datasets' layout.

xarray's layout is what ``xarray.Dataset.to_zarr`` writes, Zarr format 2 or 3: one array per
variable with dimensions ``(time, [level,] latitude, longitude)`` (named by
``_ARRAY_DIMENSIONS`` in format 2's attributes, by ``dimension_names`` in format 3), and 1-D
coordinate arrays named after the dimensions. A read asks Zarr for exactly the rows a rank
needs, so only the chunks that overlap them are fetched.

anemoi-datasets' layout is one array ``data`` shaped ``(time, variable, ensemble, values)``,
the grid flattened, with the variable names in a ``variables`` attribute and the latitude and
longitude of every point in 1-D arrays ``latitudes`` and ``longitudes``. It is read when the
grid is regular and stored row by row: rows ``[lo, hi)`` are then the contiguous values
``[lo * W, hi * W)``, again only the chunks that overlap them.

The items, halo rows and normalisation are :class:`~mpidp.io.band.BandDataset`'s; this module
is the Zarr :class:`~mpidp.io.source.FieldSource`. ``zarr>=3`` is an optional dependency
(``pip install 'mpidp[zarr]'``), imported when a store is opened.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidp.io import band, source
from mpidp.io._common import describe_error

__all__ = ["AnemoiGrid", "ShardedZarrDataset", "anemoi_layout", "zarr_available"]

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


# -- anemoi-datasets' layout --------------------------------------------------------------------

#: How an anemoi-datasets store is refused when its grid is not one bands can cut.
_NOT_REGULAR = (
    "{label}: the {n} grid points of 'data' are not a regular latitude-longitude grid stored "
    "row by row ({why}); a reduced (octahedral) Gaussian grid or scattered points cannot be cut "
    "into latitude bands: regrid the data to a regular lat-lon grid (in the anemoi-datasets "
    "recipe, or with earthkit-regrid) and build the store again, or use a graph model on the "
    "points, which cuts nodes, not rows (docs/graphs.md)"
)


@dataclass(frozen=True)
class AnemoiGrid:
    """An anemoi-datasets store as the band reader sees it: the ``variables`` along axis 1 of
    ``data`` and the regular grid of ``rows`` x ``columns`` points that its flattened last
    axis holds, row by row (the points of row ``r`` are ``[r * columns, (r + 1) * columns)``)."""

    variables: tuple[str, ...]
    rows: int
    columns: int


def is_anemoi(group: Any) -> bool:
    """Whether a group is in anemoi-datasets' layout: an array ``data`` beside the arrays
    ``latitudes``/``longitudes`` or a ``variables`` (``name_to_index``) attribute."""
    import zarr

    data = group.get("data")
    if not isinstance(data, zarr.Array):
        return False
    named = any(k in a for a in (group.attrs, data.attrs) for k in ("variables", "name_to_index"))
    return named or "latitudes" in group or "longitudes" in group


def anemoi_layout(label: str, group: Any) -> AnemoiGrid | str | None:
    """The :class:`AnemoiGrid` of a group in anemoi-datasets' layout; None for a group in
    another layout; what keeps it from being read (a message naming the store ``label`` and the
    fix) when ``data`` is not 4-D, the variable names are missing, the coordinates do not
    match, or the grid is not regular. Reads the coordinates. Local."""
    if not is_anemoi(group):
        return None
    data = group["data"]
    if data.ndim != 4:
        return (
            f"{label}: 'data' has shape {data.shape}, anemoi-datasets' layout is (time, "
            f"variable, ensemble, values); build the store with anemoi-datasets (anemoi-datasets "
            f"create), or write it in xarray's layout"
        )
    names = _anemoi_variables(group, data)
    if names is None or len(names) != data.shape[1] or len(set(names)) != len(names):
        found = "no 'variables' attribute" if names is None else f"variables {names}"
        return (
            f"{label}: 'data' has shape {data.shape} (time, variable, ensemble, values) and "
            f"{found} (root group or 'data' attributes) naming its {data.shape[1]} variables "
            f"once each; set it (group.attrs['variables'] = [...], in the order of data's "
            f"axis 1), or build the store again with anemoi-datasets"
        )
    coords = []
    for name in ("latitudes", "longitudes"):
        node = group.get(name)
        shape = None if node is None else getattr(node, "shape", None)
        if shape != (data.shape[3],):
            return (
                f"{label}: {name!r} has shape {shape}, 'data' has {data.shape[3]} grid points "
                f"(shape {data.shape}); store the latitude and longitude of every point as 1-D "
                f"arrays 'latitudes' and 'longitudes' of length {data.shape[3]}"
            )
        coords.append(np.asarray(node[...], dtype=np.float64))
    found_grid = regular_rows(coords[0], coords[1], group.attrs.get("field_shape"))
    if isinstance(found_grid, str):
        return _NOT_REGULAR.format(label=label, n=data.shape[3], why=found_grid)
    return AnemoiGrid(tuple(names), *found_grid)


def _anemoi_variables(group: Any, data: Any) -> list[str] | None:
    """The variable names: the ``variables`` attribute (anemoi-datasets keeps it on the root
    group; on ``data`` too), else the root's ``name_to_index``; None without."""
    for attrs in (group.attrs, data.attrs):
        if "variables" in attrs:
            return [str(n) for n in attrs["variables"]]
    index = group.attrs.get("name_to_index")
    if isinstance(index, dict):
        return [str(n) for n, _ in sorted(index.items(), key=lambda kv: kv[1])]
    return None


def regular_rows(
    lat: np.ndarray, lon: np.ndarray, field_shape: Any = None
) -> tuple[int, int] | str:
    """``(rows, columns)`` when the points ``lat``, ``lon`` are a regular grid stored row by
    row (each row of ``columns`` points at one latitude, every row at the same longitudes);
    otherwise what breaks it. The row length is ``field_shape[1]`` when that attribute fits
    the points, else the run of points sharing the first latitude."""
    n = len(lat)
    if n == 0:
        return "no points"
    if isinstance(field_shape, (list, tuple)) and len(field_shape) == 2:
        rows, columns = (int(k) for k in field_shape)
        width = columns if rows * columns == n and columns > 0 else 0
    else:
        width = 0
    if not width:
        differs = np.flatnonzero(lat != lat[0])
        width = int(differs[0]) if differs.size else n
    if n % width:
        return (
            f"the first {width} points share latitude {lat[0]:g}, but {n} points are not a "
            f"whole number of rows of {width}"
        )
    la, lo = lat.reshape(-1, width), lon.reshape(-1, width)
    bad = np.flatnonzero((la != la[:, :1]).any(axis=1))
    if bad.size:
        r = int(bad[0])
        return (
            f"row {r} (points {r * width}:{(r + 1) * width}) spans latitudes "
            f"{la[r].min():g} to {la[r].max():g}"
        )
    bad = np.flatnonzero((lo != lo[:1]).any(axis=1))
    if bad.size:
        r = int(bad[0])
        return f"the longitudes of row {r} (points {r * width}:{(r + 1) * width}) are not row 0's"
    return n // width, width


@dataclass(frozen=True)
class _AnemoiView:
    """An opened anemoi-datasets store: its group and grid."""

    group: Any
    grid: AnemoiGrid


@dataclass(frozen=True)
class _Field:
    """One variable of ``data`` as :func:`~mpidp.io.source.part_info` reads an array."""

    shape: tuple[int, ...]
    dtype: Any
    attrs: dict[str, Any]


def _anemoi_fields(view: _AnemoiView, names: Sequence[str]) -> dict[str, _Field]:
    """Each variable ``names`` as a 3-D array, its ``mean``/``std`` the store's ``mean`` and
    ``stdev`` entries (when it holds both, one per variable)."""
    data, grid = view.group["data"], view.grid
    stats: dict[str, Any] = {}
    for key, array in (("mean", "mean"), ("std", "stdev")):
        node = view.group.get(array)
        if getattr(node, "shape", None) == (len(grid.variables),):
            stats[key] = np.asarray(node[...], dtype=np.float64)
    shape = (data.shape[0], grid.rows, grid.columns)
    return {
        n: _Field(
            shape,
            data.dtype,
            {k: v[grid.variables.index(n)] for k, v in stats.items()} if len(stats) == 2 else {},
        )
        for n in names
    }


class _ZarrSource(source.FieldSource):
    """Zarr stores (paths or opened groups), concatenated along time, each in xarray's layout
    or anemoi-datasets' (``grids``: an :class:`AnemoiGrid` or None per store, found before the
    variables are inspected). Arrays are opened once per process; a store given as a path is
    reopened by each DataLoader worker, an opened group travels to the workers pickled."""

    part_word = "store"
    kind = "Zarr store"
    errors = (Exception,)  # zarr's errors share no base with OSError
    expected = (
        "Zarr stores (a directory, a .zip file or an opened zarr.Group) in xarray's layout "
        "(variables with dimensions (time, [level,] latitude, longitude)) or anemoi-datasets' "
        "(an array 'data' (time, variable, ensemble, values) on a regular grid), the same data "
        "on every rank"
    )
    breakage = "chunks deleted or rewritten, an object store that went away?"

    def __init__(self, stores: Sequence[Store], opener: Opener) -> None:
        self.stores = list(stores)
        self.labels = [_label(s) for s in self.stores]
        self.opener = opener
        self.grids: list[AnemoiGrid | None] = [None] * len(self.stores)

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
        found = len(problems)
        self._find_layouts(problems)
        if len(problems) > found:
            return []
        return super().inspect(inputs, outputs, problems)

    def _find_layouts(self, problems: list[str]) -> None:
        """Each store's :class:`AnemoiGrid` (None: xarray's layout) into ``grids``; what keeps
        an anemoi-datasets store from being read into ``problems`` (before its variables are
        looked for: without a grid it has none). A store that cannot be opened is left to
        :meth:`inspect`, which says so."""
        import zarr

        for part, label in enumerate(self.labels):
            try:
                group = self._group(part)
                found = anemoi_layout(label, group) if isinstance(group, zarr.Group) else None
            except self.errors:
                continue
            if isinstance(found, str):
                problems.append(found)
            else:
                self.grids[part] = found

    def open_part(self, part: int) -> contextlib.nullcontext[Any]:
        """The group, or for an anemoi-datasets store an :class:`_AnemoiView` of it."""
        import zarr

        node = self._group(part)
        if not isinstance(node, zarr.Group):
            raise TypeError(_NOT_A_GROUP.format(type(node).__name__))
        grid = self.grids[part]
        return contextlib.nullcontext(node if grid is None else _AnemoiView(node, grid))

    def data_variables(self, node: Any) -> list[str]:
        """The 3-D and 4-D arrays, in name order (as HDF5 lists them; a store's listing
        order depends on where it lives); an anemoi-datasets store's variables in its order."""
        if isinstance(node, _AnemoiView):
            return list(node.grid.variables)
        return sorted(name for name, a in node.arrays() if a.ndim in (3, 4))

    def shapes(self, node: Any) -> dict[str, tuple[int, ...]]:
        """Every array's shape; for an anemoi-datasets store, ``(time, rows, columns)`` per
        variable."""
        if isinstance(node, _AnemoiView):
            shape = (node.group["data"].shape[0], node.grid.rows, node.grid.columns)
            return dict.fromkeys(node.grid.variables, shape)
        return {name: tuple(a.shape) for name, a in node.arrays()}

    def layout_problem(self, label: str, node: Any, names: Sequence[str]) -> str | None:
        """A variable without dimension names (not xarray's layout) or with latitude and
        longitude swapped. (An anemoi-datasets store was checked when its layout was found.)"""
        if isinstance(node, _AnemoiView):
            return None
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
        if isinstance(node, _AnemoiView):
            return self._describe_anemoi(part, node, names)
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

    def _describe_anemoi(
        self, part: int, view: _AnemoiView, names: Sequence[str]
    ) -> source.PartInfo:
        """Rows' latitudes from the first column, columns' longitudes from the first row; the
        ``dates`` array as the time coordinate."""
        group, grid = view.group, view.grid
        data = group["data"]
        lat, lon = (np.asarray(group[c][...]) for c in ("latitudes", "longitudes"))
        dates = group.get("dates")
        time = dates if getattr(dates, "shape", None) == (data.shape[0],) else None
        store, label = self.stores[part], self.labels[part]
        path = isinstance(store, (str, os.PathLike))
        return source.part_info(
            label,
            grid.variables,
            _anemoi_fields(view, names),
            (lat[:: grid.columns], lon[: grid.columns], time),
            {},
            (os.path.realpath(store) if path else label, grid, tuple(data.shape), data.chunks),
        )

    def read(
        self, part: int, name: str, time: int, levels: Any, lo: int, hi: int, c0: int, c1: int
    ) -> np.ndarray:
        grid = self.grids[part]
        if grid is not None:
            # Member 0; rows [lo, hi) of a grid stored row by row are one run of values (whole
            # rows: a block's columns are cut from them).
            data = self.handle((part, "data"), part, time, lambda: self._group(part)["data"])
            w = grid.columns
            values = np.asarray(data[time, grid.variables.index(name), 0, lo * w : hi * w])
            rows = values.reshape(1, hi - lo, w)
            return rows if (c0, c1) == (0, w) else np.ascontiguousarray(rows[:, :, c0:c1])
        array = self.handle((part, name), part, time, lambda: self._group(part)[name])
        if levels is None:
            return np.asarray(array[time, lo:hi, c0:c1])[None]
        return np.asarray(array.oindex[time, levels, lo:hi, c0:c1])


class ShardedZarrDataset(band.BandDataset):
    """Input/target pairs of one latitude band, read from Zarr stores in the xarray/CF
    layout or anemoi-datasets' (recognised by their arrays): the items, parameters and errors
    of :class:`~mpidp.io.ShardedH5Dataset`, so a training script switches format by changing
    the class name.

    Each rank asks Zarr for the rows it needs (band plus halo, plus the rows across the pole
    under ``boundary="polar"``; on blocks, by the columns it needs): only the chunks that
    overlap them are fetched. A chunk that
    spans the whole field is therefore fetched whole by every rank, for every item; chunk
    latitude in a few rows per chunk (anemoi-datasets: the values axis in a few rows' worth).

    An anemoi-datasets store holds one array ``data`` shaped ``(time, variable, ensemble,
    values)``, its variable names in the ``variables`` attribute (of the root group, or of
    ``data``), each a 3-D variable (``"2t"``, ``"t_500"``: one name per level, no level
    selection), and 1-D ``latitudes`` and ``longitudes`` per value. Its grid must be regular
    and stored row by row (each run of ``W`` values one latitude, every row at the same
    longitudes; found from those coordinates, a reduced or unstructured grid is refused).
    Ensemble member 0 is read: a store of several members gives the first one's items.

    Parameters
    ----------
    paths:
        A store's path (a directory, or a ``.zip`` file), an opened ``zarr.Group`` (any
        zarr store: fsspec or object-store, consolidated, caching, wrapping), or several,
        concatenated along time. Variables have the dimensions ``(time, [level,] latitude,
        longitude)``; rows are presented north to south as by the HDF5 reader.
    variables, manager:
        As :class:`~mpidp.io.ShardedH5Dataset`; default variables: every 3-D and 4-D array,
        in name order (anemoi-datasets: every variable, in the store's order).
    opener:
        Opens a store given as a path (default: read only, ``.zip`` files as a
        ``zarr.storage.ZipStore``); returns a ``zarr.Group``.
    targets, lead_time, input_steps, halo, boundary, lon_halo, lon_boundary, spec, grid,
    normalize, lat_order, dtype:
        As :class:`~mpidp.io.ShardedH5Dataset` (``normalize="stored"``: the arrays' ``mean``
        and ``std`` attributes, as xarray keeps them; anemoi-datasets: the store's ``mean``
        and ``stdev`` arrays).

    Construction is collective over the world: a missing zarr, a missing store or variable,
    a group that is not a dataset, a non-monotonic latitude coordinate, an anemoi-datasets
    store without variable names, with coordinates of the wrong length or on a grid that is
    not regular raise the same :class:`~mpidp.DataError` on every rank, naming the store and
    the fix.
    """

    def _source(self, paths: Store | Sequence[Store], opener: Opener | None) -> source.FieldSource:
        if isinstance(paths, (str, os.PathLike)) or not isinstance(paths, (list, tuple)):
            paths = [paths]
        self.stores = list(paths)
        return _ZarrSource(self.stores, opener or open_store)
