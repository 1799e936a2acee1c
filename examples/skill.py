"""What the examples show of a forecast besides its numbers: truth, forecast and error side by
side for one variable and lead step (a PNG), and which times the climatology averages.

The scores themselves are :mod:`mpidp.ops.skill` (RMSE and anomaly correlation against persistence
and climatology, per lead step); ``examples/inference.py`` and ``examples/train.py`` print them.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["save_comparison", "step_hours", "time_units", "timestamp", "training_times"]

#: hours per unit of a CF time coordinate ("hours since 2000-01-01 00:00:00")
_HOURS = {"days": 24.0, "hours": 1.0, "minutes": 1 / 60, "seconds": 1 / 3600}


def training_times(n_times: int, val_samples: int) -> range:
    """The time indices examples/train.py trains on (its inputs and targets): all but the
    last ``val_samples + 1``, which validation and held-out forecasts use."""
    return range(n_times - 1 - val_samples)


def time_units(path: str | os.PathLike[str]) -> str | None:
    """The CF ``units`` of the time coordinate (``time`` or ``valid_time``) of an HDF5/netCDF-4
    file or a Zarr store in xarray's layout; None where there is none."""
    names = ("time", "valid_time")
    try:
        if Path(path).is_dir():  # a Zarr store
            import zarr

            group = zarr.open_group(str(path), mode="r")
            units = next((group[n].attrs.get("units") for n in names if n in group), None)
        else:
            import h5py

            with h5py.File(path, "r") as f:
                units = next((f[n].attrs.get("units") for n in names if n in f), None)
    except (OSError, ImportError, KeyError):
        return None
    units = units.decode() if isinstance(units, bytes) else units
    return str(units) if units else None


def _unit_and_origin(units: str | None) -> tuple[float, datetime.datetime | None] | None:
    """Hours per unit and the reference date of ``"<unit> since <date>"`` (None: not that)."""
    unit, _, since = (units or "").partition(" since ")
    hours = _HOURS.get(unit.strip().lower())
    if hours is None:
        return None
    try:
        origin: datetime.datetime | None = datetime.datetime.fromisoformat(since.strip())
    except ValueError:
        origin = None
    return hours, origin


def step_hours(times: Any, units: str | None) -> float | None:
    """The hours between the first two ``times`` (values of a CF time coordinate in
    ``units``), or None when they are unknown."""
    parsed = _unit_and_origin(units)
    if parsed is None or times is None or len(times) < 2:
        return None
    return float(times[1] - times[0]) * parsed[0]


def timestamp(value: float, units: str | None) -> str | None:
    """``2000-01-14 18:00`` for a value of a CF time coordinate in ``units``, or None."""
    parsed = _unit_and_origin(units)
    if parsed is None or parsed[1] is None:
        return None
    when = parsed[1] + datetime.timedelta(hours=float(value) * parsed[0])
    return when.strftime("%Y-%m-%d %H:%M")


def save_comparison(
    path: str | os.PathLike[str],
    truth: torch.Tensor | np.ndarray,
    forecast: torch.Tensor | np.ndarray,
    lat: Any,
    lon: Any,
    *,
    name: str,
    units: str = "",
    title: str = "",
    rmse: float | None = None,
) -> Path:
    """Three maps of one variable, ``(lat, lon)`` each: truth, forecast (one colour scale,
    its bar labelled ``name (units)``) and forecast minus truth (a diverging scale centred on
    zero, its own bar in the same units). ``rmse``, when given (from :mod:`mpidp.ops.skill`: the
    latitude-weighted one), is shown above the error. Written atomically (a temporary file
    renamed). Local: call it on the rank that holds the whole fields."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    truth_np = np.asarray(truth, dtype=np.float64)
    forecast_np = np.asarray(forecast, dtype=np.float64)
    error = forecast_np - truth_np
    u = f" ({units})" if units else ""
    extent = (float(lon[0]), float(lon[-1]), float(lat[-1]), float(lat[0]))
    lo = float(min(truth_np.min(), forecast_np.min()))
    hi = float(max(truth_np.max(), forecast_np.max()))
    span = float(np.abs(error).max()) or 1.0

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), dpi=110, sharey=True)
    panels = [
        (truth_np, "truth", "RdYlBu_r", lo, hi),
        (forecast_np, "forecast", "RdYlBu_r", lo, hi),
        (error, "forecast - truth", "RdBu_r", -span, span),
    ]
    for ax, (field, label, cmap, vmin, vmax) in zip(axes, panels, strict=True):
        im = ax.imshow(field, extent=extent, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
        bar = fig.colorbar(im, ax=ax, shrink=0.9)
        bar.set_label(f"{name}{u}" if label != "forecast - truth" else f"{name} error{u}")
        if label == "forecast - truth" and rmse is not None:
            label += f" (RMSE {rmse:.4g}{' ' + units if units else ''})"
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("longitude (degrees east)")
    axes[0].set_ylabel("latitude (degrees north)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
