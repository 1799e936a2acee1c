"""mpidp: domain parallelism for PyTorch models on latitude bands, launched by MPI.

Names are imported on first use (PEP 562): ``import mpidp`` loads no torch, so ``mpidp --help``
and the launcher detection answer at once; ``mpidp.init`` or ``from mpidp import shard`` load
what they need. The ``TYPE_CHECKING`` imports below are the same names, for type checkers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mpidp import _moved

if TYPE_CHECKING:
    from mpidp import graph as graph  # mpidp.graph.Graph without a second import
    from mpidp import parallel as parallel  # mpidp.parallel without a second import
    from mpidp import sharded as sharded  # mpidp.sharded.register without a second import
    from mpidp.errors import (
        BackendError,
        CommError,
        ConfigError,
        LaunchError,
        MpidpError,
    )
    from mpidp.layers import (
        DomainParallelAdaptiveAvgPool2d,
        DomainParallelAvgPool2d,
        DomainParallelBatchNorm2d,
        DomainParallelBatchNorm3d,
        DomainParallelConv1d,
        DomainParallelConv2d,
        DomainParallelConv3d,
        DomainParallelConvTranspose1d,
        DomainParallelConvTranspose2d,
        DomainParallelConvTranspose3d,
        DomainParallelGroupNorm,
        DomainParallelInstanceNorm2d,
        DomainParallelInstanceNorm3d,
        DomainParallelInterpolate,
        DomainParallelLayerNorm,
        DomainParallelMaxPool2d,
        DomainParallelMultiheadAttention,
        DomainParallelPeriodicConv2d,
        PeriodicConv2d,
    )
    from mpidp.models.window import DomainParallelWindowAttention
    from mpidp.ops import fft as fft  # mpidp.fft.rfft2 without a second import
    from mpidp.ops.attention import shard_heads, shard_sequence, sliding_window_attention
    from mpidp.ops.collectives import (
        all_gather_v,
        all_gather_v_replicated,
        all_reduce,
        all_to_all_v,
        copy_to,
        gather_v,
        indexed_all_to_all_v,
        reduce_from,
        reduce_scatter_v,
        repartition,
        scatter_v,
    )
    from mpidp.ops.geometry import HaloSpec, conv_output_size, input_ranges
    from mpidp.ops.gradient_sync import GradientSync
    from mpidp.ops.halo import (
        Boundary,
        HaloExchange,
        PendingHalo,
        halo_exchange,
        halo_strips,
        start_halo_exchange,
    )
    from mpidp.ops.sharding import gather_tensor, shard_batch, shard_tensor
    from mpidp.ops.training import (
        broadcast_parameters,
        global_acc,
        global_mean,
        global_rmse,
        global_sum,
        latitude_weights,
        sync_gradients,
    )
    from mpidp.parallel.convert import convert_to_domain_parallel, explain_conversion
    from mpidp.preflight.validate import ShardingReport, validate_sharding_constraints
    from mpidp.runtime.bootstrap import LaunchInfo, detect_launch
    from mpidp.runtime.manager import (
        DistributedManager,
        Neighbors,
        get_manager,
        init,
        is_initialized,
    )
    from mpidp.runtime.partition import Aligned, Balanced, PartitionPolicy, ShardSpec, Weighted
    from mpidp.runtime.profile import Profile, profile
    from mpidp.runtime.profile_report import ProfileReport
    from mpidp.runtime.rebalance import rebalance
    from mpidp.sharded import Replicated, ShardedTensor, shard
    from mpidp.sharded.placements import scatter_tensor

__version__ = "0.1.0"

_moved.install()  # the old module paths (mpidp.collectives, ...) for one release

#: the submodules dir() lists (any submodule loads on first use: mpidp.fft.rfft2 without a
#: second import); the short names of those that live in a folder
_SUBMODULES = ("fft", "graph", "parallel", "sharded")
_SHORT = {"fft": "mpidp.ops.fft"}

#: each public name's module (the imports above, one entry per name)
_SOURCES: dict[str, tuple[str, ...]] = {
    "mpidp.ops.attention": ("shard_heads", "shard_sequence", "sliding_window_attention"),
    "mpidp.runtime.bootstrap": ("LaunchInfo", "detect_launch"),
    "mpidp.ops.collectives": (
        "all_gather_v",
        "all_gather_v_replicated",
        "all_reduce",
        "all_to_all_v",
        "copy_to",
        "gather_v",
        "indexed_all_to_all_v",
        "reduce_from",
        "reduce_scatter_v",
        "repartition",
        "scatter_v",
    ),
    "mpidp.parallel.convert": ("convert_to_domain_parallel", "explain_conversion"),
    "mpidp.errors": ("BackendError", "CommError", "ConfigError", "LaunchError", "MpidpError"),
    "mpidp.ops.geometry": ("HaloSpec", "conv_output_size", "input_ranges"),
    "mpidp.ops.halo": (
        "Boundary",
        "HaloExchange",
        "PendingHalo",
        "halo_exchange",
        "halo_strips",
        "start_halo_exchange",
    ),
    "mpidp.layers": (
        "DomainParallelAdaptiveAvgPool2d",
        "DomainParallelAvgPool2d",
        "DomainParallelBatchNorm2d",
        "DomainParallelBatchNorm3d",
        "DomainParallelConv1d",
        "DomainParallelConv2d",
        "DomainParallelConv3d",
        "DomainParallelConvTranspose1d",
        "DomainParallelConvTranspose2d",
        "DomainParallelConvTranspose3d",
        "DomainParallelGroupNorm",
        "DomainParallelInstanceNorm2d",
        "DomainParallelInstanceNorm3d",
        "DomainParallelInterpolate",
        "DomainParallelLayerNorm",
        "DomainParallelMaxPool2d",
        "DomainParallelMultiheadAttention",
        "DomainParallelPeriodicConv2d",
        "PeriodicConv2d",
    ),
    # the band form of the example models' windowed attention lives with them
    "mpidp.models.window": ("DomainParallelWindowAttention",),
    "mpidp.runtime.manager": (
        "DistributedManager",
        "Neighbors",
        "get_manager",
        "init",
        "is_initialized",
    ),
    "mpidp.runtime.partition": ("Aligned", "Balanced", "PartitionPolicy", "ShardSpec", "Weighted"),
    "mpidp.runtime.profile": ("Profile", "profile"),
    "mpidp.runtime.profile_report": ("ProfileReport",),
    "mpidp.runtime.rebalance": ("rebalance",),
    "mpidp.sharded": ("Replicated", "ShardedTensor", "shard"),
    "mpidp.sharded.placements": ("scatter_tensor",),
    "mpidp.ops.sharding": ("gather_tensor", "shard_batch", "shard_tensor"),
    "mpidp.ops.gradient_sync": ("GradientSync",),
    "mpidp.ops.training": (
        "broadcast_parameters",
        "global_acc",
        "global_mean",
        "global_rmse",
        "global_sum",
        "latitude_weights",
        "sync_gradients",
    ),
    "mpidp.preflight.validate": ("ShardingReport", "validate_sharding_constraints"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    if name in _SHORT:
        return importlib.import_module(_SHORT[name])
    return _moved.submodule(__name__, name)  # as the eager package had them all: mpidp.io


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES, *_MODULE_OF})


__all__ = [
    "Aligned",
    "BackendError",
    "Balanced",
    "Boundary",
    "CommError",
    "ConfigError",
    "DistributedManager",
    "DomainParallelAdaptiveAvgPool2d",
    "DomainParallelAvgPool2d",
    "DomainParallelMaxPool2d",
    "DomainParallelPeriodicConv2d",
    "DomainParallelBatchNorm2d",
    "DomainParallelBatchNorm3d",
    "DomainParallelConv1d",
    "DomainParallelConv2d",
    "DomainParallelMultiheadAttention",
    "DomainParallelWindowAttention",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose1d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelGroupNorm",
    "DomainParallelInstanceNorm2d",
    "DomainParallelInstanceNorm3d",
    "DomainParallelInterpolate",
    "DomainParallelLayerNorm",
    "HaloExchange",
    "HaloSpec",
    "LaunchError",
    "LaunchInfo",
    "MpidpError",
    "Neighbors",
    "PartitionPolicy",
    "PeriodicConv2d",
    "Profile",
    "ProfileReport",
    "PendingHalo",
    "ShardSpec",
    "ShardingReport",
    "Weighted",
    "__version__",
    "scatter_tensor",
    "all_gather_v",
    "all_gather_v_replicated",
    "all_reduce",
    "all_to_all_v",
    "broadcast_parameters",
    "conv_output_size",
    "convert_to_domain_parallel",
    "explain_conversion",
    "copy_to",
    "detect_launch",
    "gather_tensor",
    "gather_v",
    "get_manager",
    "GradientSync",
    "global_acc",
    "global_mean",
    "global_rmse",
    "global_sum",
    "halo_exchange",
    "halo_strips",
    "indexed_all_to_all_v",
    "init",
    "input_ranges",
    "is_initialized",
    "latitude_weights",
    "reduce_from",
    "profile",
    "rebalance",
    "reduce_scatter_v",
    "repartition",
    "scatter_v",
    "shard_batch",
    "shard_tensor",
    "shard",
    "shard_heads",
    "shard_sequence",
    "sliding_window_attention",
    "ShardedTensor",
    "Replicated",
    "start_halo_exchange",
    "sync_gradients",
    "validate_sharding_constraints",
]
