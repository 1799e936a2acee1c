"""mpidp: domain parallelism for PyTorch models on latitude bands, launched by MPI."""

from mpidp.bootstrap import LaunchInfo, detect_launch
from mpidp.collectives import (
    all_gather_v,
    all_gather_v_replicated,
    all_reduce,
    all_to_all_v,
    copy_to,
    gather_v,
    indexed_all_to_all_v,
    reduce_from,
    reduce_scatter_v,
    scatter_v,
)
from mpidp.errors import BackendError, CommError, ConfigError, LaunchError, MpidpError
from mpidp.geometry import HaloSpec, conv_output_size, input_ranges
from mpidp.halo import (
    Boundary,
    HaloExchange,
    PendingHalo,
    halo_exchange,
    halo_strips,
    start_halo_exchange,
)
from mpidp.layers import (
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
)
from mpidp.manager import DistributedManager, Neighbors, get_manager, init, is_initialized
from mpidp.partition import Balanced, PartitionPolicy, ShardSpec, Weighted
from mpidp.sharding import gather_tensor, shard_batch, shard_tensor

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Balanced",
    "Boundary",
    "CommError",
    "ConfigError",
    "DistributedManager",
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
    "HaloExchange",
    "HaloSpec",
    "LaunchError",
    "LaunchInfo",
    "MpidpError",
    "Neighbors",
    "PartitionPolicy",
    "PendingHalo",
    "ShardSpec",
    "Weighted",
    "__version__",
    "all_gather_v",
    "all_gather_v_replicated",
    "all_reduce",
    "all_to_all_v",
    "conv_output_size",
    "copy_to",
    "detect_launch",
    "gather_tensor",
    "gather_v",
    "get_manager",
    "halo_exchange",
    "halo_strips",
    "indexed_all_to_all_v",
    "init",
    "input_ranges",
    "is_initialized",
    "reduce_from",
    "reduce_scatter_v",
    "scatter_v",
    "shard_batch",
    "shard_tensor",
    "start_halo_exchange",
]
