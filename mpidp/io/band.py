"""The band reader's format-independent core: items, halo and polar rows, level selection,
normalisation. A storage format plugs in as a :class:`~mpidp.io.source.FieldSource`, which
describes its parts (files, stores) once and then reads rows ``[lo, hi)`` of one variable at
one time.

:class:`~mpidp.io.ShardedH5Dataset` (HDF5/netCDF-4) and
:class:`~mpidp.io.ShardedZarrDataset` (Zarr) are this class over their sources.
"""

from __future__ import annotations

import atexit
import bisect
import os
import weakref
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mpidp.comm import Transport
from mpidp.errors import DataError
from mpidp.io._common import check_everywhere, describe_error, error
from mpidp.io.block_cut import Halo, assemble, axis_cut, field_blocks, manager_blocks
from mpidp.io.source import FieldSource, PartInfo, ReadFailure
from mpidp.ops.halo_plan import Boundary
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized
from mpidp.runtime.partition import ShardSpec
from mpidp.runtime.rebalance import follow_partition

__all__ = ["BandDataset", "Variables"]

Variables = str | Sequence[str | tuple[str, Sequence[int]]] | None
Normalize = str | Mapping[str, tuple[float, float]] | None


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


def _channel_attributes(name: str, levels: tuple[int, ...], info: PartInfo) -> list[dict[str, str]]:
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


def _monotonic(lat: Any) -> bool:
    step = np.diff(np.asarray(lat, dtype=np.float64))
    return bool(np.all(step > 0) or np.all(step < 0))


