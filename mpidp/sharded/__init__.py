"""ShardedTensor: a band that knows it is a band, so a model's own forward runs
domain-parallel (docs/sharded_tensor.md).

Imports inside the package run one way: the tensor types (:mod:`~mpidp.sharded.tensor`, with
the layout words and row moves below it) sit under the dispatcher and its handlers, which build
ShardedTensors. The types reach back up through the two registrations at the end of this
file, made once, when the package is imported.
"""

from mpidp.sharded import axis_products as _axis_products  # noqa: F401
from mpidp.sharded import dispatch as _dispatch
from mpidp.sharded import fft as _fft  # noqa: F401
from mpidp.sharded import function as _function  # noqa: F401  (wraps Function.apply at the first ShardedTensor)
from mpidp.sharded import grid as _grid  # noqa: F401  (after pointwise: the handlers of blocks)
from mpidp.sharded import join as _join  # noqa: F401
from mpidp.sharded import layers as _layers  # noqa: F401
from mpidp.sharded import modules as _modules
from mpidp.sharded import norms as _norms  # noqa: F401
from mpidp.sharded import pointwise as _pointwise  # noqa: F401  (registers handlers)
from mpidp.sharded import pooling as _pooling  # noqa: F401
from mpidp.sharded import products as _products  # noqa: F401
from mpidp.sharded import reductions as _reductions  # noqa: F401
from mpidp.sharded import scatter as _scatter  # noqa: F401
from mpidp.sharded import select as _select  # noqa: F401
from mpidp.sharded import shapes as _shapes  # noqa: F401
from mpidp.sharded import tensor as _tensor
from mpidp.sharded import tokens_attention as _tokens_attention  # noqa: F401
from mpidp.sharded.dispatch import UnsupportedOp, allow_fallback, handled, register
from mpidp.sharded.tensor import Replicated, ShardedTensor, replicated, shard

_modules.install()  # converted layers are the kernels of their module types
# every torch function on a ShardedTensor or Replicated value goes to the dispatcher
_tensor.use_dispatcher(_dispatch.dispatch)

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
