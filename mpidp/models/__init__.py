"""The example models (plain torch) that the tests, the examples and ``mpidp plan`` convert to
domain parallel, with the band forms of their own modules (windowed attention, the AFNO filter,
the spectral convolution, the patch head), registered here: converting a model built from
these classes finds them. Nothing in the library imports this package; ``mpidp plan --model``
finds the examples by name (:data:`mpidp.models.examples.EXAMPLES`).
"""

from mpidp.graph.graphcast import GraphCastNet
from mpidp.graph.layers import GraphTransformerLayer, InteractionNetwork
from mpidp.models import spectral as _spectral  # noqa: F401  (registers the band forms)
from mpidp.models import window as _window  # noqa: F401  (registers the band form)
from mpidp.models.nets import (
    AFNOBlock,
    AFNOFilter,
    AFNONet,
    FNO2d,
    PatchEmbedRecover,
    PatchRecovery,
    PeriodicResBlock,
    PeriodicUpsample,
    PositionEmbedding,
    SpectralConv2d,
    SwinBlock,
    SwinNet,
    WeatherUNet,
    WindowAttention,
)

__all__ = [
    "AFNOBlock",
    "AFNOFilter",
    "AFNONet",
    "FNO2d",
    "GraphCastNet",
    "GraphTransformerLayer",
    "InteractionNetwork",
    "PatchEmbedRecover",
    "PatchRecovery",
    "PeriodicResBlock",
    "PeriodicUpsample",
    "PositionEmbedding",
    "SpectralConv2d",
    "SwinBlock",
    "SwinNet",
    "WeatherUNet",
    "WindowAttention",
]
