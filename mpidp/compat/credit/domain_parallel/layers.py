"""CREDIT's layer wrappers: each takes the module it replaces, as CREDIT's do, keeps CREDIT's
attribute names (and so its state_dict keys), and computes that module's serial function on
bands with mpidp's layers: exact for any kernel, stride, dilation and cut, where CREDIT's
halo widths are right for "same" convolutions on even bands."""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import nn

from mpidp.compat.credit.domain_parallel.halo_exchange import HaloExchange
from mpidp.compat.credit.domain_parallel.manager import layers_manager, on_layers_manager
from mpidp.layers import DomainParallelGroupNorm as _GroupNorm
from mpidp.layers import DomainParallelInterpolate as _Interpolate
from mpidp.parallel.convert import convert_to_domain_parallel as _convert
from mpidp.runtime.manager import DistributedManager, bound
from mpidp.sharded import ShardedTensor

__all__ = [
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelGroupNorm",
    "DomainParallelInterpolate",
    "DomainParallelPeriodicConv2d",
]


def from_end(shard_dim: int, ndim: int) -> int:
    """CREDIT's ``shard_dim`` (3 for H of (B, C, T, H, W), or -2) counted from the end."""
    return shard_dim - ndim if shard_dim >= 0 else shard_dim


def on_bands(module: nn.Module, shard_dim: int) -> Any:
    """``module`` made to compute its serial function on bands (mpidp's conversion, in place:
    the parameters are shared); a bare layer comes back as its domain-parallel layer."""
    return _convert(module, None, shard_dim)


def _halo_rows(conv: Any, axis: int) -> int:
    """CREDIT's ``halo_width`` attribute: the rows it exchanges on each side (kept for code
    that reads it; mpidp plans the layer's exchange from its whole geometry)."""
    k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
    if isinstance(conv, nn.modules.conv._ConvTransposeNd):
        return max(k - s, 0) // 2
    return d * (k - 1) // 2


class _Wrapped(nn.Module):
    """``self.conv``: the wrapped layer on bands; ``weight`` and ``bias`` are its own."""

    conv: nn.Module

    def __init__(self, conv: nn.Module, shard_dim: int, ndim: int) -> None:
        super().__init__()
        self.shard_dim = shard_dim
        self.conv = on_bands(conv, from_end(shard_dim, ndim))
        self.halo_exchange = HaloExchange(_halo_rows(conv, ndim - 4), dim=shard_dim)

    def forward(self, x: torch.Tensor) -> Any:
        with on_layers_manager():
            return self.conv(x)

    @property
    def weight(self) -> Any:
        return self.conv.weight

    @property
    def bias(self) -> Any:
        return self.conv.bias


class DomainParallelConv2d(_Wrapped):
    """``conv`` (an ``nn.Conv2d``) on bands of (B, C, H, W) cut along ``shard_dim``."""

    def __init__(self, conv: nn.Conv2d, shard_dim: int = -2) -> None:
        super().__init__(conv, shard_dim, 4)


class DomainParallelConv3d(_Wrapped):
    """``conv`` (an ``nn.Conv3d``) on bands of (B, C, T, H, W) cut along ``shard_dim``."""

    def __init__(self, conv: nn.Conv3d, shard_dim: int = 3) -> None:
        super().__init__(conv, shard_dim, 5)


class DomainParallelConvTranspose2d(_Wrapped):
    """``conv`` (an ``nn.ConvTranspose2d``) on bands; any kernel and stride."""

    def __init__(self, conv: nn.ConvTranspose2d, shard_dim: int = -2) -> None:
        super().__init__(conv, shard_dim, 4)
        self.halo_width = self.halo_exchange.halo_width


class DomainParallelConvTranspose3d(_Wrapped):
    """``conv`` (an ``nn.ConvTranspose3d``) on bands of (B, C, Z, H, W); any kernel, stride."""

    def __init__(self, conv: nn.ConvTranspose3d, shard_dim: int = 3) -> None:
        super().__init__(conv, shard_dim, 5)
        self.halo_width = self.halo_exchange.halo_width


class DomainParallelGroupNorm(_GroupNorm):
    """``norm`` (an ``nn.GroupNorm``) with statistics over the whole field; its parameters
    are ``norm``'s (shared), its state_dict keys CREDIT's (``weight``, ``bias``)."""

    def __new__(cls, *norm: nn.GroupNorm) -> Any:
        if not norm:  # from_module's own allocation
            return super().__new__(cls)
        return cls.from_module(norm[0])

    def __init__(self, norm: nn.GroupNorm) -> None:
        pass  # from_module took norm's state

    def own_manager(self) -> DistributedManager | None:
        """CREDIT's: the converted model's manager, else the process-wide one."""
        return self.dp_manager if self.dp_manager is not None else layers_manager()


DomainParallelGroupNorm.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    DomainParallelGroupNorm.__init__
).replace(
    parameters=list(inspect.signature(DomainParallelGroupNorm.__init__).parameters.values())[1:]
)


class DomainParallelInterpolate(nn.Module):
    """``F.interpolate`` of bands. CREDIT's ``size`` is the size of one rank's band when the
    bands are even: the serial result is ``F.interpolate(x, size=(P * size[0], size[1]),
    mode, align_corners=False)`` of the whole field, and each rank gets its band of it, on
    even and uneven cuts alike (CREDIT's 1-row halo and rescaled trim are close to it only
    for a factor of 2 away from the edges)."""

    def __init__(self, size: Any, mode: str = "bilinear", shard_dim: int = -2) -> None:
        super().__init__()
        self.size = size
        self.mode = mode
        self.shard_dim = shard_dim
        self.halo_exchange = HaloExchange(1, dim=shard_dim)

    def forward(self, x: torch.Tensor) -> Any:
        h, w = self.size if isinstance(self.size, (tuple, list)) else (self.size, self.size)
        m = layers_manager()
        m = bound(x.manager if m is None and isinstance(x, ShardedTensor) else m)
        corners = False if self.mode in ("linear", "bilinear", "bicubic", "trilinear") else None
        layer = _Interpolate(
            size=(h * m.domain_world_size, w), mode=self.mode, align_corners=corners
        )
        layer._dp_setup(m, from_end(self.shard_dim, x.dim()))
        return layer(x)


class DomainParallelPeriodicConv2d(nn.Module):
    """CREDIT's ``PeriodicConv2d`` (circular padding along W, reflect along H, then its inner
    ``conv`` with no padding) on bands: its own forward runs on the whole field's bands, so
    the rows reflected at the poles are the serial ones (CREDIT's wrapper pads the poles with
    zeros instead). Keeps ``conv`` and ``padding``, and so CREDIT's state_dict keys."""

    def __init__(self, periodic_conv: nn.Module, shard_dim: int = -2) -> None:
        super().__init__()
        band = on_bands(periodic_conv, shard_dim)
        object.__setattr__(self, "_band_module", band)  # not a child: conv holds its weights
        self.conv = band.conv
        self.padding: int = int(periodic_conv.padding)  # type: ignore[arg-type]
        self.shard_dim = shard_dim
        self.halo_exchange = HaloExchange(self.padding, dim=shard_dim)

    def forward(self, x: torch.Tensor) -> Any:
        with on_layers_manager():
            return cast(Any, self)._band_module(x)

    @property
    def weight(self) -> Any:
        return self.conv.weight

    @property
    def bias(self) -> Any:
        return self.conv.bias
