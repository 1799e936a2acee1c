"""The backend interface of the band readers: what a storage format tells the reader about
its parts at construction (:class:`PartInfo`) and how it reads rows ``[lo, hi)`` by columns
``[c0, c1)`` of one variable at one time (:class:`FieldSource`). HDF5 (``reader.py``) and Zarr
(``zarr_reader.py``) implement it; ``band.py`` is everything else."""

from __future__ import annotations

import base64
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidp.io._common import describe_error, digest

__all__ = ["CF_ATTRIBUTES", "FieldSource", "Packing", "PartInfo", "ReadFailure", "part_info"]

LAT_NAMES = ("latitude", "lat")
LON_NAMES = ("longitude", "lon")
TIME_NAMES = ("time", "valid_time")
LEVEL_NAMES = ("level", "pressure_level", "plev", "isobaricInhPa")

#: The variable attributes a dataset passes on to what is written from it (CF conventions).
CF_ATTRIBUTES = ("units", "long_name", "standard_name")


@dataclass(frozen=True)
class Packing:
    """How a variable's stored numbers become values (CF conventions, as xarray decodes
    them): ``stored * scale + offset``, and the stored ``missing`` numbers (``_FillValue``,
    ``missing_value``) NaN."""

    scale: float = 1.0
    offset: float = 0.0
    missing: tuple[float, ...] = ()

    def apply(self, stored: np.ndarray) -> np.ndarray:
        """The values of ``stored`` numbers, in float64."""
        values = stored.astype(np.float64)
        if self.missing:  # compared in the stored type, as xarray does (1e20 in float32)
            values[np.isin(stored, np.asarray(self.missing).astype(stored.dtype))] = np.nan
        return values * self.scale + self.offset


def packing(array: Any) -> Packing | None:
    """The :class:`Packing` of an array (its ``scale_factor``, ``add_offset``, ``_FillValue``
    and ``missing_value`` attributes); None when its numbers are its values as stored (no
    scale, no offset, and no missing number other than NaN)."""
    attrs = array.attrs
    scale, offset = attrs.get("scale_factor"), attrs.get("add_offset")
    missing = [_number(attrs.get(k), array.dtype) for k in ("_FillValue", "missing_value")]
    meta = getattr(array, "metadata", None)
    if meta is not None and getattr(meta, "zarr_format", None) == 2 and "_FillValue" not in attrs:
        missing.append(meta.fill_value)  # Zarr 2 keeps _FillValue here; xarray reads it so
    found = tuple(
        float(v) for m in missing if m is not None for v in np.atleast_1d(m) if not np.isnan(v)
    )
    if scale is None and offset is None and not found:
        return None
    return Packing(
        1.0 if scale is None else float(np.asarray(scale).reshape(())),
        0.0 if offset is None else float(np.asarray(offset).reshape(())),
        found,
    )


@dataclass(frozen=True)
class PartInfo:
    """What a rank learned from one part (a file, a store) at construction.

    ``shapes``, ``dtypes``, ``levels`` (level coordinate or None), ``stats`` (the ``mean`` and
    ``std`` attributes or None), ``attrs`` (CF attributes), ``level_units`` and ``packing``
    (:class:`Packing`, or None for values stored as they are) are per variable read;
    ``variables`` lists every data variable the part holds (the default selection);
    ``fingerprint`` is compared across ranks (the same part must look the same everywhere)."""

    label: str
    variables: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    n_time: int
    lat: Any
    lon: Any
    time: Any
    levels: dict[str, Any]
    stats: dict[str, tuple[Any, Any]]
    attrs: dict[str, dict[str, str]]
    level_units: dict[str, str]
    fingerprint: tuple[Any, ...]
    packing: dict[str, Packing | None]


