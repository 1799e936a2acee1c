"""PhysicsNeMo's ``physicsnemo.distributed.fft`` over :mod:`mpidp.ops.fft`, in PhysicsNeMo's layout.

``DistributedRFFT2.apply(x, s, dim, norm)``: the real field is cut along ``dim[1]`` (the dim
``rfft2`` halves) over the ``"spatial_parallel"`` group; the spectrum comes out cut along
``dim[0]`` with the ``s[1] // 2 + 1`` modes whole. ``DistributedIRFFT2`` is the way back. Both
are mpidp's :func:`~mpidp.ops.fft.rfft2_halved_cut` /
:func:`~mpidp.ops.fft.irfft2_halved_cut`: exact
``torch.fft.rfft2`` / ``irfft2`` of the global field with torch's gradients (PhysicsNeMo's
inverse backward is not the exact adjoint), any extent over any rank count (the output is cut
by mpidp's balanced policy; :func:`mpidp.ops.fft.layout` of the output says how), ``s`` optional.
(mpidp's own :class:`mpidp.ops.fft.DistributedRFFT2` keeps mpidp's layout instead.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpidp.compat.physicsnemo.distributed.manager import DistributedManager, transport_for
from mpidp.ops import fft as core

__all__ = ["DistributedIRFFT2", "DistributedRFFT2"]

_GROUP = "spatial_parallel"


def _spatial(x: torch.Tensor) -> object:
    return transport_for(DistributedManager().group(_GROUP), x.device)


class DistributedRFFT2:
    """PhysicsNeMo's ``DistributedRFFT2.apply(x, s, dim, norm="ortho")``. Collective over the
    ``"spatial_parallel"`` group."""

    @staticmethod
    def apply(
        x: torch.Tensor, s: Sequence[int] | None, dim: Sequence[int], norm: str = "ortho"
    ) -> torch.Tensor:
        return core.rfft2_halved_cut(x, s, dim, norm, group=_spatial(x))


class DistributedIRFFT2:
    """PhysicsNeMo's ``DistributedIRFFT2.apply(x, s, dim, norm="ortho")``. Collective over the
    ``"spatial_parallel"`` group."""

    @staticmethod
    def apply(
        x: torch.Tensor, s: Sequence[int] | None, dim: Sequence[int], norm: str = "ortho"
    ) -> torch.Tensor:
        return core.irfft2_halved_cut(x, s, dim, norm, group=_spatial(x))
