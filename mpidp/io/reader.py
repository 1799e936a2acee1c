"""Reading: every rank reads only its own latitude band (plus halo) from HDF5/netCDF-4 files.

Layout of the files: variables shaped ``(time, lat, lon)`` (one channel each) or
``(time, level, lat, lon)`` (one channel per level), or one array ``(time, channel, lat,
lon)`` -- the same thing to this reader. Several files are concatenated along time.

Rows are presented **north to south** (ERA5's order) unless ``lat_order="file"``: a file whose
latitude coordinate increases is read mirrored. Without a latitude coordinate the file's own
row order is used as it is.
"""

from __future__ import annotations

import atexit
import bisect
import math
import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from mpidp.comm import Transport
from mpidp.errors import DataError
from mpidp.geometry import HaloSpec
from mpidp.halo import place_piece
from mpidp.halo_plan import Boundary, Piece
from mpidp.halo_plan import plan as plan_for
from mpidp.io._common import check_everywhere, describe_error, digest
from mpidp.manager import DistributedManager, get_manager, is_initialized
from mpidp.partition import ShardSpec

__all__ = ["CF_ATTRIBUTES", "DataParallelSampler", "ShardedH5Dataset"]

Opener = Callable[[str], h5py.File]
Variables = str | Sequence[str | tuple[str, Sequence[int]]] | None

_LAT_NAMES = ("latitude", "lat")
_LON_NAMES = ("longitude", "lon")
_TIME_NAMES = ("time", "valid_time")
_LEVEL_NAMES = ("level", "pressure_level", "plev", "isobaricInhPa")

#: The variable attributes a dataset passes on to what is written from it (CF conventions).
CF_ATTRIBUTES = ("units", "long_name", "standard_name")


_LIVE: weakref.WeakSet[ShardedH5Dataset] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close open handles before the interpreter tears down (file objects passed to h5py must
    outlive the HDF5 files that use them)."""
    for ds in list(_LIVE):
        ds.close()


def _open(path: str) -> h5py.File:
    return h5py.File(path, "r")


def _coordinate(f: h5py.File, dset: h5py.Dataset, axis: int, names: Sequence[str]) -> Any:
    """Values of the coordinate of ``dset``'s ``axis``: its attached dimension scale, else a
    1-D dataset of a conventional name with the right length; None if neither exists."""
    n = dset.shape[axis]
    for scale in dset.dims[axis].values():
        if scale.ndim == 1 and scale.shape[0] == n and not _is_pure_dim(scale):
            return scale[()]
    for name in names:
        if name in f and isinstance(f[name], h5py.Dataset) and f[name].shape == (n,):
            return f[name][()]
    return None


def _text(value: Any) -> str:
    """An HDF5 attribute as text (h5py returns str, bytes or a 0-d/1-element array)."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    return value.decode() if isinstance(value, bytes) else str(value)


def _cf_attributes(obj: Any) -> dict[str, str]:
    """The :data:`CF_ATTRIBUTES` that ``obj`` (a dataset, or None) carries, as text."""
    if obj is None:
        return {}
    return {k: _text(obj.attrs[k]) for k in CF_ATTRIBUTES if k in obj.attrs}


def _level_scale(f: h5py.File, dset: h5py.Dataset) -> h5py.Dataset | None:
    """The coordinate dataset of ``dset``'s level axis (axis 1), found as :func:`_coordinate`
    finds it; None without one."""
    n = dset.shape[1]
    for scale in dset.dims[1].values():
        if scale.ndim == 1 and scale.shape[0] == n and not _is_pure_dim(scale):
            return scale
    for name in _LEVEL_NAMES:
        if name in f and isinstance(f[name], h5py.Dataset) and f[name].shape == (n,):
            return f[name]
    return None


