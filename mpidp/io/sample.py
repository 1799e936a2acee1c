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
from pathlib import Path

import h5py
import numpy as np

from mpidp.io._common import attach_dims, declare_dims, temporary_name
from mpidp.progress import Progress

__all__ = ["make_sample_data", "ensure_sample_data", "sample_fingerprint"]

#: The file attribute that records which generator (this module's code) and which arguments
#: wrote a sample file, so that a cached copy is regenerated when either changes.
FINGERPRINT_ATTR = "mpidp_sample_fingerprint"

#: (name, levels?, climatology of sin(lat), wave amplitude, units)
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
) -> Path:
    """Write the sample data set to ``path`` (atomically) and return the path.

    ``n_lat`` rows from 90 to -90 degrees (poles on the rows), ``n_lon`` columns from 0 east,
    ``n_time`` steps ``hours`` apart from 2000-01-01. Every variable carries ``mean`` and
    ``std`` attributes (per level for the 4-D ones) for normalisation. Deterministic in
    ``seed``. ``progress`` shows a line per field written (a bar on a terminal). Local: call
    it on one rank.
    """
    path = Path(path)
    fingerprint = sample_fingerprint(
        n_lat=n_lat, n_lon=n_lon, n_time=n_time, levels=levels, hours=hours, seed=seed
    )
    rng = np.random.default_rng(seed)
    lat = np.linspace(90.0, -90.0, n_lat)
    lon = np.arange(n_lon) * (360.0 / n_lon)
    phi, lam = np.deg2rad(lat)[:, None], np.deg2rad(lon)[None, :]
    s = np.sin(phi)
    times = np.arange(n_time) * float(hours)
    tmp = temporary_name(path, int(rng.integers(1 << 40)))
    fields = sum(len(levels) if has_levels else 1 for _, has_levels, *_ in _VARIABLES)
    bar = Progress(fields, label="field", prefix="sample data: ", every=1, enabled=progress)
    try:
        with bar, h5py.File(tmp, "w") as f:
            f.attrs["title"] = "mpidp synthetic ERA5-like sample data"
            f.attrs[FINGERPRINT_ATTR] = fingerprint
            coords = {
                "time": times,
                "level": np.asarray(levels, dtype=np.int64),
                "latitude": lat,
                "longitude": lon,
            }
            dims3 = declare_dims(
                f, ("time", "latitude", "longitude"), (n_time, n_lat, n_lon), coords
            )
            dims4 = declare_dims(
                f,
                ("time", "level", "latitude", "longitude"),
                (n_time, len(levels), n_lat, n_lon),
                coords,
            )
            f["time"].attrs["units"] = "hours since 2000-01-01 00:00:00"
            f["latitude"].attrs["units"] = "degrees_north"
            f["longitude"].attrs["units"] = "degrees_east"
            f["level"].attrs["units"] = "hPa"
            for name, has_levels, climate, amplitude, units in _VARIABLES:
                levs = levels if has_levels else (500,)
                parts = []
                for lev in levs:
                    weather = _weather(rng, phi, lam, times, hours)
                    parts.append(climate(s, lev) + amplitude * weather)
                    bar.advance(name + (str(lev) if has_levels else ""))
                data = np.stack(parts, axis=1).astype(np.float32)
                if not has_levels:
                    data = data[:, 0]
                ds = f.create_dataset(name, data=data)  # contiguous: a band is a hyperslab read
                attach_dims(ds, dims4 if has_levels else dims3)
                axes = (0, 2, 3) if has_levels else None
                ds.attrs["mean"] = data.mean(axis=axes, dtype=np.float64)
                ds.attrs["std"] = data.std(axis=axes, dtype=np.float64)
                ds.attrs["units"] = units
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
