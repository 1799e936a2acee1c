"""The plot of docs/benchmarks.md: U-Net time per step and memory per rank against P, with the
ideal lines, from the JSON the benchmarks wrote.

    python bench/plot.py      # reads docs/bench/unet.json and memory.json, writes scaling.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench"


def main() -> None:
    unet = json.loads((DOCS / "unet.json").read_text())
    memory = json.loads((DOCS / "memory.json").read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    runs = [r for r in unet if r["mode"] == "mpidp"]
    band = [r for r in unet if r["mode"] == "band"]
    ps = [r["ranks"] for r in runs]
    t1 = runs[0]["s"]
    left.plot(ps, [r["s"] for r in runs], "o-", label="mpidp (converted U-Net)")
    left.plot(
        [r["ranks"] for r in band], [r["s"] for r in band], "s--", label="plain model on one band"
    )
    left.plot(ps, [t1 / p for p in ps], "k:", label="ideal: P = 1 time / P")
    left.set(xlabel="ranks P", ylabel="s per training step", xticks=ps)
    left.set_title("U-Net 721 x 1440 on 2 cores (P = 4 oversubscribed)", fontsize=10)
    left.legend(fontsize=8)
    for name in sorted({r["model"] for r in memory}):
        rows = [r for r in memory if r["model"] == name]
        right.plot(
            [r["ranks"] for r in rows], [r["saved_of_serial"] for r in rows], "o-", label=name
        )
    ps = sorted({r["ranks"] for r in memory})
    right.plot(ps, [1 / p for p in ps], "k:", label="ideal 1 / P")
    right.set(xlabel="ranks P", ylabel="saved for backward, of serial", xticks=ps)
    right.set_title("bytes saved for backward, fullest rank", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "scaling.png", dpi=90)
    print(DOCS / "scaling.png")


if __name__ == "__main__":
    main()
