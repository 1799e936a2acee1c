"""Convolution on a global latitude-longitude grid: periodic in longitude, reflected (or
continued across the pole) in latitude.

:class:`PeriodicConv2d` is the serial module (the padding a global weather model wants, which
torch's ``padding_mode`` cannot express per dim); :class:`DomainParallelPeriodicConv2d` computes
the same on latitude bands: the latitude padding comes from the halo exchange with the matching
boundary, the longitude padding is local. On latitude x longitude blocks the longitude is a cut
dim too: one block halo exchange fetches both, and the rows beyond a pole come from the block
half a circle away in longitude (the polar fold of :mod:`mpidp.ops.block_halo`), another rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function_variadic

from mpidp.errors import ConfigError
from mpidp.layers.base import DomainParallel, band_forward, fetch_halo, learn_spec, with_rows
from mpidp.layers.conv import conv_kernel
from mpidp.layers.registry import register_layer
from mpidp.ops.geometry import HaloSpec, conv_output_size
from mpidp.runtime.partition import known_for

__all__ = ["DomainParallelPeriodicConv2d", "PeriodicConv2d"]

_POLES = ("reflect", "polar", "polar_half")


def _pole_rows(x: torch.Tensor, rows: int, pole: str, low: bool) -> torch.Tensor:
    """The ``rows`` latitudes beyond one pole of ``x`` (B, C, H, W), serially."""
    h = x.size(2)
    skip = 0 if pole == "polar_half" else 1  # poles on rows: the pole row is not repeated
    src = x.narrow(2, skip, rows) if low else x.narrow(2, h - skip - rows, rows)
    src = src.flip(2)
    return src if pole == "reflect" else src.roll(x.size(3) // 2, 3)


def periodic_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, ...],
    padding: tuple[int, int],
    dilation: tuple[int, ...],
    groups: int,
    pole: str,
) -> torch.Tensor:
    """:class:`PeriodicConv2d`'s computation as one torch function (``padding``: the periodic
    padding per spatial dim). A ShardedTensor input reaches its dispatch handler in one call,
    which runs :class:`DomainParallelPeriodicConv2d` (one halo exchange), instead of the pole
    rows, the concatenation, the circular pad and the convolution dispatched one by one."""
    if has_torch_function_variadic(x, weight, bias):
        return handle_torch_function(
            periodic_conv2d,
            (x, weight, bias),
            x,
            weight,
            bias,
            stride,
            padding,
            dilation,
            groups,
            pole,
        )
    return padded_conv2d(x, weight, bias, stride, padding, dilation, groups, pole)


def padded_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, ...],
    padding: tuple[int, int],
    dilation: tuple[int, ...],
    groups: int,
    pole: str,
) -> torch.Tensor:
    """:func:`periodic_conv2d` op by op: the latitude padded by ``pole``, the longitude
    circularly, then the convolution (on ShardedTensors each op dispatched alone)."""
    ph, pw = padding
    if ph:  # latitude first: the polar roll is half of the unpadded longitude circle
        x = torch.cat([_pole_rows(x, ph, pole, True), x, _pole_rows(x, ph, pole, False)], 2)
    if pw:
        x = F.pad(x, (pw, pw, 0, 0), mode="circular")
    return F.conv2d(x, weight, bias, stride, 0, dilation, groups)


class PeriodicConv2d(nn.Conv2d):
    """Conv2d padded circularly along W (longitude) and, along H (latitude), by ``pole``:
    ``"reflect"``, ``"polar"`` (poles on the first and last rows: mirrored latitude rolled by
    half the circle) or ``"polar_half"`` (poles half a row beyond them). ``padding`` defaults to
    "same" for odd kernels. The serial reference of :class:`DomainParallelPeriodicConv2d`."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | None = None,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        pole: str = "reflect",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            0,
            dilation,
            groups,
            bias,
            device=device,
            dtype=dtype,
        )
        if pole not in _POLES:
            raise ConfigError(f"PeriodicConv2d: pole={pole!r}; use one of {', '.join(_POLES)}")
        if padding is None:
            kh, kw = self.kernel_size
            dh, dw = self.dilation
            padding = (dh * (kh - 1) // 2, dw * (kw - 1) // 2)
        elif isinstance(padding, int):
            padding = (padding, padding)
        self.periodic_padding: tuple[int, int] = (int(padding[0]), int(padding[1]))
        self.pole = pole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return periodic_conv2d(
            x,
            self.weight,
            self.bias,
            self.stride,
            self.periodic_padding,
            self.dilation,
            self.groups,
            self.pole,
        )

    def extra_repr(self) -> str:
        return (
            super().extra_repr() + f", periodic_padding={self.periodic_padding}, pole={self.pole!r}"
        )


class DomainParallelPeriodicConv2d(DomainParallel, PeriodicConv2d):
    """:class:`PeriodicConv2d` on latitude bands or latitude x longitude blocks. Collective over
    the domain group."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True

    @classmethod
    def geometry(cls, module: Any, k: int) -> tuple[int, int, tuple[int, int], int] | None:
        p = module.periodic_padding[k]  # along spatial axis k: 0 the latitude, 1 the longitude
        return module.kernel_size[k], module.stride[k], (p, p), module.dilation[k]

    @classmethod
    def boundary_of(cls, module: Any) -> str:
        return str(module.pole)

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._manager_if_cut()
        if m is None:
            return super().forward(x)
        if x.dim() != 4:
            raise ConfigError(f"{type(self).__name__}: expects (B, C, H, W), got {tuple(x.shape)}")
        known = known_for(x, 2)
        key, y = self._repeated(
            m,
            x,
            known and known.sizes,
            self.kernel_size,
            self.stride,
            self.periodic_padding,
            self.dilation,
            self.pole,
        )
        if y is not None:
            return y
        pads = list(self.periodic_padding)
        cuts, outs = [], []
        for axis in self._axes(x):  # the latitude, and on blocks the longitude too
            k = axis.dim - 2
            spec = learn_spec(x, axis.dim, axis.transport)
            kernel, stride, dil = self.kernel_size[k], self.stride[k], self.dilation[k]
            n_out = conv_output_size(spec.total, kernel, stride, pads[k], dil)
            out_spec = self._out_spec(n_out, axis.transport)
            halo = HaloSpec.for_layer(spec, out_spec, kernel, stride, pads[k], dil)
            cuts.append((axis, spec, halo))
            outs.append((axis, out_spec.sizes[axis.transport.rank], dil * (kernel - 1) + 1))
            pads[k] = 0
        # the latitude by the pole (on blocks the fold fetches the columns half a circle away),
        # the longitude circular: on blocks a halo, on bands padded locally below
        ext = fetch_halo(self, x, cuts, (self.pole, "circular"), roll_dim=3)
        fetched = ext.size(2)
        for axis, _, need in outs:
            ext = with_rows(ext, axis.dim, need)  # a rank without output rows
        if pads[1]:
            ext = F.pad(ext, (pads[1], pads[1], 0, 0), mode="circular")
        y = _KERNEL(self, ext)
        computed = y.size(2)
        for axis, rows, _ in outs:
            y = y.narrow(axis.dim, 0, rows)
        if key is not None and known is not None and len(cuts) == 1:
            mine, need = outs[0][1], outs[0][2]
            self._keep_repeat(
                key,
                x,
                cuts[0],
                self.pole,
                3,
                need=need if fetched < need else 0,
                notes=(("spec", out_spec),),
                pad=([pads[1], pads[1], 0, 0], "circular") if pads[1] else None,
                kernel=_KERNEL,
                rows=None if computed == mine else mine,
            )
        return y


#: the convolution after the halo and the longitude's circular padding
_KERNEL = conv_kernel(2, (0, 0))


register_layer(PeriodicConv2d, DomainParallelPeriodicConv2d)
