"""NCAR CREDIT's ``credit.domain_parallel`` on mpidp: change ``credit.domain_parallel`` to
``mpidp.compat.credit.domain_parallel``. Same names, signatures and defaults; bands of any
length; every layer the serial module's function (docs/migration.md lists the differences)."""

from mpidp.compat.credit.domain_parallel.convert import (
    convert_to_domain_parallel,
    validate_sharding_constraints,
)
from mpidp.compat.credit.domain_parallel.halo_exchange import HaloExchange
from mpidp.compat.credit.domain_parallel.layers import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelGroupNorm,
    DomainParallelInterpolate,
    DomainParallelPeriodicConv2d,
)
from mpidp.compat.credit.domain_parallel.manager import (
    DomainParallelManager,
    get_domain_parallel_manager,
    initialize_domain_parallel,
)
from mpidp.compat.credit.domain_parallel.sharding import gather_tensor, shard_batch, shard_tensor

__all__ = [
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelGroupNorm",
    "DomainParallelInterpolate",
    "DomainParallelManager",
    "DomainParallelPeriodicConv2d",
    "HaloExchange",
    "convert_to_domain_parallel",
    "gather_tensor",
    "get_domain_parallel_manager",
    "initialize_domain_parallel",
    "shard_batch",
    "shard_tensor",
    "validate_sharding_constraints",
]