def _is_pure_dim(ds: h5py.Dataset) -> bool:
    name = ds.attrs.get("NAME", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name.startswith("This is a netCDF dimension")


def _data_variables(f: h5py.File) -> list[str]:
    """The 3-D and 4-D datasets that are not dimension scales, in file order."""
    out = []
    for name, obj in f.items():
        if isinstance(obj, h5py.Dataset) and obj.ndim in (3, 4) and "CLASS" not in obj.attrs:
            out.append(name)
    return out


class _FileInfo:
    """What one rank learned from one file at construction (its shapes and coordinates)."""

    def __init__(self, path: str, f: h5py.File, names: Sequence[str]) -> None:
        self.path = path
        self.shapes = {n: tuple(f[n].shape) for n in names}
        self.dtypes = {n: str(f[n].dtype) for n in names}
        first = f[names[0]]
        self.n_time = first.shape[0]
        self.lat = _coordinate(f, first, first.ndim - 2, _LAT_NAMES)
        self.lon = _coordinate(f, first, first.ndim - 1, _LON_NAMES)
        self.time = _coordinate(f, first, 0, _TIME_NAMES)
        self.levels = {n: _coordinate(f, f[n], 1, _LEVEL_NAMES) for n in names if f[n].ndim == 4}
        self.stats = {n: (f[n].attrs.get("mean"), f[n].attrs.get("std")) for n in names}
        self.attrs = {n: _cf_attributes(f[n]) for n in names}
        self.level_units = {
            n: _cf_attributes(_level_scale(f, f[n])).get("units", "")
            for n in names
            if f[n].ndim == 4
        }
        stat = os.stat(path) if os.path.exists(path) else None
        self.fingerprint = (
            self.shapes,
            self.dtypes,
            f.id.get_filesize(),
            None if stat is None else stat.st_mtime_ns,
            digest(self.lat),
            digest(self.time),
        )


def _parse_variables(variables: Variables) -> list[tuple[str, tuple[int, ...] | None]]:
    if variables is None:
        return []
    if isinstance(variables, str):
        return [(variables, None)]
    out: list[tuple[str, tuple[int, ...] | None]] = []
    for v in variables:
        if isinstance(v, str):
            out.append((v, None))
        else:
            name, levels = v
            out.append((str(name), tuple(int(i) for i in levels)))
    return out


def _channel_names(name: str, n_levels: int, levels: tuple[int, ...], coord: Any) -> list[str]:
    if n_levels == 0:
        return [name]
    if coord is not None and np.all(np.mod(coord, 1) == 0):
        return [f"{name}{int(coord[i])}" for i in levels]
    return [f"{name}_{i}" for i in levels]


def _channel_attributes(
    name: str, levels: tuple[int, ...], info: _FileInfo
) -> list[dict[str, str]]:
    """The CF attributes of each channel of variable ``name``: the variable's own
    (``units``, ``long_name``, ``standard_name``), ``long_name`` defaulting to its name; the
    channel of one level names it (``t at 500 hPa``)."""
    own = info.attrs[name]
    base = own.get("long_name", name)
    if len(info.shapes[name]) == 3:
        return [{**own, "long_name": base}]
    coord, units = info.levels.get(name), info.level_units.get(name, "")
    out = []
    for i in levels:
        where = f"level {i}" if coord is None else f"{coord[i]:g} {units}".strip()
        out.append({**own, "long_name": f"{base} at {where}"})
    return out


def _halo(halo: int | tuple[int, int] | HaloSpec, parts: int) -> tuple[tuple[int, ...], ...]:
    if isinstance(halo, HaloSpec):
        return halo.before, halo.after
    if isinstance(halo, int):
        return (halo,) * parts, (halo,) * parts
    before, after = halo
    return (int(before),) * parts, (int(after),) * parts


class ShardedH5Dataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Input/target pairs of one latitude band, read from HDF5 or netCDF-4 files.

    Item ``i`` is ``(x, y)``: ``x`` holds ``input_steps`` consecutive times starting at time
    ``i`` (channels step-major: ``input_steps * len(channels)``), rows ``[start - before,
    stop + after)`` of this rank's band (rows beyond the poles filled by ``boundary``, exactly
    as :func:`mpidp.halo_exchange` fills them), all longitudes; ``y`` holds
    ``target_channels`` at ``lead_time`` steps after the last input, this rank's own rows.
    Each rank reads only those rows (hyperslab reads); no rank reads the full field.

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
    spec:
        An explicit partition (a :class:`~mpidp.ShardSpec` or sizes) instead of the manager's.
    grid:
        The ``(lat, lon)`` size the model expects; a file of another size is an error.
    normalize:
        ``"stored"`` (the variables' ``mean``/``std`` attributes), ``"compute"`` (computed in
        parallel at construction: each rank over its band and a share of the times),
        a mapping ``{channel: (mean, std)}``, or None (raw values).
    lat_order:
        ``"north_to_south"`` (rows as ERA5 orders them; a south-to-north file, detected from
        its latitude coordinate, is mirrored) or ``"file"``.
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

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        variables: Variables = None,
        manager: DistributedManager | None = None,
        *,
        targets: Variables = None,
        lead_time: int = 1,
        input_steps: int = 1,
        halo: int | tuple[int, int] | HaloSpec = 0,
        boundary: Any = "zeros",
        spec: ShardSpec | Sequence[int] | None = None,
        grid: tuple[int, int] | None = None,
        normalize: str | Mapping[str, tuple[float, float]] | None = "stored",
        lat_order: str = "north_to_south",
        dtype: torch.dtype = torch.float32,
        opener: Opener | None = None,
        stats_stride: int = 1,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        self.opener = opener or _open
        self.lead_time, self.input_steps = int(lead_time), int(input_steps)
        self.dtype = dtype
        if manager is None and is_initialized():
            manager = get_manager()
        t = None if manager is None else manager.transport("world", "cpu")
        self._dp = (0, 1) if manager is None else (manager.dp_rank, manager.dp_world_size)
        inputs, outputs = _parse_variables(variables), _parse_variables(targets)
        problems: list[str] = []
        if lat_order not in ("north_to_south", "file"):
            problems.append(f"lat_order={lat_order!r} is not 'north_to_south' or 'file'")
        if self.lead_time < 0 or self.input_steps < 1:
            problems.append(
                f"lead_time={lead_time} must be >= 0 and input_steps={input_steps} >= 1"
            )
        infos = self._inspect(inputs, outputs, problems)
        b = Boundary.of(boundary, -1)
        facts = {
            "files": [
                (os.path.realpath(p), i.fingerprint)
                for p, i in zip(self.paths, infos, strict=False)
            ]
            if len(infos) == len(self.paths)
            else "unreadable",
            "variables": self._inputs,
            "targets": self._outputs,
            "lead_time, input_steps": (self.lead_time, self.input_steps),
            "halo": repr(halo),
            "boundary": b,
            "spec": None if spec is None else list(spec),
            "grid": grid,
            "normalize": repr(normalize),
            "lat_order": lat_order,
        }
        check_everywhere(
            t,
            problems,
            facts,
            f"ShardedH5Dataset over {self.paths} cannot be read as asked",
            "pass existing, readable files of the same data on every rank (a shared file "
            "system, or identical copies), variables shaped (time, [level,] lat, lon), and the "
            "same arguments on every rank",
        )
        self._setup(infos, grid, spec, manager, halo, b, lat_order)
        self._handles: dict[str, h5py.File] = {}
        self._pid = -1
        self.mean, self.std = self._statistics(normalize, infos, t)
        _LIVE.add(self)

    # -- construction -------------------------------------------------------------------------

    def _inspect(
        self,
        inputs: list[tuple[str, tuple[int, ...] | None]],
        outputs: list[tuple[str, tuple[int, ...] | None]],
        problems: list[str],
    ) -> list[_FileInfo]:
        infos: list[_FileInfo] = []
        self._inputs, self._outputs = inputs, outputs or inputs
        for path in self.paths:
            try:
                with self.opener(path) as f:
                    if not self._inputs:
                        self._inputs = [(n, None) for n in _data_variables(f)]
                        self._outputs = outputs or self._inputs
                    names = list(dict.fromkeys(n for n, _ in self._inputs + self._outputs))
                    missing = [n for n in names if n not in f]
                    if not names:
                        problems.append(f"{path}: no (time, [level,] lat, lon) datasets found")
                        continue
                    if missing:
                        problems.append(f"{path}: no variable {missing}; it has {sorted(f.keys())}")
                        continue
                    bad = {n: f[n].shape for n in names if f[n].ndim not in (3, 4)}
                    if bad:
                        problems.append(
                            f"{path}: variables {bad} are not shaped (time, lat, lon) or "
                            f"(time, level, lat, lon)"
                        )
                        continue
                    infos.append(_FileInfo(path, f, names))
            except FileNotFoundError:
                problems.append(f"{path}: no such file")
            except (OSError, KeyError, ValueError) as err:
                problems.append(
                    f"{path}: not a readable HDF5/netCDF-4 file ({describe_error(err)})"
                )
        if len(infos) == len(self.paths):
            self._consistent(infos, problems)
        return infos

    def _consistent(self, infos: list[_FileInfo], problems: list[str]) -> None:
        """Every variable of every file on the same (lat, lon) grid; times agree in a file;
        levels asked for exist."""
        first = infos[0]
        grid = {n: s[-2:] for n, s in first.shapes.items()}
        g0 = next(iter(grid.values()))
        for info in infos:
            for n, shape in info.shapes.items():
                if shape[-2:] != g0:
                    problems.append(
                        f"{info.path}: {n} has a (lat, lon) grid of {shape[-2:]}, "
                        f"{first.path} has {g0}"
                    )
                if shape[0] != info.n_time:
                    problems.append(f"{info.path}: {n} has {shape[0]} times, others {info.n_time}")
                if shape[1:-2] != first.shapes[n][1:-2]:
                    problems.append(
                        f"{info.path}: {n} has shape {shape}, {first.path} has {first.shapes[n]}"
                    )
        for name, levels in self._inputs + self._outputs:
            shape = first.shapes[name]
            if levels is not None and (len(shape) == 3 or max(levels) >= shape[1]):
                problems.append(
                    f"{name}: level indices {list(levels)} do not exist in its shape {shape}"
                )

    def _setup(
        self,
        infos: list[_FileInfo],
        grid: tuple[int, int] | None,
        spec: ShardSpec | Sequence[int] | None,
        manager: DistributedManager | None,
        halo: int | tuple[int, int] | HaloSpec,
        boundary: Boundary,
        lat_order: str,
    ) -> None:
        """Derived from facts every rank agreed on, so every rank raises alike (no hang)."""
        parts = 1 if manager is None else manager.domain_world_size
        rank = 0 if manager is None else manager.domain_rank
        first = infos[0]
        h, w = next(iter(first.shapes.values()))[-2:]
        where = f"{self.paths[0]} ({h} x {w})"
        if grid is not None and tuple(grid) != (h, w):
            raise _error(
                rank,
                f"{self.paths[0]} holds a {h} x {w} (lat x lon) grid but the model expects "
                f"{tuple(grid)} (the grid argument)",
                "use the files of the model's resolution, or build the model for the files' grid",
            )
        if spec is None:
            try:
                spec = manager.spec(h) if manager is not None else ShardSpec.balanced(h, 1)
            except Exception as err:
                raise _error(rank, f"{where}: {err}", "use fewer domain ranks") from None
        spec = spec if isinstance(spec, ShardSpec) else ShardSpec.from_sizes(spec)
        if spec.total != h or spec.parts != parts:
            raise _error(
                rank,
                f"partition {list(spec.sizes)} cuts {spec.total} rows over {spec.parts} ranks "
                f"but {where} has {h} latitude rows and the domain group {parts} ranks",
                f"pass a spec of {parts} sizes summing to {h}",
            )
        self.spec, self.rank, self.grid = spec, rank, (h, w)
        before, after = _halo(halo, parts)
        if len(before) != parts:
            raise _error(
                rank,
                f"halo {halo!r} has widths for {len(before)} ranks, not {parts}",
                f"pass a HaloSpec with {parts} widths",
            )
        self.boundary = boundary
        if boundary.polar and w % 2:
            raise _error(
                rank,
                f"boundary {boundary} needs an even longitude count, got {w}",
                "use another boundary",
            )
        try:
            self._plan = plan_for(spec.sizes, before, after, boundary, rank)
        except Exception as err:
            raise _error(
                rank, f"{where}: {err}", "use a smaller halo or another boundary"
            ) from None
        self.halo = (before[rank], after[rank])
        self.rows = (spec.start(rank) - before[rank], spec.stop(rank) + after[rank])
        lat = first.lat
        self._flip = bool(
            lat_order == "north_to_south" and lat is not None and len(lat) > 1 and lat[0] < lat[-1]
        )
        self.latitudes = None if lat is None else (lat[::-1] if self._flip else lat).copy()
        self.longitudes = first.lon
        self.times = (
            None if any(i.time is None for i in infos) else np.concatenate([i.time for i in infos])
        )
        self._starts = np.cumsum([0] + [i.n_time for i in infos]).tolist()
        self.n_times = self._starts[-1]
        self._sources_in = self._sources(self._inputs, first)
        self._sources_out = self._sources(self._outputs, first)
        self.channels = [c for _, _, names in self._sources_in for c in names]
        self.target_channels = [c for _, _, names in self._sources_out for c in names]
        self._all_channels = list(dict.fromkeys(self.channels + self.target_channels))
        self.attributes: dict[str, dict[str, str]] = {}
        for (name, levels), (_, _, names) in zip(
            self._inputs + self._outputs, self._sources_in + self._sources_out, strict=True
        ):
            shape = first.shapes[name]
            every = tuple(range(shape[1])) if len(shape) == 4 else ()
            attrs = _channel_attributes(name, levels if levels is not None else every, first)
            self.attributes.update(zip(names, attrs, strict=True))

    @staticmethod
    def _sources(
        variables: list[tuple[str, tuple[int, ...] | None]], info: _FileInfo
    ) -> list[tuple[str, Any, list[str]]]:
        """(name, index along the level axis or None, channel names) per variable."""
        out = []
        for name, levels in variables:
            shape = info.shapes[name]
            n_levels = shape[1] if len(shape) == 4 else 0
            chosen = levels if levels is not None else tuple(range(n_levels))
            index: Any = None
            if n_levels:
                contiguous = chosen == tuple(range(chosen[0], chosen[-1] + 1))
                index = slice(chosen[0], chosen[-1] + 1) if contiguous else list(chosen)
            out.append((name, index, _channel_names(name, n_levels, chosen, info.levels.get(name))))
        return out

    def _statistics(
        self,
        normalize: str | Mapping[str, tuple[float, float]] | None,
        infos: list[_FileInfo],
        t: Transport | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-channel mean and std of every channel read (inputs and targets)."""
        if normalize is None or normalize is False:
            return None, None
        channels = self._all_channels
        if normalize == "compute":
            return self._compute_statistics(t)
        if isinstance(normalize, Mapping):
            missing = [c for c in channels if c not in normalize]
            if missing:
                raise _error(
                    self.rank,
                    f"normalize has no (mean, std) for channels {missing}",
                    f"give every channel of {channels}",
                )
            pairs = [normalize[c] for c in channels]
        elif normalize == "stored":
            pairs = []
            for name, index, names in self._sources_in + self._sources_out:
                mean, std = infos[0].stats[name]
                if mean is None or std is None:
                    raise _error(
                        self.rank,
                        f"{self.paths[0]}: variable {name} has no 'mean'/'std' attributes",
                        "use normalize='compute', a mapping {channel: (mean, std)}, or None",
                    )
                mean, std = np.atleast_1d(mean), np.atleast_1d(std)
                sel = slice(None) if index is None else index
                pairs += list(
                    zip(
                        mean[sel] if len(mean) > 1 else mean.repeat(len(names)),
                        std[sel] if len(std) > 1 else std.repeat(len(names)),
                        strict=True,
                    )
                )
            pairs = list(
                dict(zip(self.channels + self.target_channels, pairs, strict=True)).values()
            )
        else:
            raise _error(
                self.rank,
                f"normalize={normalize!r} is not understood",
                "pass 'stored', 'compute', a mapping {channel: (mean, std)} or None",
            )
        stats = torch.tensor(pairs, dtype=torch.float64)
        return stats[:, 0], stats[:, 1]

    def _compute_statistics(self, t: Transport | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std over all times and rows: each rank reads its own band (no halo) for
        its share of the times (split over data-parallel ranks); (count, mean, M2) per channel
        merged over the world in float64. Collective."""
        dp_rank, dp_size = self._dp
        start, stop = self.spec.start(self.rank), self.spec.stop(self.rank)
        sources = self._distinct_sources()
        n = 0
        mean = np.zeros(len(self._all_channels))
        m2 = np.zeros(len(self._all_channels))
        for time in range(dp_rank, self.n_times, dp_size):
            block = self._read_rows(time, sources, start, stop).reshape(len(mean), -1)
            k = block.shape[1]
            if k == 0:
                continue
            bm = block.mean(axis=1, dtype=np.float64)
            bm2 = ((block - bm[:, None]) ** 2).sum(axis=1, dtype=np.float64)
            delta = bm - mean
            total = n + k
            mean = mean + delta * (k / total)
            m2 = m2 + bm2 + delta**2 * (n * k / total)
            n = total
        self._close()
        parts = [(n, mean, m2)] if t is None else t.all_gather_object((n, mean, m2))
        n_all, mean_all, m2_all = 0, np.zeros_like(mean), np.zeros_like(m2)
        for k, bm, bm2 in parts:
            if k == 0:
                continue
            delta, total = bm - mean_all, n_all + k
            mean_all = mean_all + delta * (k / total)
            m2_all = m2_all + bm2 + delta**2 * (n_all * k / total)
            n_all = total
        std = np.sqrt(m2_all / max(n_all, 1))
        return torch.from_numpy(mean_all), torch.from_numpy(np.where(std > 0, std, 1.0))

    def _distinct_sources(self) -> list[tuple[str, Any, list[str]]]:
        """One source per channel of ``_all_channels``, in that order."""
        seen: dict[str, tuple[str, Any, list[str]]] = {}
        for name, index, names in self._sources_in + self._sources_out:
            seen.setdefault(",".join(names), (name, index, names))
        out = list(seen.values())
        assert [c for *_, names in out for c in names] == self._all_channels
        return out

    # -- reading --------------------------------------------------------------------------------

    def _file(self, time: int) -> tuple[h5py.File, int]:
        if self._pid != os.getpid():  # a new DataLoader worker: its own handles
            self._handles, self._pid = {}, os.getpid()
        k = bisect.bisect_right(self._starts, time) - 1
        path = self.paths[k]
        f = self._handles.get(path)
        if f is None:
            try:
                f = self._handles[path] = self.opener(path)
            except (OSError, KeyError, ValueError) as err:
                raise _error(
                    self.rank,
                    f"{path} (time index {time}) cannot be opened any more: {describe_error(err)}",
                    "it was readable when the dataset was built: was it moved, deleted or "
                    "purged from scratch since? Restore it, or rebuild the dataset",
                ) from err
        return f, time - self._starts[k]

    def _read_rows(
        self, time: int, sources: list[tuple[str, Any, list[str]]], lo: int, hi: int
    ) -> np.ndarray:
        """Channels x rows ``[lo, hi)`` (presented order, inside the field) x lon at ``time``."""
        f, local = self._file(time)
        h = self.grid[0]
        a, b = (h - hi, h - lo) if self._flip else (lo, hi)
        blocks = []
        for name, index, _ in sources:
            try:
                d = f[name]
                if index is None:
                    blocks.append(d[local, a:b, :][None])
                else:
                    blocks.append(d[local, index, a:b, :])
            except (OSError, KeyError, ValueError) as err:
                raise _error(
                    self.rank,
                    f"reading {name!r} rows {a}:{b} at time index {local} of {f.filename} "
                    f"failed: {describe_error(err)}",
                    "the file changed or broke after the dataset was built (truncated, "
                    "overwritten, on a file system that went away?); restore it",
                ) from err
        out = np.concatenate(blocks, axis=0) if len(blocks) > 1 else blocks[0]
        return out[:, ::-1].copy() if self._flip else out

    def _normalised(self, raw: np.ndarray, channels: list[str]) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(raw)).to(self.dtype)
        if self.mean is None or self.std is None:
            return x
        idx = [self._all_channels.index(c) for c in channels]
        mean = self.mean[idx].to(self.dtype).view(-1, 1, 1)
        std = self.std[idx].to(self.dtype).view(-1, 1, 1)
        return (x - mean) / std

    def read_band(self, time: int) -> torch.Tensor:
        """The input channels at ``time``: rows ``self.rows`` (band plus halo, boundary rows
        filled), normalised, shape ``(len(channels), rows, lon)``. Reads only the rows in the
        field that those rows come from (one hyperslab per run of rows)."""
        pl, offs = self._plan, self.spec.offsets
        pieces: list[tuple[int, Piece]] = [(offs[p.owner] + p.lo, p) for p in pl.local] + [
            (offs[p.owner] + p.lo, p) for _, p in pl.remote
        ]
        runs: list[list[int]] = []  # merged global row runs [lo, hi)
        for g, p in sorted(pieces, key=lambda gp: gp[0]):
            if runs and g <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], g + p.rows)
            else:
                runs.append([g, g + p.rows])
        data = [
            self._normalised(self._read_rows(time, self._sources_in, lo, hi), self.channels)
            for lo, hi in runs
        ]
        if len(pieces) == 1 and not pl.zeros and pieces[0][1] == Piece(self.rank, 0, pl.length, 0):
            return data[0]  # the band alone: no placement copy
        c, w = len(self.channels), self.grid[1]
        out = torch.empty((c, pl.length, w), dtype=self.dtype)
        for at, n in pl.zeros:
            out.narrow(1, at, n).zero_()
        for g, p in pieces:
            k = next(i for i, (lo, hi) in enumerate(runs) if lo <= g < hi)
            src = data[k].narrow(1, g - runs[k][0], p.rows)
            place_piece(out, src, p, 1, 2, w // 2)
        return out

    def __len__(self) -> int:
        return max(0, self.n_times - (self.input_steps - 1) - self.lead_time)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} of a dataset of {n} samples")
        index %= n
        steps = [self.read_band(index + k) for k in range(self.input_steps)]
        x = torch.cat(steps, 0) if len(steps) > 1 else steps[0]
        target_time = index + self.input_steps - 1 + self.lead_time
        start, stop = self.spec.start(self.rank), self.spec.stop(self.rank)
        raw = self._read_rows(target_time, self._sources_out, start, stop)
        return x, self._normalised(raw, self.target_channels)

    def sample_time(self, index: int) -> Any:
        """The time coordinate of the last input step of sample ``index`` (None without one)."""
        t = index % len(self) + self.input_steps - 1
        return None if self.times is None else self.times[t]

    def _close(self) -> None:
        for f in getattr(self, "_handles", {}).values():
            try:
                f.close()
            except Exception:
                pass
        self._handles = {}

    def __del__(self) -> None:
        self._close()

    def close(self) -> None:
        """Close the file handles of this process (they are reopened on the next read)."""
        self._close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"], state["_pid"] = {}, -1
        return state

    def __repr__(self) -> str:
        return (
            f"ShardedH5Dataset({len(self)} samples, channels {self.channels} -> "
            f"{self.target_channels}, grid {self.grid}, rows {self.rows} of rank {self.rank})"
        )


def _error(rank: int, what: str, fix: str) -> DataError:
    what = re.sub(r"(^|: )rank \d+: ", r"\1", what)  # one rank prefix, in front
    return DataError(f"rank {rank}: {what}; fix: {fix}")


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
