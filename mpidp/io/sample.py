"""A small synthetic ERA5-like data set: the tests' data and the example training's.

Four variables on a regular latitude-longitude grid with poles on the first and last rows
(north first, as ERA5): ``t2m`` and ``msl`` (time, lat, lon), ``z`` and ``t`` (time, level,
lat, lon) on two pressure levels. Each is a climatology with a realistic latitude profile
(warm tropics, cold poles, a geopotential that falls poleward) plus weather: a handful of
planetary waves travelling east at latitude-dependent speeds, with slowly varying amplitudes,
and a little smooth noise. The fields are smooth and correlated in time, so that a model that
learns to advect the waves gets better than persistence.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import h5py
import numpy as np

from mpidp.io._common import attach_dims, declare_dims, install, temporary_name
from mpidp.io.zarr_writer import consolidate, create_array
from mpidp.runtime.progress import Progress

__all__ = ["make_sample_data", "ensure_sample_data", "sample_fingerprint"]

#: The file attribute that records which generator (this module's code) and which arguments
#: wrote a sample file, so that a cached copy is regenerated when either changes.
FINGERPRINT_ATTR = "mpidp_sample_fingerprint"

TITLE = "mpidp synthetic ERA5-like sample data"

#: (name, levels?, climatology of sin(lat), wave amplitude, units); the other CF attributes of
#: each are in :data:`_NAMES`
_VARIABLES = (
    ("t2m", False, lambda s, lev: 300.0 - 55.0 * s**2, 6.0, "K"),
    ("msl", False, lambda s, lev: 101325.0 - 900.0 * np.cos(3 * np.arcsin(s)), 1200.0, "Pa"),
    (
        "z",
        True,
        lambda s, lev: 9.81 * (5800.0 - 400.0 * s**2) * (lev / 500.0) ** -0.9,
        800.0,
        "m2 s-2",
    ),
    ("t", True, lambda s, lev: 265.0 - 35.0 * s**2 + 0.05 * (lev - 500.0), 4.0, "K"),
)


def make_sample_data(
    path: str | os.PathLike[str],
    *,
    n_lat: int = 91,
    n_lon: int = 180,
    n_time: int = 64,
    levels: tuple[int, ...] = (500, 850),
    hours: int = 6,
    seed: int = 0,
    progress: bool = False,
    format: str = "hdf5",
    zarr_format: int = 3,
) -> Path:
    """Write the sample data set to ``path`` (atomically) and return the path.

    ``n_lat`` rows from 90 to -90 degrees (poles on the rows), ``n_lon`` columns from 0 east,
    ``n_time`` steps ``hours`` apart from 2000-01-01. Every variable carries ``mean`` and
    ``std`` attributes (per level for the 4-D ones) for normalisation. Deterministic in
    ``seed``. ``progress`` shows a line per field written (a bar on a terminal). Local: call
    it on one rank.

    ``format="hdf5"`` writes a netCDF-4 file (contiguous variables); ``format="zarr"`` the same
    values as a Zarr store in xarray's layout (Zarr format ``zarr_format``, 2 or 3; a time
    step, a level and :data:`ZARR_LAT_CHUNK` rows per chunk; consolidated metadata);
    ``format="anemoi"`` the same values in anemoi-datasets' layout (:func:`_write_anemoi`:
    ``t2m``, ``msl`` and one variable per level, ``z_500``...). Both Zarr formats need
    ``mpidp[zarr]``.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: write one of {', '.join(map(repr, FORMATS))}")
    path = Path(path)
    fingerprint = sample_fingerprint(
        n_lat=n_lat, n_lon=n_lon, n_time=n_time, levels=levels, hours=hours, seed=seed
    )
    rng = np.random.default_rng(seed)
    coords = {
        "time": np.arange(n_time) * float(hours),
        "level": np.asarray(levels, dtype=np.int64),
        "latitude": np.linspace(90.0, -90.0, n_lat),
        "longitude": np.arange(n_lon) * (360.0 / n_lon),
    }
    tmp = temporary_name(path, int(rng.integers(1 << 40)))
    n_fields = sum(len(levels) if has_levels else 1 for _, has_levels, *_ in _VARIABLES)
    bar = Progress(n_fields, label="field", prefix="sample data: ", every=1, enabled=progress)
    fields = _fields(rng, coords, hours, bar)
    try:
        with bar:
            if format == "hdf5":
                _write_hdf5(tmp, fields, coords, fingerprint)
            elif format == "zarr":
                _write_zarr(tmp, fields, coords, fingerprint, zarr_format)
            else:
                _write_anemoi(tmp, fields, coords, fingerprint, zarr_format)
        install(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.unlink(missing_ok=True)
    return path


#: What :func:`make_sample_data` writes: a netCDF-4 file, a Zarr store in xarray's layout or
#: in anemoi-datasets'.
FORMATS = ("hdf5", "zarr", "anemoi")

#: Latitude rows per chunk of the Zarr sample store: a band reads the chunks it overlaps.
ZARR_LAT_CHUNK = 8

#: CF ``long_name`` and ``standard_name`` of each variable (ERA5's).
_NAMES = {
    "t2m": ("2 metre temperature", "air_temperature"),
    "msl": ("mean sea level pressure", "air_pressure_at_mean_sea_level"),
    "z": ("geopotential", "geopotential"),
    "t": ("temperature", "air_temperature"),
}

_COORD_UNITS = {
    "time": "hours since 2000-01-01 00:00:00",
    "level": "hPa",
    "latitude": "degrees_north",
    "longitude": "degrees_east",
}

#: (name, with levels?, float32 data, CF attributes, mean, std) of each variable, in file order.
Field = tuple[str, bool, np.ndarray, dict[str, str], np.ndarray, np.ndarray]


def _fields(
    rng: np.random.Generator, coords: dict[str, np.ndarray], hours: int, bar: Progress
) -> Iterator[Field]:
    """The sample variables, generated one at a time (the order fixes the random draws)."""
    phi = np.deg2rad(coords["latitude"])[:, None]
    lam = np.deg2rad(coords["longitude"])[None, :]
    s = np.sin(phi)
    for name, has_levels, climate, amplitude, units in _VARIABLES:
        levs = coords["level"].tolist() if has_levels else [500]
        parts = []
        for lev in levs:
            weather = _weather(rng, phi, lam, coords["time"], hours)
            parts.append(climate(s, lev) + amplitude * weather)
            bar.advance(name + (str(lev) if has_levels else ""))
        data = np.stack(parts, axis=1).astype(np.float32)
        if not has_levels:
            data = data[:, 0]
        axes = (0, 2, 3) if has_levels else None
        mean = np.asarray(data.mean(axis=axes, dtype=np.float64))
        std = np.asarray(data.std(axis=axes, dtype=np.float64))
        long_name, standard_name = _NAMES[name]
        cf = {"units": units, "long_name": long_name, "standard_name": standard_name}
        yield name, has_levels, data, cf, mean, std


def _write_hdf5(
    tmp: Path, fields: Iterator[Field], coords: dict[str, np.ndarray], fingerprint: str
) -> None:
    with h5py.File(tmp, "w") as f:
        f.attrs["title"] = TITLE
        f.attrs[FINGERPRINT_ATTR] = fingerprint
        n_time, n_lev = len(coords["time"]), len(coords["level"])
        n_lat, n_lon = len(coords["latitude"]), len(coords["longitude"])
        dims3 = declare_dims(f, ("time", "latitude", "longitude"), (n_time, n_lat, n_lon), coords)
        dims4 = declare_dims(
            f, ("time", "level", "latitude", "longitude"), (n_time, n_lev, n_lat, n_lon), coords
        )
        for name, units in _COORD_UNITS.items():
            f[name].attrs["units"] = units
        for name, has_levels, data, cf, mean, std in fields:
            ds = f.create_dataset(name, data=data)  # contiguous: a band is a hyperslab read
            attach_dims(ds, dims4 if has_levels else dims3)
            ds.attrs["mean"] = mean
            ds.attrs["std"] = std
            ds.attrs.update(cf)


def _write_zarr(
    tmp: Path,
    fields: Iterator[Field],
    coords: dict[str, np.ndarray],
    fingerprint: str,
    zarr_format: int,
) -> None:
    """xarray's layout: dimension names (``dimension_names`` in format 3,
    ``_ARRAY_DIMENSIONS`` in format 2), 1-D coordinates named after their dimensions."""
    import zarr

    root = zarr.open_group(tmp, mode="w", zarr_format=cast(Any, zarr_format))
    root.attrs.update({"title": TITLE, FINGERPRINT_ATTR: fingerprint})

    def put(name: str, data: np.ndarray, dims: tuple[str, ...], attrs: dict[str, Any]) -> None:
        chunks = data.shape  # a coordinate: one chunk
        if len(dims) > 1:  # a field: one time step (and level) and a few rows per chunk
            rows, n_lon = data.shape[-2:]
            chunks = (1,) * (len(dims) - 2) + (min(rows, ZARR_LAT_CHUNK), n_lon)
        create_array(root, name, data.shape, data.dtype, dims, chunks, attrs)[...] = data

    for name, units in _COORD_UNITS.items():
        put(name, coords[name], (name,), {"units": units})
    for name, has_levels, data, cf, mean, std in fields:
        dims = (
            ("time", "level", "latitude", "longitude")
            if has_levels
            else ("time", "latitude", "longitude")
        )
        put(name, data, dims, {"mean": mean.tolist(), "std": std.tolist(), **cf})
    consolidate(tmp)


def _write_anemoi(
    tmp: Path,
    fields: Iterator[Field],
    coords: dict[str, np.ndarray],
    fingerprint: str,
    zarr_format: int,
) -> None:
    """anemoi-datasets' layout: ``data`` (time, variable, ensemble, values) with one member and
    the grid flattened row by row, chunked as one time step, one variable and
    :data:`ZARR_LAT_CHUNK` rows' worth of values; its variable names (``z_500`` per level) in
    the root's ``variables`` attribute with ``field_shape`` and the dates; 1-D ``latitudes``
    and ``longitudes`` per value, ``dates``, and per-variable ``mean``, ``stdev``,
    ``minimum`` and ``maximum``."""
    import zarr

    lat, lon, levels = coords["latitude"], coords["longitude"], coords["level"].tolist()
    n_time, n_values = len(coords["time"]), len(lat) * len(lon)
    names = [
        f"{n}_{lev}" if has_levels else n
        for n, has_levels, *_ in _VARIABLES
        for lev in (levels if has_levels else [None])
    ]
    dates = np.datetime64("2000-01-01T00:00:00", "s") + (coords["time"] * 3600).astype(
        "timedelta64[s]"
    )
    root = zarr.open_group(tmp, mode="w", zarr_format=cast(Any, zarr_format))
    root.attrs.update(
        {
            "title": TITLE,
            FINGERPRINT_ATTR: fingerprint,
            "variables": names,
            "field_shape": [len(lat), len(lon)],
            "frequency": f"{int(np.diff(coords['time'][:2])[0]) if n_time > 1 else 6}h",
            "start_date": str(dates[0]),
            "end_date": str(dates[-1]),
        }
    )
    data = root.create_array(
        "data",
        shape=(n_time, len(names), 1, n_values),
        dtype=np.float32,
        chunks=(1, 1, 1, min(len(lat), ZARR_LAT_CHUNK) * len(lon)),
        fill_value=np.nan,
    )
    stats: dict[str, list[float]] = {"mean": [], "stdev": [], "minimum": [], "maximum": []}
    column = 0
    for _, has_levels, values, _, mean, std in fields:
        per_level = values if has_levels else values[:, None]
        for i in range(per_level.shape[1]):
            data[:, column, 0, :] = per_level[:, i].reshape(n_time, n_values)
            stats["mean"].append(float(np.atleast_1d(mean)[i]))
            stats["stdev"].append(float(np.atleast_1d(std)[i]))
            stats["minimum"].append(float(per_level[:, i].min()))
            stats["maximum"].append(float(per_level[:, i].max()))
            column += 1
    arrays = {
        "latitudes": np.repeat(lat, len(lon)),
        "longitudes": np.tile(lon, len(lat)),
        "dates": dates,
        **{k: np.asarray(v, dtype=np.float64) for k, v in stats.items()},
    }
    for name, values in arrays.items():
        root.create_array(name, shape=values.shape, dtype=values.dtype)[...] = values


def sample_fingerprint(**arguments: object) -> str:
    """A hash of this generator's source code and of ``make_sample_data``'s arguments."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(arguments, sort_keys=True, default=list).encode())
    return h.hexdigest()[:24]


def ensure_sample_data(
    path: str | os.PathLike[str],
    *,
    n_lat: int = 91,
    n_lon: int = 180,
    n_time: int = 64,
    levels: tuple[int, ...] = (500, 850),
    hours: int = 6,
    seed: int = 0,
    progress: bool = False,
) -> tuple[Path, str]:
    """The sample file at ``path``, written unless a file there came from this generator with
    these arguments: returns ``(path, why)``, ``why`` is ``""`` when the cached file was kept,
    else what made it stale (missing, unreadable, another generator or other arguments).
    ``progress`` as in :func:`make_sample_data`. Local: call it on one rank."""
    path = Path(path)
    arguments = dict(n_lat=n_lat, n_lon=n_lon, n_time=n_time, levels=levels, hours=hours)
    want = sample_fingerprint(**arguments, seed=seed)
    why = ""
    if not path.exists():
        why = "missing"
    else:
        try:
            with h5py.File(path, "r") as f:
                got = f.attrs.get(FINGERPRINT_ATTR)
        except OSError as err:
            got, why = None, f"unreadable ({err})"
        if not why and (got.decode() if isinstance(got, bytes) else got) != want:
            why = "written by another version of the generator or with other arguments"
    if why:
        make_sample_data(path, **arguments, seed=seed, progress=progress)  # type: ignore[arg-type]
    return path, why


def _weather(
    rng: np.random.Generator, phi: np.ndarray, lam: np.ndarray, times: np.ndarray, hours: int
) -> np.ndarray:
    """(time, lat, lon) anomalies of unit-ish size: eastward-travelling waves whose speed and
    envelope depend on latitude (fast mid-latitude jets, slow tropics), amplitudes drifting
    slowly (an AR(1) process), plus smooth noise."""
    out = np.zeros((len(times), phi.shape[0], lam.shape[1]))
    coslat = np.cos(phi)
    for k in (2, 3, 4, 5, 7):
        centre = rng.uniform(-0.9, 0.9)
        envelope = np.exp(-(((phi - centre) / 0.45) ** 2)) * (0.3 + coslat)
        speed = rng.uniform(8.0, 20.0) * (0.4 + np.abs(np.sin(2 * phi)))  # degrees per day
        phase = rng.uniform(0, 2 * np.pi)
        amp = 1.0
        for i, hour in enumerate(times):
            amp = 0.97 * amp + 0.03 * rng.uniform(0.5, 1.5)
            shift = np.deg2rad(speed * hour / 24.0)
            out[i] += amp * envelope * np.cos(k * (lam - shift) + phase) / k**0.5
    noise = rng.standard_normal((len(times), 1, lam.shape[1] // 4 + 1))
    smooth = np.repeat(noise, 4, axis=2)[:, :, : lam.shape[1]] * 0.05 * coslat
    return out + smooth
