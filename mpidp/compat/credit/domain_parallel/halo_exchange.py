"""CREDIT's ``HaloExchange`` module: mpidp's halo exchange with zero rows beyond the edges."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.compat.credit.domain_parallel.manager import layers_manager
from mpidp.ops.halo import HaloExchange as _Core
from mpidp.runtime.partition import ShardSpec

__all__ = ["HaloExchange"]


class HaloExchange(_Core):
    """Pads this rank's band with ``halo_width`` rows of each neighbour along ``dim`` (zero
    rows beyond the first and last rank), differentiably. Unlike CREDIT's, any width works,
    also wider than a neighbour's band (the rows come from further ranks). Collective over
    the domain group: the converted model's in progress, else the process-wide
    ``DomainParallelManager``'s (as CREDIT's reads it at each call), else mpidp's default."""

    def __init__(self, halo_width: int, dim: int = -2) -> None:
        super().__init__(halo_width, dim, "zeros")
        self.halo_width = halo_width

    def _args(self, spec: ShardSpec | Sequence[int] | None) -> dict[str, Any]:
        args = super()._args(spec)
        if args["manager"] is None and args["group"] is None:
            args["manager"] = layers_manager()
        return args

    @staticmethod
    def trim(x: torch.Tensor, halo_before: int, halo_after: int, dim: int = -2) -> torch.Tensor:
        """``x`` without ``halo_before`` leading and ``halo_after`` trailing rows along ``dim``."""
        return x.narrow(dim, halo_before, x.size(dim) - halo_before - halo_after)
