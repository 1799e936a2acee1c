"""ECMWF anemoi's ``anemoi.models.distributed`` on mpidp: change
``from anemoi.models.distributed.graph import shard_tensor`` to
``from mpidp.compat.anemoi.graph import shard_tensor`` (or import from this package).

Every name of anemoi's documented API, with its signature, return values and meaning, each a
thin layer over one mpidp function; unlike anemoi's, right for uneven and empty shards.
``mgroup`` is a torch ProcessGroup or anything mpidp's collectives accept; None means "not
distributed", as in anemoi. docs/migration.md lists every name and the function underneath.
"""

from mpidp.compat.anemoi.graph import (
    all_to_all_transpose,
    gather_tensor,
    reduce_shard_tensor,
    reduce_tensor,
    shard_tensor,
    sync_tensor,
)
from mpidp.compat.anemoi.khop_edges import (
    get_k_hop_edges,
    sort_edges_1hop_chunks,
    sort_edges_1hop_sharding,
)
from mpidp.compat.anemoi.shapes import change_channels_in_shape, get_shape_shards
from mpidp.compat.anemoi.transformer import shard_heads, shard_sequence
from mpidp.compat.anemoi.utils import get_memory_format

__all__ = [
    "all_to_all_transpose",
    "change_channels_in_shape",
    "gather_tensor",
    "get_k_hop_edges",
    "get_memory_format",
    "get_shape_shards",
    "reduce_shard_tensor",
    "reduce_tensor",
    "shard_heads",
    "shard_sequence",
    "shard_tensor",
    "sort_edges_1hop_chunks",
    "sort_edges_1hop_sharding",
    "sync_tensor",
]
