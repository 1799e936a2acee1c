"""CREDIT's ``HaloExchange`` module: mpidp's halo exchange with zero rows beyond the edges."""

from __future__ import annotations

import torch

from mpidp.ops.halo import HaloExchange as _Core

__all__ = ["HaloExchange"]


class HaloExchange(_Core):
    """Pads this rank's band with ``halo_width`` rows of each neighbour along ``dim`` (zero
    rows beyond the first and last rank), differentiably. Unlike CREDIT's, any width works,
    also wider than a neighbour's band (the rows come from further ranks). Collective over
    the domain group."""

    def __init__(self, halo_width: int, dim: int = -2) -> None:
        super().__init__(halo_width, dim, "zeros")
        self.halo_width = halo_width

    @staticmethod
    def trim(x: torch.Tensor, halo_before: int, halo_after: int, dim: int = -2) -> torch.Tensor:
        """``x`` without ``halo_before`` leading and ``halo_after`` trailing rows along ``dim``."""
        return x.narrow(dim, halo_before, x.size(dim) - halo_before - halo_after)
