"""NVIDIA PhysicsNeMo on mpidp: ``physicsnemo.distributed`` -> ``mpidp.compat.physicsnemo
.distributed`` (manager, utils, autograd, fft, mappings); ``physicsnemo.domain_parallel`` ->
``mpidp.compat.physicsnemo.domain_parallel`` (ShardTensor, scatter_tensor)."""

from mpidp.compat.physicsnemo import distributed, domain_parallel

__all__ = ["distributed", "domain_parallel"]