def part_info(
    label: str,
    variables: Sequence[str],
    arrays: Mapping[str, Any],
    coords: tuple[Any, Any, Any],
    level_coords: Mapping[str, Any],
    identity: tuple[Any, ...],
) -> PartInfo:
    """A :class:`PartInfo` from a part's ``arrays`` (h5py datasets or Zarr arrays: ``shape``,
    ``dtype``, ``attrs``), its ``(lat, lon, time)`` coordinate arrays and each 4-D
    variable's level coordinate (each None where missing); ``identity`` leads the
    fingerprint (the real path, sizes, modification times)."""
    shapes = {n: tuple(a.shape) for n, a in arrays.items()}
    dtypes = {n: str(a.dtype) for n, a in arrays.items()}
    lat, lon, time = (None if c is None else np.asarray(c[...]) for c in coords)
    return PartInfo(
        label=label,
        variables=tuple(variables),
        shapes=shapes,
        dtypes=dtypes,
        n_time=next(iter(shapes.values()))[0],
        lat=lat,
        lon=lon,
        time=time,
        levels={n: None if c is None else np.asarray(c[...]) for n, c in level_coords.items()},
        stats={n: (a.attrs.get("mean"), a.attrs.get("std")) for n, a in arrays.items()},
        attrs={n: cf_attributes(a) for n, a in arrays.items()},
        level_units={n: cf_attributes(c).get("units", "") for n, c in level_coords.items()},
        fingerprint=(*identity, shapes, dtypes, digest(lat), digest(time)),
        packing={n: packing(a) for n, a in arrays.items()},
    )


def _number(value: Any, dtype: Any) -> Any:
    """A fill value as stored in attributes: a number or array; or, as xarray writes a float
    fill value into Zarr format 3, the base64 of a little-endian float's bytes (8 of them for
    a float32 array too). None for None or anything else."""
    if isinstance(value, str):
        if np.dtype(dtype).kind != "f":
            return None
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            return None
        kind = {2: "<f2", 4: "<f4", 8: "<f8"}.get(len(raw))
        return None if kind is None else np.frombuffer(raw, kind)[0]
    return None if value is None or isinstance(value, bytes) else value


