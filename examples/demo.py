"""Demo: a 181 x 360 field cut into latitude bands, one band per rank, checked against serial.

Run: mpiexec -n 4 python -m mpi4py examples/demo.py
Rank 0 scatters the field by the balanced rule (uneven at 4 ranks: 46, 45, 45, 45 rows), each
rank computes a cos(latitude)-weighted sum over its band, one all-reduce gives the global
weighted mean, and the bands are gathered back: both equal the single-process result.
"""

from __future__ import annotations

import argparse
import math

import torch

import mpidp
from mpidp.cli import HelpFormatter
from mpidp.runtime.partition import balanced_sizes, offsets

H, W = 181, 360


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)


def main(argv: list[str] | None = None) -> None:
    build_parser().parse_args(argv)
    manager = mpidp.init(domain_parallel_size=mpidp.DistributedManager.world_from_launcher())
    comm = manager.transport()
    sizes = balanced_sizes(H, comm.size)
    lat = torch.linspace(90.0, -90.0, H, dtype=torch.float64)
    field = None
    if comm.rank == 0:
        lon = torch.linspace(0.0, 359.0, W, dtype=torch.float64)
        field = torch.sin(torch.deg2rad(lat))[:, None] * torch.cos(torch.deg2rad(lon))[None, :]
        field = field + 2.0
    band = comm.scatter_v(field, sizes, dim=0, src=0)
    start = offsets(sizes)[comm.rank]
    weights = torch.cos(torch.deg2rad(lat[start : start + sizes[comm.rank]]))[:, None]
    partial = torch.stack([(band * weights).sum(), weights.sum() * W])
    total = comm.all_reduce(partial)
    mean = (total[0] / total[1]).item()
    gathered = comm.gather_v(band, sizes, dim=0, dst=0)
    if comm.rank == 0:
        assert field is not None and gathered is not None
        w_full = torch.cos(torch.deg2rad(lat))[:, None].expand(H, W)
        serial = ((field * w_full).sum() / w_full.sum()).item()
        shown = ", ".join(str(n) for n in sizes)
        print(
            f"demo: bands of {shown} rows on {comm.size} rank(s), launcher "
            f"{manager.launch_info.launcher}, {comm.name} transport"
        )
        print(f"area-weighted mean: distributed {mean:.15f}, serial {serial:.15f}")
        assert math.isclose(mean, serial, rel_tol=1e-13), (mean, serial)
        assert torch.equal(gathered, field)
        print("demo: distributed result equals the serial one")
    manager.shutdown()


if __name__ == "__main__":
    main()
