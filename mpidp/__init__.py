"""mpidp: domain parallelism for PyTorch models on latitude bands, launched by MPI."""

from mpidp import _moved
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
from mpidp.runtime.manager import DistributedManager, Neighbors, get_manager, init, is_initialized
from mpidp.runtime.partition import Aligned, Balanced, PartitionPolicy, ShardSpec, Weighted
from mpidp.sharded import Replicated, ShardedTensor, shard
from mpidp.sharded.placements import scatter_tensor

__version__ = "0.1.0"

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


def __getattr__(name: str) -> object:
    # the band form of the example models' windowed attention lives with them (mpidp.models)
    if name == "DomainParallelWindowAttention":
        from mpidp import layers

        return layers.DomainParallelWindowAttention
    raise AttributeError(f"module 'mpidp' has no attribute {name!r}")


_moved.install()  # the old module paths (mpidp.collectives, ...) for one release