_LIVE: weakref.WeakSet[BandDataset] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close open handles before the interpreter tears down (file objects passed to h5py must
    outlive the HDF5 files that use them)."""
    for ds in list(_LIVE):
        ds.close()


#: how many worker pids a reader keeps (worker ids beyond share slots: any live one refuses)
_WORKER_SLOTS = 64


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a worker that ended was joined by its DataLoader)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BandDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Input/target pairs of one latitude band, read from the :class:`FieldSource` that a
    subclass makes of ``paths`` (:meth:`_source`); the item contract and the parameters are
    :class:`~mpidp.io.ShardedH5Dataset`'s. Construction is collective over the world."""

    def __init__(
        self,
        paths: Any,
        variables: Variables = None,
        manager: DistributedManager | None = None,
        *,
        opener: Callable[[str], Any] | None = None,
        targets: Variables = None,
        lead_time: int = 1,
        input_steps: int = 1,
        halo: Halo = 0,
        boundary: Any = "zeros",
        spec: ShardSpec | Sequence[int] | BlockSpec | None = None,
        grid: tuple[int, int] | None = None,
        normalize: Normalize = "stored",
        lat_order: str = "north_to_south",
        dtype: torch.dtype = torch.float32,
        stats_stride: int = 1,
        lon_halo: Halo = 0,
        lon_boundary: Any = "circular",
    ) -> None:
        self.source = source = self._source(paths, opener)
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
        lon_b = self._lon_boundary(lon_boundary, problems)
        facts = {
            f"{source.part_word}s": [i.fingerprint for i in infos]
            if len(infos) == len(source.labels)
            else "unreadable",
            "variables": self._inputs,
            "targets": self._outputs,
            "lead_time, input_steps": (self.lead_time, self.input_steps),
            "halo": repr(halo),
            "boundary": b,
            "lon_halo, lon_boundary": (repr(lon_halo), lon_b),
            "spec": None if spec is None or isinstance(spec, BlockSpec) else list(spec),
            "blocks": repr(spec) if isinstance(spec, BlockSpec) else None,
            "grid": grid,
            "normalize": repr(normalize),
            "lat_order": lat_order,
        }
        check_everywhere(
            t,
            problems,
            facts,
            f"{type(self).__name__} over {source.labels} cannot be read as asked",
            source.fix,
        )
        self._halo_arg, self._lon_halo_arg, self.lon_boundary = halo, lon_halo, lon_b
        self._setup(infos, grid, spec, manager, b, lat_order)
        self.mean, self.std = self._statistics(normalize, infos, t)
        _LIVE.add(self)

    # -- construction -------------------------------------------------------------------------

    @abstractmethod
    def _source(self, paths: Any, opener: Callable[[str], Any] | None) -> FieldSource:
        """The format's source over ``paths`` (what the user passed), opened by ``opener``."""

    def _inspect(
        self,
        inputs: list[tuple[str, tuple[int, ...] | None]],
        outputs: list[tuple[str, tuple[int, ...] | None]],
        problems: list[str],
    ) -> list[PartInfo]:
        infos = self.source.inspect([n for n, _ in inputs], [n for n, _ in outputs], problems)
        if not inputs and infos:
            inputs = [(n, None) for n in infos[0].variables]
        self._inputs, self._outputs = inputs, outputs or inputs
        if infos and len(infos) == len(self.source.labels):
            self._consistent(infos, problems)
        return infos

    def _consistent(self, infos: list[PartInfo], problems: list[str]) -> None:
        """Every variable of every part on the same (lat, lon) grid; times agree in a part;
        levels asked for exist; latitudes monotonic."""
        first = infos[0]
        g0 = next(iter(first.shapes.values()))[-2:]
        for info in infos:
            for n, shape in info.shapes.items():
                if shape[-2:] != g0:
                    problems.append(
                        f"{info.label}: {n} has a (lat, lon) grid of {shape[-2:]}, "
                        f"{first.label} has {g0}"
                    )
                if shape[0] != info.n_time:
                    problems.append(f"{info.label}: {n} has {shape[0]} times, others {info.n_time}")
                if shape[1:-2] != first.shapes[n][1:-2]:
                    problems.append(
                        f"{info.label}: {n} has shape {shape}, {first.label} has {first.shapes[n]}"
                    )
            if info.lat is not None and len(info.lat) > 1 and not _monotonic(info.lat):
                name = next(iter(info.shapes))
                problems.append(
                    f"{info.label}: the latitude coordinate of {name!r} is not monotonic "
                    f"({np.asarray(info.lat)[:8].tolist()}...): a band of rows would not be a "
                    f"band of latitudes; sort the data by latitude (xarray: ds.sortby('latitude')) "
                    f"and write it again"
                )
        for name, levels in self._inputs + self._outputs:
            shape = first.shapes[name]
            if levels is not None and (len(shape) == 3 or max(levels) >= shape[1]):
                problems.append(
                    f"{name}: level indices {list(levels)} do not exist in its shape {shape}"
                )

    @staticmethod
    def _lon_boundary(boundary: Any, problems: list[str]) -> Boundary:
        """The longitude boundary (any non-polar kind; the polar fold is the latitude's)."""
        try:
            b = Boundary.of(boundary)
        except Exception as err:
            problems.append(f"lon_boundary: {err}")
            return Boundary("circular", "circular")
        if b.polar:
            problems.append(
                f"lon_boundary={boundary!r}: the polar fold is a latitude boundary (boundary=); "
                f"the longitude wraps (lon_boundary='circular')"
            )
        return b

    def _setup(
        self,
        infos: list[PartInfo],
        grid: tuple[int, int] | None,
        spec: ShardSpec | Sequence[int] | BlockSpec | None,
        manager: DistributedManager | None,
        boundary: Boundary,
        lat_order: str,
    ) -> None:
        """Derived from facts every rank agreed on, so every rank raises alike (no hang)."""
        rank = 0 if manager is None else manager.domain_rank
        first = infos[0]
        h, w = next(iter(first.shapes.values()))[-2:]
        where = f"{first.label} ({h} x {w})"
        if grid is not None and tuple(grid) != (h, w):
            raise error(
                rank,
                f"{first.label} holds a {h} x {w} (lat x lon) grid but the model expects "
                f"{tuple(grid)} (the grid argument)",
                "use the files of the model's resolution, or build the model for the files' grid",
            )
        self.rank, self.grid = rank, (h, w)
        self.boundary = boundary
        if boundary.polar and w % 2:
            raise error(
                rank,
                f"boundary {boundary} needs an even longitude count, got {w}",
                "use another boundary",
            )
        # a cut the manager gave follows its partition (manager.set_partition), a spec passed
        # in stays
        self._follows = manager if spec is None and manager is not None else None
        self._policy = getattr(manager, "partition", None)
        # A DataLoader worker process reads with a copy of this reader that set_partition
        # cannot reach: each records its pid here (shared memory) at its first item, and
        # set_partition refuses while one of them lives (partition_refusal)
        self._home = os.getpid()
        self._workers: torch.Tensor | None = None
        if self._follows is not None:
            self._workers = torch.zeros(_WORKER_SLOTS, dtype=torch.int64).share_memory_()
            follow_partition(self._follows, self._follow)
        self._cut(field_blocks(spec, manager, (h, w), where), where)
        lat = first.lat
        self._flip = bool(
            lat_order == "north_to_south" and lat is not None and len(lat) > 1 and lat[0] < lat[-1]
        )
        self.latitudes: Any = None if lat is None else np.array(lat[::-1] if self._flip else lat)
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
        self._labels = [i.label for i in infos]
        self._packing = [i.packing for i in infos]  # per part: files may pack differently
        self.attributes: dict[str, dict[str, str]] = {}
        for (name, levels), (_, _, names) in zip(
            self._inputs + self._outputs, self._sources_in + self._sources_out, strict=True
        ):
            shape = first.shapes[name]
            every = tuple(range(shape[1])) if len(shape) == 4 else ()
            attrs = _channel_attributes(name, levels if levels is not None else every, first)
            self.attributes.update(zip(names, attrs, strict=True))

    def _cut(self, blocks: BlockSpec, where: str) -> None:
        """This rank's block, halo and read plan under ``blocks`` (bands: the grid
        ``(P, 1)``)."""
        i_lat, i_lon = blocks.coords(self.rank)

        def fail(what: str, fix: str) -> DataError:
            return error(self.rank, f"{where}: {what}", fix)

        self._rows = axis_cut(blocks.lat, i_lat, self._halo_arg, self.boundary, fail, "latitude")
        self._cols = axis_cut(
            blocks.lon, i_lon, self._lon_halo_arg, self.lon_boundary, fail, "longitude"
        )
        self.blocks, self.spec, self.lon_spec = blocks, blocks.lat, blocks.lon
        self.halo, self.lon_halo = self._rows.halo, self._cols.halo
        self.rows, self.columns = self._rows.span, self._cols.span

    def following(self) -> bool:
        """Whether a DataLoader worker process reading this reader lives (see
        :func:`mpidp.runtime.rebalance.follow_partition`)."""
        return bool(self._live_workers())

    def partition_refusal(self) -> str:
        """Why ``set_partition`` cannot go on while :meth:`following`."""
        pids = self._live_workers()
        return (
            f"{type(self).__name__} is read by {len(pids)} live DataLoader worker process(es) "
            f"(pids {pids}) holding the old cut: items they read, and those they read ahead, "
            "would keep the old rows (fix: call set_partition between epochs with "
            "persistent_workers=False, so that each epoch's workers start from the new cut, or "
            "read with num_workers=0 or through mpidp.io.Prefetcher, which follows)"
        )

    def _follow(self, old: Any, new: Any) -> None:
        """Never called with live workers (refused); this process follows at its next item."""

    def _live_workers(self) -> list[int]:
        """The pids of the live worker processes that read this reader. Local."""
        if self._workers is None:
            return []
        return [pid for pid in self._workers.tolist() if pid and _alive(pid)]

    def _note_worker(self) -> None:
        """In a worker process, at its first item: record its pid (see __init__)."""
        assert self._workers is not None
        info = torch.utils.data.get_worker_info()
        self._home = os.getpid()
        self._workers[(info.id if info is not None else 0) % _WORKER_SLOTS] = self._home

    def _follow_partition(self) -> None:
        """Re-cut when the manager's partition changed since the last item (one identity
        check per item): the next item is read with the new blocks. Local."""
        if self._workers is not None and self._home != os.getpid():
            self._note_worker()
        m = self._follows
        if m is None or m.partition is self._policy:
            return
        self._policy = m.partition
        h, w = self.grid
        self._cut(manager_blocks(m, (h, w)), f"{self._labels[0]} ({h} x {w})")

    @staticmethod
    def _sources(
        variables: list[tuple[str, tuple[int, ...] | None]], info: PartInfo
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
        self, normalize: Normalize, infos: list[PartInfo], t: Transport | None
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
                raise error(
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
                    raise error(
                        self.rank,
                        f"{infos[0].label}: variable {name} has no 'mean'/'std' attributes",
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
            raise error(
                self.rank,
                f"normalize={normalize!r} is not understood",
                "pass 'stored', 'compute', a mapping {channel: (mean, std)} or None",
            )
        stats = torch.tensor(pairs, dtype=torch.float64)
        return stats[:, 0], stats[:, 1]

    def _compute_statistics(self, t: Transport | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std over all times and rows: each rank reads its own block (no halo) for
        its share of the times (split over data-parallel ranks); (count, mean, M2) per channel
        merged over the world in float64. Collective."""
        dp_rank, dp_size = self._dp
        rows, cols = self._rows.own, self._cols.own
        sources = self._distinct_sources()
        n = 0
        mean = np.zeros(len(self._all_channels))
        m2 = np.zeros(len(self._all_channels))
        for time in range(dp_rank, self.n_times, dp_size):
            block = self._read(time, sources, *rows, *cols).reshape(len(mean), -1)
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
        self.source.close()
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

    def _read(
        self,
        time: int,
        sources: list[tuple[str, Any, list[str]]],
        lo: int,
        hi: int,
        c0: int,
        c1: int,
    ) -> np.ndarray:
        """Channels x rows ``[lo, hi)`` (presented order, inside the field) x columns
        ``[c0, c1)`` at ``time``."""
        part = bisect.bisect_right(self._starts, time) - 1
        local = time - self._starts[part]
        h = self.grid[0]
        a, b = (h - hi, h - lo) if self._flip else (lo, hi)
        blocks = []
        for name, index, _ in sources:
            unpack = self._packing[part].get(name)
            try:
                block = self.source.read(part, name, local, index, a, b, c0, c1)
                blocks.append(block if unpack is None else unpack.apply(block))
            except ReadFailure as err:
                raise error(self.rank, err.what, err.fix) from err
            except self.source.errors as err:
                raise error(
                    self.rank,
                    f"reading {name!r} rows {a}:{b}, columns {c0}:{c1} at time index {local} "
                    f"of {self._labels[part]} failed: {describe_error(err)}",
                    self.source.broken,
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
        """The input channels at ``time``: rows ``self.rows`` by columns ``self.columns``
        (block plus halo, entries beyond the edges filled as
        :func:`~mpidp.ops.block_halo.block_halo_exchange` fills them), normalised, shape
        ``(len(channels), rows, columns)``; on bands the columns are every longitude. Reads
        only the field entries those come from (one read per run of rows, run of columns and
        variable). The blocks are the manager's current cut (after
        ``manager.set_partition``, the new one)."""
        self._follow_partition()

        def read(lo: int, hi: int, c0: int, c1: int) -> torch.Tensor:
            raw = self._read(time, self._sources_in, lo, hi, c0, c1)
            return self._normalised(raw, self.channels)

        return assemble(read, self._rows, self._cols, self.grid)

    def __len__(self) -> int:
        return max(0, self.n_times - (self.input_steps - 1) - self.lead_time)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} of a dataset of {n} samples")
        index %= n
        self._follow_partition()
        steps = [self.read_band(index + k) for k in range(self.input_steps)]
        x = torch.cat(steps, 0) if len(steps) > 1 else steps[0]
        target_time = index + self.input_steps - 1 + self.lead_time
        raw = self._read(target_time, self._sources_out, *self._rows.own, *self._cols.own)
        return x, self._normalised(raw, self.target_channels)

    def sample_time(self, index: int) -> Any:
        """The time coordinate of the last input step of sample ``index`` (None without one)."""
        t = index % len(self) + self.input_steps - 1
        return None if self.times is None else self.times[t]

    def close(self) -> None:
        """Close the handles of this process (they are reopened on the next read)."""
        source = self.__dict__.get("source")
        if source is not None:
            source.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self)} samples, channels {self.channels} -> "
            f"{self.target_channels}, grid {self.grid}, rows {self.rows}, columns "
            f"{self.columns} of rank {self.rank})"
        )
