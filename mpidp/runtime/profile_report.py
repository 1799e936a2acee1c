"""What :func:`mpidp.profile` measured, every rank's: a value object, its table, JSON and plot.

Pure (no communication): the all-gather happens in :mod:`mpidp.runtime.profile`;
``mpidp profile-report FILE.json`` reads the JSON back. Per rank and step the profile records
the step's wall seconds and the seconds inside mpidp's communication; from those alone:

* compute = step - communication;
* wait, the time spent for the slowest peer to arrive: the slowest rank's compute in that
  step less this rank's (no rank waits longer than it communicated, so at most its
  communication time);
* comm = communication - wait: the transfers themselves.

compute + comm + wait = step for every rank and step. The estimate assumes the ranks meet once
a step or that their work per step is spread alike between meetings (true of a training step,
whose gradient sync closes it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from mpidp.errors import ConfigError

__all__ = ["ProfileReport"]

_PARTS = ("compute", "comm", "wait")


@dataclasses.dataclass(frozen=True)
class ProfileReport:
    """``step[r][s]`` and ``communication[r][s]``: rank ``r``'s wall seconds of step ``s`` and
    its seconds inside communication in that step (ranks of the profiled group, in order; the
    same number of steps each)."""

    step: tuple[tuple[float, ...], ...]
    communication: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        shapes = {len(s) for s in self.step} | {len(c) for c in self.communication}
        if len(self.step) != len(self.communication) or len(shapes) > 1:
            raise ConfigError(
                f"a profile needs the same steps for every rank, got step counts "
                f"{[len(s) for s in self.step]} and communication counts "
                f"{[len(c) for c in self.communication]}"
            )

    @classmethod
    def of(cls, per_rank: Sequence[tuple[Sequence[float], Sequence[float]]]) -> ProfileReport:
        """From each rank's ``(steps, communication)``, cut to the fewest steps any rank
        recorded (a rank that profiled one step more than its peers)."""
        n = min((len(s) for s, _ in per_rank), default=0)
        return cls(
            tuple(tuple(float(v) for v in s[:n]) for s, _ in per_rank),
            tuple(tuple(float(v) for v in c[:n]) for _, c in per_rank),
        )

    @property
    def ranks(self) -> int:
        return len(self.step)

    @property
    def steps(self) -> int:
        return len(self.step[0]) if self.step else 0

    def parts(self) -> list[list[tuple[float, float, float]]]:
        """Per rank and step, ``(compute, comm, wait)`` seconds (see the module docstring)."""
        compute = [
            [max(s - c, 0.0) for s, c in zip(ss, cs, strict=True)]
            for ss, cs in zip(self.step, self.communication, strict=True)
        ]
        slowest = [max(col) for col in zip(*compute, strict=True)] if compute else []
        out = []
        for r, cs in enumerate(self.communication):
            row = []
            for k, c in enumerate(cs):
                wait = min(slowest[k] - compute[r][k], c)
                row.append((compute[r][k], c - wait, wait))
            out.append(row)
        return out

    def means(self) -> list[dict[str, float]]:
        """Per rank, the mean seconds per step of ``step``, ``compute``, ``comm`` and
        ``wait`` (zeros without steps)."""
        n = max(self.steps, 1)
        out = []
        for r, rows in enumerate(self.parts()):
            mean = {"step": sum(self.step[r]) / n}
            for i, name in enumerate(_PARTS):
                mean[name] = sum(row[i] for row in rows) / n
            out.append(mean)
        return out

    def rank_seconds(self) -> list[float]:
        """Each rank's mean compute seconds per step: what :func:`mpidp.rebalance` takes."""
        return [m["compute"] for m in self.means()]

    def table(self) -> str:
        """One line per rank: mean milliseconds per step of the step and its three parts."""
        lines = [
            f"profile: {self.ranks} rank{'s' if self.ranks != 1 else ''}, {self.steps} steps; "
            "mean ms per step",
            f"{'rank':>4}  {'step':>9}  {'compute':>9}  {'comm':>9}  {'wait':>9}",
        ]
        for r, m in enumerate(self.means()):
            lines.append(f"{r:>4}  " + "  ".join(f"{m[k] * 1e3:9.3f}" for k in ("step", *_PARTS)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "mpidp-profile-1",
            "ranks": self.ranks,
            "steps": self.steps,
            "step_seconds": [list(s) for s in self.step],
            "communication_seconds": [list(c) for c in self.communication],
            "mean_seconds": self.means(),
        }

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the per-step figures and the means (local: the caller picks the rank)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ProfileReport:
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != "mpidp-profile-1":
            raise ConfigError(
                f"{path} is not a profile written by mpidp.profile (no format "
                f"'mpidp-profile-1'); pass the file prof.to_json wrote"
            )
        per_rank = list(zip(doc["step_seconds"], doc["communication_seconds"], strict=True))
        return cls(tuple(tuple(s) for s, _ in per_rank), tuple(tuple(c) for _, c in per_rank))

    def plot(self, path: str | os.PathLike[str]) -> None:
        """One bar per rank, stacked compute, comm and wait (mean ms per step); needs
        matplotlib (``pip install mpidp[examples]``). Local."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ConfigError(
                "the profile plot needs matplotlib; pip install 'mpidp[examples]'"
            ) from None
        means = self.means()
        fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * self.ranks + 2), 3.5))
        bottom = [0.0] * self.ranks
        for name, colour in zip(_PARTS, ("tab:blue", "tab:orange", "tab:red"), strict=True):
            height = [m[name] * 1e3 for m in means]
            ax.bar(range(self.ranks), height, bottom=bottom, label=name, color=colour)
            bottom = [b + h for b, h in zip(bottom, height, strict=True)]
        ax.set_xticks(range(self.ranks))
        ax.set_xlabel("rank")
        ax.set_ylabel("ms per step")
        ax.set_title(f"mpidp profile, {self.steps} steps")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
