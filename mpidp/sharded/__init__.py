"""ShardedTensor: a band that knows it is a band, so a model's own forward runs
domain-parallel (docs/sharded_tensor.md)."""

from mpidp.sharded import function as _function  # noqa: F401  (wraps Function.apply at the first ShardedTensor)
from mpidp.sharded import join as _join  # noqa: F401
from mpidp.sharded import layers as _layers  # noqa: F401
from mpidp.sharded import modules as _modules
from mpidp.sharded import pointwise as _pointwise  # noqa: F401  (registers handlers)
from mpidp.sharded import products as _products  # noqa: F401
from mpidp.sharded import reductions as _reductions  # noqa: F401
from mpidp.sharded import scatter as _scatter  # noqa: F401
from mpidp.sharded import select as _select  # noqa: F401
from mpidp.sharded import shapes as _shapes  # noqa: F401
from mpidp.sharded.dispatch import UnsupportedOp, allow_fallback, handled, register
from mpidp.sharded.tensor import Replicated, ShardedTensor, replicated, shard

_modules.install()  # converted layers are the kernels of their module types

__all__ = [
    "Replicated",
    "ShardedTensor",
    "UnsupportedOp",
    "allow_fallback",
    "handled",
    "register",
    "replicated",
    "shard",
]