class ReadFailure(Exception):
    """A source's read failed after construction: ``what`` happened, ``fix`` says what to do.
    The dataset raises it as a :class:`~mpidp.DataError` naming its rank."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.what, self.fix = what, fix


class FieldSource(ABC):
    """A storage format as the band reader sees it: the backend interface.

    A format names its parts (``labels``: the files, the stores) and says how to
    :meth:`open_part` one, list its :meth:`data_variables` and :meth:`shapes`, spot a
    :meth:`layout_problem`, :meth:`describe` it (a :class:`PartInfo`) and :meth:`read` rows
    ``[lo, hi)`` by columns ``[c0, c1)`` of one variable at one time. :meth:`inspect`
    (construction) and the per-process handles (:meth:`handle`; a DataLoader worker opens its
    own) are shared.

    ``part_word`` and ``kind`` name a part in messages (``"file"``, ``"HDF5/netCDF-4
    file"``); ``errors`` are the exceptions that mean a part is unreadable; ``expected`` says
    what to pass when construction finds a problem, ``breakage`` what may have happened when a
    read fails later."""

    labels: list[str]
    part_word = "file"
    kind = "file"
    errors: tuple[type[BaseException], ...] = (OSError, KeyError, ValueError)
    expected = "readable data"
    breakage = "changed?"

    @property
    def fix(self) -> str:
        """What to do when construction finds a problem."""
        return f"pass {self.expected}, and the same arguments on every rank"

    @property
    def broken(self) -> str:
        """What to do when a read fails after construction."""
        return (
            f"the {self.part_word} changed or broke after the dataset was built "
            f"({self.breakage}); restore it"
        )

    @abstractmethod
    def open_part(self, part: int) -> AbstractContextManager[Any]:
        """Part ``part`` opened for inspection (closed on leaving the context)."""

    @abstractmethod
    def data_variables(self, node: Any) -> list[str]:
        """The ``(time, [level,] lat, lon)`` variables of an opened part (the default)."""

    @abstractmethod
    def shapes(self, node: Any) -> dict[str, tuple[int, ...]]:
        """The shape of every array of an opened part."""

    def layout_problem(self, label: str, node: Any, names: Sequence[str]) -> str | None:
        """What keeps ``names`` of an opened part from being read; None if nothing."""
        return None

    @abstractmethod
    def describe(self, part: int, node: Any, names: Sequence[str]) -> PartInfo:
        """What the reader needs to know of part ``part``, opened (variables ``names``)."""

    @abstractmethod
    def read(
        self, part: int, name: str, time: int, levels: Any, lo: int, hi: int, c0: int, c1: int
    ) -> np.ndarray:
        """Rows ``[lo, hi)`` (stored order) by columns ``[c0, c1)`` of variable ``name`` at
        time ``time`` of ``part``: ``(len(levels), rows, columns)``; ``(1, rows, columns)``
        when ``levels`` is None (a 3-D variable). ``levels`` is a slice or a list of level
        indices. Raises :class:`ReadFailure`, or one of ``errors``. Local."""

    def inspect(
        self, inputs: Sequence[str], outputs: Sequence[str], problems: list[str]
    ) -> list[PartInfo]:
        """A :class:`PartInfo` per part for the variables ``inputs`` (default: every data
        variable of the first part) and ``outputs``; what is wrong goes to ``problems`` (then
        fewer infos than parts are returned). Local."""
        infos: list[PartInfo] = []
        names: list[str] = []
        for part, label in enumerate(self.labels):
            try:
                with self.open_part(part) as node:
                    names = names or wanted_variables(inputs, outputs, self.data_variables(node))
                    problem = variable_problem(label, names, self.shapes(node))
                    problem = problem or self.layout_problem(label, node, names)
                    if problem:
                        problems.append(problem)
                        continue
                    infos.append(self.describe(part, node, names))
            except FileNotFoundError:
                problems.append(f"{label}: no such {self.part_word}")
            except self.errors as err:
                problems.append(
                    f"{label}: not a readable {self.kind} ({describe_error(err)}): its header "
                    f"or metadata is damaged, or it is of another format; restore it "
                    f"from a copy or write it again"
                )
        return infos

    def handle(self, key: Any, part: int, time: int, make: Callable[[], Any]) -> Any:
        """This process's handle ``key`` (made by ``make`` on first use; a new process, a
        DataLoader worker, makes its own). A part that cannot be opened any more (moved,
        purged) raises :class:`ReadFailure`."""
        if self.__dict__.get("_pid") != os.getpid():
            self._handles: dict[Any, Any] = {}
            self._pid = os.getpid()
        found = self._handles.get(key)
        if found is None:
            try:
                found = self._handles[key] = make()
            except self.errors as err:
                raise ReadFailure(
                    f"{self.labels[part]} (time index {time}) cannot be opened any more: "
                    f"{describe_error(err)}",
                    "it was readable when the dataset was built: was it moved, deleted or "
                    "purged from scratch since? Restore it, or rebuild the dataset",
                ) from err
        return found

    def close(self) -> None:
        """Drop (and close) this process's handles; they are reopened on the next read."""
        for h in self.__dict__.get("_handles", {}).values():
            try:
                getattr(h, "close", lambda: None)()
            except Exception:
                pass
        self._handles = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}, "_pid": None}


def wanted_variables(
    inputs: Sequence[str], outputs: Sequence[str], found: Sequence[str]
) -> list[str]:
    """The variables to inspect: ``inputs`` (default: every variable ``found``) and
    ``outputs``, each once."""
    return list(dict.fromkeys([*(inputs or found), *outputs]))


def variable_problem(
    label: str, names: Sequence[str], shapes: Mapping[str, tuple[int, ...]]
) -> str | None:
    """What is wrong with reading ``names`` from a part whose arrays have ``shapes``: none
    found, a missing one, or one not shaped ``(time, [level,] lat, lon)``; None if nothing."""
    if not names:
        return f"{label}: no (time, [level,] lat, lon) variables found"
    missing = [n for n in names if n not in shapes]
    if missing:
        return f"{label}: no variable {missing}; it has {sorted(shapes)}"
    bad = {n: shapes[n] for n in names if len(shapes[n]) not in (3, 4)}
    if bad:
        return (
            f"{label}: variables {bad} are not shaped (time, lat, lon) or (time, level, lat, lon)"
        )
    return None


def text(value: Any) -> str:
    """An attribute as text (h5py gives str, bytes or a 0-d/1-element array; Zarr JSON)."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    return value.decode() if isinstance(value, bytes) else str(value)


def cf_attributes(obj: Any) -> dict[str, str]:
    """The :data:`CF_ATTRIBUTES` that ``obj`` (anything with ``attrs``, or None) carries."""
    if obj is None:
        return {}
    return {k: text(obj.attrs[k]) for k in CF_ATTRIBUTES if k in obj.attrs}
