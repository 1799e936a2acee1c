"""Padding modules on a band: Zero/Constant/Reflection/Replication/CircularPad 1-3-D.

Along the sharded dim a pad is a window of one row: output row ``o`` is input row ``o - top``,
and rows beyond the field are filled by the pad's rule. So a rank fetches, with the halo
exchange, the input rows of its output rows; the halo boundary of the same name fills rows
beyond the field (reflect, replicate, circular; zeros, then the constant), and negative
padding (a crop) simply fetches fewer rows. The other dims are padded locally by ``F.pad``.
The output is cut by the manager's policy of the padded length. On latitude x longitude blocks
the longitude is padded the same way (one block halo exchange fetches both dims, corners
included: every pad rule is the same whichever dim is padded first).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.layers.base import DomainParallel, band_forward, fetch_halo, learn_spec, with_rows
from mpidp.layers.registry import register_layer
from mpidp.ops.geometry import HaloSpec

# torch pad module base -> (F.pad mode, halo boundary)
_MODES: dict[type, tuple[str, str]] = {
    nn.modules.padding._ConstantPadNd: ("constant", "zeros"),
    nn.modules.padding._ReflectionPadNd: ("reflect", "reflect"),
    nn.modules.padding._ReplicationPadNd: ("replicate", "replicate"),
    nn.modules.padding._CircularPadNd: ("circular", "circular"),
}

#: every torch pad module, 1-3-D
PAD_TYPES: tuple[type[nn.Module], ...] = (
    nn.ZeroPad1d,
    nn.ZeroPad2d,
    nn.ZeroPad3d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ConstantPad3d,
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReflectionPad3d,
    nn.ReplicationPad1d,
    nn.ReplicationPad2d,
    nn.ReplicationPad3d,
    nn.CircularPad1d,
    nn.CircularPad2d,
    nn.CircularPad3d,
)


def _mode(module: nn.Module) -> tuple[str, str]:
    for base, found in _MODES.items():
        if isinstance(module, base):
            return found
    raise TypeError(f"{type(module).__name__} is not a torch padding module")


class _Pad(DomainParallel):
    """The forward shared by every pad (``self`` is also the torch pad module)."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True  # per cut axis: the rows, and on blocks the columns too

    @classmethod
    def geometry(cls, module: Any, k: int) -> tuple[int, int, tuple[int, int], int] | None:
        pads: tuple[int, ...] = tuple(module.padding)
        at_k = 2 * (len(pads) // 2 - 1 - k)  # F.pad order: last dim first
        return 1, 1, (pads[at_k], pads[at_k + 1]), 1

    @classmethod
    def boundary_of(cls, module: Any) -> str:
        return _mode(module)[1]

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        pad: Any = self
        mode, boundary = _mode(pad)
        padding = list(pad.padding)
        value = float(getattr(pad, "value", 0.0) or 0.0)
        cuts, fills = [], []
        for axis in self._axes(x):  # the sharded dim, and on blocks the longitude too
            k = x.dim() - 1 - axis.dim  # its pair in F.pad's order (last dim first)
            top, bottom = padding[2 * k], padding[2 * k + 1]
            spec = learn_spec(x, axis.dim, axis.transport)
            out_spec = self._out_spec(spec.total + top + bottom, axis.transport)
            cuts.append((axis, spec, HaloSpec.for_layer(spec, out_spec, 1, 1, (top, bottom), 1)))
            # the global input row of the extended part's first row along this axis
            fills.append((axis.dim, out_spec.start(axis.transport.rank) - top, spec.total))
            padding[2 * k] = padding[2 * k + 1] = 0
        ext = fetch_halo(self, x, cuts, boundary)
        if mode == "constant" and value:  # rows beyond the field hold the constant
            for d, first, total in fills:
                at = torch.arange(first, first + ext.size(d), device=ext.device)
                beyond = (at < 0) | (at >= total)
                if bool(beyond.any()):
                    shape = [1] * ext.dim()
                    shape[d] = -1
                    ext = ext.masked_fill(beyond.view(shape), value)
        if not any(padding):
            return ext
        here = [(d, ext.size(d)) for d, _, _ in fills]  # the output's extents
        for d, _, _ in fills:
            ext = with_rows(ext, d, 1)  # F.pad's reflect and circular refuse an empty dim
        kwargs = {"value": value} if mode == "constant" else {}
        y = F.pad(ext, padding, mode=mode, **kwargs)
        for d, n in here:
            y = y.narrow(d, 0, n)
        return y


def _wrapper(torch_type: type[nn.Module]) -> type[nn.Module]:
    name = f"DomainParallel{torch_type.__name__}"
    doc = (
        f":class:`torch.nn.{torch_type.__name__}` on bands or blocks: the rows beyond the "
        f"field from the pad's own rule, the other dims padded locally. Collective over the "
        f"domain group."
    )
    cls = type(name, (_Pad, torch_type), {"__doc__": doc, "__module__": __name__})
    cls.__qualname__ = name
    return cls


#: torch pad type -> its domain-parallel wrapper (importable by name from this module)
PAD_WRAPPERS: dict[type[nn.Module], type[nn.Module]] = {}
for _t in PAD_TYPES:
    PAD_WRAPPERS[_t] = _wrapper(_t)
    setattr(sys.modules[__name__], PAD_WRAPPERS[_t].__name__, PAD_WRAPPERS[_t])

for _t, _l in PAD_WRAPPERS.items():
    register_layer(_t, _l)

__all__ = ["PAD_TYPES", "PAD_WRAPPERS", *(w.__name__ for w in PAD_WRAPPERS.values())]
