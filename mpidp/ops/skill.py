"""Forecast skill on bands: per lead step, the latitude-weighted RMSE and anomaly correlation
(ACC) of a forecast and of two reference forecasts, persistence (the initial state kept) and
climatology (the mean state per grid point), each exact over the whole field.

Every score is one call of :func:`mpidp.global_rmse` or :func:`mpidp.global_acc` (sums over
every band, and over every forecast of the batch, reduced before the division), so a
domain-parallel evaluation gives the serial numbers for any cut. Anomalies are departures
from the climatology; the ACC is uncentred (the mean anomaly is not removed), as
:func:`mpidp.global_acc` defines it. The climatology has no ACC (its anomaly is zero).

Typical use, in physical units, on this rank's band::

    clim = climatology(dataset, range(n_train), manager)   # (C, rows, lon)
    meter = SkillMeter(dataset.channels, x0, clim, weights, manager,
                       units=[dataset.attributes[c].get("units", "") for c in channels])
    for step in range(1, n + 1):
        x = model_step(x)
        meter.add(step, x, truth_at(step))
    skill = meter.result()        # print(skill): one table per variable, one row per step
    skill.write_json("skill.json")
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.ops.training import global_acc, global_rmse
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized

__all__ = ["LeadScores", "Skill", "SkillMeter", "climatology", "physical_band"]

#: the scores of a :class:`LeadScores`, in the order the table shows them
SCORES = ("rmse", "rmse_persistence", "rmse_climatology", "acc", "acc_persistence")


@dataclasses.dataclass(frozen=True)
class LeadScores:
    """The scores of one variable at one lead step (RMSE in the variable's units)."""

    rmse: float
    rmse_persistence: float
    rmse_climatology: float
    acc: float
    acc_persistence: float

    def __repr__(self) -> str:
        return (
            f"LeadScores(rmse={self.rmse:.4g}, persistence {self.rmse_persistence:.4g}, "
            f"climatology {self.rmse_climatology:.4g}; acc={self.acc:.4f}, "
            f"persistence {self.acc_persistence:.4f})"
        )


@dataclasses.dataclass(frozen=True)
class Skill:
    """Scores per lead step and variable: ``scores[i][j]`` is step ``steps[i]`` of
    ``channels[j]``. ``forecasts``: how many forecasts (start times) each score pools;
    ``step_hours``: the hours between steps (None: unknown)."""

    channels: tuple[str, ...]
    units: tuple[str, ...]
    steps: tuple[int, ...]
    scores: tuple[tuple[LeadScores, ...], ...]
    forecasts: int
    step_hours: float | None = None

    def of(self, channel: str) -> list[LeadScores]:
        """The scores of ``channel``, one per lead step."""
        if channel not in self.channels:
            raise ConfigError(f"no channel {channel!r}; the skill has {list(self.channels)}")
        j = self.channels.index(channel)
        return [row[j] for row in self.scores]

    def beats(self, reference: str = "persistence", channel: str | None = None) -> bool:
        """Whether the forecast's RMSE is below ``reference``'s (``"persistence"`` or
        ``"climatology"``) at every lead step, for ``channel`` (default: every channel)."""
        if reference not in ("persistence", "climatology"):
            raise ConfigError(f"reference={reference!r}: use 'persistence' or 'climatology'")
        names = self.channels if channel is None else (channel,)
        return all(s.rmse < getattr(s, f"rmse_{reference}") for c in names for s in self.of(c))

    def verdict(self, channel: str | None = None) -> str:
        """One sentence, starting ``beats persistence`` (in every variable at every lead step)
        or ``does not beat persistence``: in how many variables the forecast's RMSE is below
        persistence's at every lead step ("at step 1" when there is one), the variables and
        first lead step where it is no better than climatology's (said only when there are
        some), and ``channel``'s scores at the last step (default ``t2m`` when there is one,
        else the first channel), e.g. ``beats persistence: better at every lead step in 6 of 6
        variables; no better than climatology in t500 from step 5 (30 h); t2m at step 8
        (48 h): RMSE 2.9 K, persistence 3.5 K, climatology 3.7 K``."""
        if channel is None:
            channel = "t2m" if "t2m" in self.channels else self.channels[0]
        last = self.of(channel)[-1]
        unit = self.units[self.channels.index(channel)]
        u = f" {unit}" if unit else ""
        won = [c for c in self.channels if self.beats("persistence", c)]
        lost = [c for c in self.channels if c not in won]
        n = len(self.channels)
        head = "beats" if not lost else "does not beat"
        which = f" (not in {', '.join(lost)})" if lost and won else ""
        when = "at every lead step" if len(self.steps) > 1 else f"at step {self.steps[0]}"
        return (
            f"{head} persistence: better {when} in {len(won)} of {n} "
            f"variable{'s' if n != 1 else ''}{which}; {self._climatology_clause()}"
            f"{channel} at step {self.steps[-1]}"
            f"{self._lead(self.steps[-1], ' (', ')')}: RMSE {last.rmse:.4g}{u}, persistence "
            f"{last.rmse_persistence:.4g}{u}, climatology {last.rmse_climatology:.4g}{u}"
        )

    def _climatology_clause(self) -> str:
        """``no better than climatology in t500 from step 5 (30 h); `` (each variable with
        its first lead step whose RMSE is not below climatology's), or empty."""
        level = []
        for c in self.channels:
            i = next((i for i, s in enumerate(self.of(c)) if s.rmse >= s.rmse_climatology), None)
            if i is not None and len(self.steps) > 1:
                step = self.steps[i]
                level.append(f"{c} from step {step}{self._lead(step, ' (', ')')}")
            elif i is not None:  # the step is said already ("better at step 1")
                level.append(c)
        return f"no better than climatology in {', '.join(level)}; " if level else ""

    def _lead(self, step: int, before: str = "", after: str = "") -> str:
        if self.step_hours is None:
            return ""
        return f"{before}{step * self.step_hours:g} h{after}"

    def table(self, channels: Sequence[str] | None = None) -> str:
        """Plain text: per channel a title line and one row per lead step."""
        blocks = []
        for c in channels if channels is not None else self.channels:
            unit = self.units[self.channels.index(c)]
            n = self.forecasts
            head = (
                f"{c}{f' ({unit})' if unit else ''}: latitude-weighted RMSE and anomaly "
                f"correlation of {n} forecast{'s' if n != 1 else ''}"
            )
            lead = self.step_hours is not None
            cols = f"{'step':>4}  {'lead':>6}  " if lead else f"{'step':>4}  "
            cols += "RMSE: forecast  persistence  climatology   ACC: forecast  persistence"
            lines = [head, cols]
            for step, s in zip(self.steps, self.of(c), strict=True):
                row = f"{step:>4}  {self._lead(step):>6}  " if lead else f"{step:>4}  "
                row += (
                    f"{s.rmse:>14.4g}  {s.rmse_persistence:>11.4g}  {s.rmse_climatology:>11.4g}"
                    f"   {s.acc:>13.4f}  {s.acc_persistence:>11.4f}"
                )
                lines.append(row)
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (
            f"Skill({len(self.steps)} lead steps x {len(self.channels)} channels "
            f"{list(self.channels)}, {self.forecasts} forecast{'s' if self.forecasts != 1 else ''})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``steps``, ``lead_hours``, ``forecasts`` and per variable its ``units``
        and one list per score (one value per lead step)."""
        return {
            "steps": list(self.steps),
            "lead_hours": None
            if self.step_hours is None
            else [s * self.step_hours for s in self.steps],
            "forecasts": self.forecasts,
            "variables": {
                c: {
                    "units": u,
                    **{k: [_finite(getattr(s, k)) for s in self.of(c)] for k in SCORES},
                }
                for c, u in zip(self.channels, self.units, strict=True)
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Skill:
        """The inverse of :meth:`to_dict`."""
        channels = tuple(d["variables"])
        steps = tuple(int(s) for s in d["steps"])
        hours = d.get("lead_hours")
        scores = tuple(
            tuple(
                LeadScores(**{k: _number(d["variables"][c][k][i]) for k in SCORES})
                for c in channels
            )
            for i in range(len(steps))
        )
        return cls(
            channels,
            tuple(d["variables"][c]["units"] for c in channels),
            steps,
            scores,
            int(d["forecasts"]),
            None if not hours else hours[0] / steps[0],
        )

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_dict` to ``path`` (atomically: a temporary file renamed). Local:
        call it on one rank."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no NaN


def _number(v: float | None) -> float:
    return math.nan if v is None else float(v)


def _batched(x: torch.Tensor, what: str, channels: int) -> torch.Tensor:
    """``x`` as float64 ``(batch, channels, rows, lon)``."""
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4 or x.size(1) != channels:
        raise ConfigError(
            f"{what} has shape {tuple(x.shape)}; expected ([batch,] {channels} channels, "
            f"rows, lon): this rank's band in physical units"
        )
    return x.double()


class SkillMeter:
    """Scores of one batch of forecasts, lead step by lead step.

    ``initial``: the initial states (persistence), ``([batch,] C, rows, lon)``;
    ``climatology``: ``(C, rows, lon)``; ``weights``: this band's latitude weights, ``(rows,
    1)`` (:func:`mpidp.latitude_weights`); all this rank's band, in physical units. ``group``
    pools the scores: default the domain group (one replica's forecasts); the world's
    transport pools every data-parallel replica's forecasts too (each then passes its own
    batch, of any size, even empty; pass ``forecasts``, their total, for the tables: the
    default is this rank's batch). Every method is collective over the group.
    """

    def __init__(
        self,
        channels: Sequence[str],
        initial: torch.Tensor,
        climatology: torch.Tensor,
        weights: torch.Tensor,
        manager: DistributedManager | None = None,
        *,
        units: Sequence[str] | None = None,
        step_hours: float | None = None,
        forecasts: int | None = None,
        group: Any = None,
    ) -> None:
        self.channels = tuple(channels)
        c = len(self.channels)
        self.units = tuple(units) if units is not None else ("",) * c
        if len(self.units) != c:
            raise ConfigError(f"{len(self.units)} units for {c} channels {list(self.channels)}")
        self.initial = _batched(initial, "initial", c)
        self.climatology = _batched(climatology, "climatology", c)
        self.weights = weights.double()
        self.manager, self.group, self.step_hours = manager, group, step_hours
        self.forecasts = self.initial.size(0) if forecasts is None else int(forecasts)
        self.rows: list[tuple[int, tuple[LeadScores, ...]]] = []

    def add(self, step: int, forecast: torch.Tensor, truth: torch.Tensor) -> tuple[LeadScores, ...]:
        """Score lead step ``step``: ``forecast`` and ``truth`` shaped like ``initial``.
        Returns the scores of each channel."""
        c = len(self.channels)
        f, y = _batched(forecast, "forecast", c), _batched(truth, "truth", c)
        if f.shape != self.initial.shape or y.shape != self.initial.shape:
            raise ConfigError(
                f"step {step}: forecast {tuple(f.shape)} and truth {tuple(y.shape)} must have "
                f"the shape of the initial states {tuple(self.initial.shape)}"
            )
        clim = self.climatology.expand_as(y)
        dims, w, m, g = (0, 2, 3), self.weights, self.manager, self.group
        rmse = [global_rmse(p, y, w, dims, m, group=g) for p in (f, self.initial, clim)]
        truth_anomaly = y - clim
        acc = [global_acc(p - clim, truth_anomaly, w, dims, m, group=g) for p in (f, self.initial)]
        scores = tuple(LeadScores(*(float(v[j]) for v in (*rmse, *acc))) for j in range(c))
        self.rows.append((int(step), scores))
        return scores

    def result(self) -> Skill:
        """The scores so far, ordered by lead step."""
        rows = sorted(self.rows, key=lambda r: r[0])
        return Skill(
            self.channels,
            self.units,
            tuple(s for s, _ in rows),
            tuple(r for _, r in rows),
            self.forecasts,
            self.step_hours,
        )


def climatology(
    dataset: Any,
    times: Sequence[int],
    manager: DistributedManager | None = None,
) -> torch.Tensor:
    """The mean state per grid point of ``dataset``'s input channels over ``times`` (time
    indices; e.g. the training times), on this rank's band, in physical units: float64
    ``(C, rows, lon)``. ``dataset``: a :class:`~mpidp.io.ShardedH5Dataset` (normalised or
    not; its halo rows are dropped).

    Each data-parallel replica reads its share of the times (every ``dp``-th) and one
    all-reduce over the data-parallel group sums them. Collective over the data-parallel
    group (local with one replica).
    """
    if manager is None and is_initialized():
        manager = get_manager()
    times = list(times)
    if not times:
        raise ConfigError("climatology over no times; pass the time indices to average")
    dp_rank, dp_size = (0, 1) if manager is None else (manager.dp_rank, manager.dp_world_size)
    h, w = dataset.blocks.block_shape(dataset.rank)  # this rank's rows x columns (bands: all)
    total = torch.zeros((len(dataset.channels), h, w), dtype=torch.float64)
    for t in times[dp_rank::dp_size]:  # none when there are more replicas than times
        total += physical_band(dataset, t)
    if dp_size > 1 and manager is not None:
        total = manager.transport("dp", "cpu").all_reduce(total, "sum")
    return total / len(times)


def physical_band(dataset: Any, time: int) -> torch.Tensor:
    """This rank's band of ``dataset``'s input channels at time index ``time`` (a
    :class:`~mpidp.io.ShardedH5Dataset`), halo rows dropped, in physical units (normalisation
    undone): float64 ``(C, rows, lon)``. Local: each rank reads its own rows (on blocks its
    rows x columns; the halo of both dropped)."""
    x = dataset.read_band(time).double()
    for d, (before, after) in ((1, dataset.halo), (2, dataset.lon_halo)):
        x = x.narrow(d, before, x.size(d) - before - after)
    if dataset.mean is None or dataset.std is None:
        return x
    c = len(dataset.channels)  # the first statistics: channels, then target-only ones
    return x * dataset.std[:c].double().view(-1, 1, 1) + dataset.mean[:c].double().view(-1, 1, 1)
