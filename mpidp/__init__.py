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
from mpidp.manager import DistributedManager, Neighbors, get_manager, init, is_initialized
from mpidp.partition import Balanced, PartitionPolicy, ShardSpec, Weighted
from mpidp.sharding import gather_tensor, shard_batch, shard_tensor

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Balanced",
    "CommError",
    "ConfigError",
    "DistributedManager",
    "LaunchError",
    "LaunchInfo",
    "MpidpError",
    "Neighbors",
    "PartitionPolicy",
    "ShardSpec",
    "Weighted",
    "__version__",
    "all_gather_v",
    "all_gather_v_replicated",
    "all_reduce",
    "all_to_all_v",
    "copy_to",
    "detect_launch",
    "gather_tensor",
    "gather_v",
    "get_manager",
    "indexed_all_to_all_v",
    "init",
    "is_initialized",
    "reduce_from",
    "reduce_scatter_v",
    "scatter_v",
    "shard_batch",
    "shard_tensor",
]
