"""Domain-parallel layers: torch modules that compute, on a band, the band of the serial output.

Each wrapper subclasses the torch module it replaces, so parameters, buffers and state_dict
keys are the serial ones (a checkpoint moves between P = 1 and P = 4 unchanged). The sharded
dimension is a spatial dim (H: dim -2 of 4-D and 5-D inputs; the length of Conv1d). The output
of a layer is partitioned by the manager's partition policy applied to the output length, so
every activation of a network is cut by the same rule.

The band forms of the example models' own modules (windowed attention, the AFNO filter) live
beside those models, in :mod:`mpidp.models`; ``DomainParallelWindowAttention`` is found there
on first use (nothing in the library imports the examples).
"""

import importlib
from typing import Any

from mpidp.layers import pad as _pad  # noqa: F401  (registers the padding layers)
from mpidp.layers.conv import (
    DomainParallelConv1d,
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose1d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
)
from mpidp.layers.interpolate import DomainParallelInterpolate, interpolate
from mpidp.layers.mha import DomainParallelMultiheadAttention
from mpidp.layers.norm import (
    DomainParallelBatchNorm2d,
    DomainParallelBatchNorm3d,
    DomainParallelGroupNorm,
    DomainParallelInstanceNorm2d,
    DomainParallelInstanceNorm3d,
    DomainParallelLayerNorm,
    global_moments,
)
from mpidp.layers.periodic import DomainParallelPeriodicConv2d, PeriodicConv2d
from mpidp.layers.pool import (
    DomainParallelAdaptiveAvgPool1d,
    DomainParallelAdaptiveAvgPool2d,
    DomainParallelAdaptiveAvgPool3d,
    DomainParallelAdaptiveMaxPool1d,
    DomainParallelAdaptiveMaxPool2d,
    DomainParallelAdaptiveMaxPool3d,
    DomainParallelAvgPool1d,
    DomainParallelAvgPool2d,
    DomainParallelAvgPool3d,
    DomainParallelMaxPool1d,
    DomainParallelMaxPool2d,
    DomainParallelMaxPool3d,
)
from mpidp.layers.registry import layer_for, register_layer
from mpidp.layers.shuffle import DomainParallelPixelShuffle, DomainParallelPixelUnshuffle

__all__ = [
    "DomainParallelPixelShuffle",
    "DomainParallelPixelUnshuffle",
    "layer_for",
    "register_layer",
    "DomainParallelMultiheadAttention",
    "DomainParallelWindowAttention",
    "DomainParallelAdaptiveAvgPool1d",
    "DomainParallelAdaptiveAvgPool2d",
    "DomainParallelAdaptiveAvgPool3d",
    "DomainParallelAdaptiveMaxPool1d",
    "DomainParallelAdaptiveMaxPool2d",
    "DomainParallelAdaptiveMaxPool3d",
    "DomainParallelAvgPool1d",
    "DomainParallelAvgPool2d",
    "DomainParallelAvgPool3d",
    "DomainParallelMaxPool1d",
    "DomainParallelMaxPool2d",
    "DomainParallelMaxPool3d",
    "DomainParallelPeriodicConv2d",
    "PeriodicConv2d",
    "DomainParallelBatchNorm2d",
    "DomainParallelBatchNorm3d",
    "DomainParallelGroupNorm",
    "DomainParallelInstanceNorm2d",
    "DomainParallelInstanceNorm3d",
    "DomainParallelInterpolate",
    "DomainParallelLayerNorm",
    "global_moments",
    "interpolate",
    "DomainParallelConv1d",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose1d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
]


def __getattr__(name: str) -> Any:
    if name == "DomainParallelWindowAttention":
        return importlib.import_module("mpidp.models.window").DomainParallelWindowAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
