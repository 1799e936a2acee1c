"""CREDIT's ``DomainParallelManager`` and its singleton, over mpidp's manager."""

from __future__ import annotations

import contextlib
from typing import Any

from mpidp.errors import ConfigError
from mpidp.layers.base import in_progress, serve
from mpidp.runtime.manager import DistributedManager, Neighbors, get_manager, init, is_initialized

__all__ = ["DomainParallelManager", "get_domain_parallel_manager", "initialize_domain_parallel"]

_MANAGER: list[DomainParallelManager] = []


class DomainParallelManager:
    """CREDIT's view of mpidp's (dp, domain) mesh: consecutive ranks form a domain group, as
    in CREDIT. Builds nothing of its own: mpidp is initialised with ``domain_parallel_size``
    (collective over the world) unless it is already, in which case its sizes must match.

    ``domain_group`` and ``data_parallel_group`` are torch process groups, as in CREDIT.
    ``manager`` is the mpidp manager underneath; :func:`install` gives CREDIT's view of another
    one (a group or mesh of the user's, :func:`mpidp.compat.credit.parallel.
    apply_domain_parallel`)."""

    def __init__(self, world_size: int, domain_parallel_size: int, shard_dim: int = -2) -> None:
        if world_size % domain_parallel_size != 0:
            raise ConfigError(
                f"world_size ({world_size}) must be divisible by domain_parallel_size "
                f"({domain_parallel_size}); pass a domain size that divides the world"
            )
        m = get_manager() if is_initialized() else init(domain_parallel_size, shard_dim=shard_dim)
        if (m.world_size, m.domain_world_size) != (world_size, domain_parallel_size):
            raise ConfigError(
                f"rank {m.rank}: DomainParallelManager(world_size={world_size}, "
                f"domain_parallel_size={domain_parallel_size}) but mpidp runs {m.world_size} "
                f"ranks in domain groups of {m.domain_world_size}; pass those sizes "
                f"(or shut mpidp down first)"
            )
        self._view(m, shard_dim)
        self.data_parallel_size = world_size // domain_parallel_size

    @classmethod
    def _over(cls, m: DistributedManager, shard_dim: int = -2) -> DomainParallelManager:
        """CREDIT's view of the mpidp manager ``m`` as it is (its domain group, whatever its
        ranks; an adopted group's data-parallel partners are unknown: ``data_parallel_group``
        None, ``dp_world_size`` 1). No communication."""
        made = cls.__new__(cls)
        made._view(m, shard_dim)
        return made

    def _view(self, m: DistributedManager, shard_dim: int) -> None:
        self.manager: DistributedManager = m
        self.world_size = m.world_size
        self.domain_parallel_size = m.domain_world_size
        self.data_parallel_size = m.dp_world_size
        self.shard_dim = shard_dim
        self._domain_group_idx = m.dp_rank
        self._domain_rank = m.domain_rank
        self._dp_rank = m.dp_rank
        self._domain_group = m.domain_group
        self._dp_group = m.data_parallel_group

    @property
    def domain_group(self) -> Any:
        """Process group of this rank's domain ranks (halo exchange, statistics)."""
        return self._domain_group

    @property
    def data_parallel_group(self) -> Any:
        """Process group of the ranks that hold the same band of other samples."""
        return self._dp_group

    @property
    def domain_rank(self) -> int:
        return self._domain_rank

    @property
    def domain_world_size(self) -> int:
        return self.domain_parallel_size

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_world_size(self) -> int:
        return self.data_parallel_size

    @property
    def is_first_domain_rank(self) -> bool:
        """True on the first rank of the domain group (the northern edge)."""
        return self._domain_rank == 0

    @property
    def is_last_domain_rank(self) -> bool:
        """True on the last rank of the domain group (the southern edge)."""
        return self._domain_rank == self.domain_parallel_size - 1

    def neighbor_ranks(self) -> Neighbors:
        """(previous, next) global ranks of the domain neighbours; None beyond an edge."""
        return self.manager.neighbor_ranks()

    def __repr__(self) -> str:
        return (
            f"DomainParallelManager(world_size={self.world_size}, domain_parallel_size="
            f"{self.domain_parallel_size}, shard_dim={self.shard_dim}, rank={self.manager.rank})"
        )


def initialize_domain_parallel(
    world_size: int, domain_parallel_size: int, shard_dim: int = -2
) -> DomainParallelManager:
    """Build the process-wide :class:`DomainParallelManager` and return it. Collective over
    the world the first time mpidp is initialised."""
    _MANAGER[:] = [DomainParallelManager(world_size, domain_parallel_size, shard_dim)]
    return _MANAGER[0]


def install(m: DistributedManager) -> DomainParallelManager:
    """The process-wide :class:`DomainParallelManager` made CREDIT's view of ``m`` (kept when
    it is already), as :func:`initialize_domain_parallel` makes it of mpidp's default
    manager. No communication."""
    if not (_MANAGER and _MANAGER[0].manager is m and not m._closed):
        _MANAGER[:] = [DomainParallelManager._over(m)]
    return _MANAGER[0]


def get_domain_parallel_manager() -> DomainParallelManager | None:
    """The manager :func:`initialize_domain_parallel` built, or None (also once the mpidp
    manager underneath has been shut down)."""
    return _MANAGER[0] if _MANAGER and not _MANAGER[0].manager._closed else None


def layers_manager() -> DistributedManager | None:
    """The mpidp manager CREDIT's layers compute on at a call: the converted model's in
    progress, else the process-wide manager's (CREDIT's layers read
    ``get_domain_parallel_manager()`` at every forward); None: neither (a ShardedTensor's
    own, else mpidp's default)."""
    inside = in_progress()
    if inside is not None:
        return inside
    held = get_domain_parallel_manager()
    return held.manager if held is not None else None


def on_layers_manager() -> contextlib.AbstractContextManager[None]:
    """Within: mpidp's layers bound to None compute on :func:`layers_manager` (a layer
    called with a ShardedTensor of another group is refused, never run over this one)."""
    m = layers_manager()
    return serve(m) if m is not None else contextlib.nullcontext()


def resolve(manager: DomainParallelManager | DistributedManager | None) -> DistributedManager:
    """The mpidp manager behind ``manager`` (None: the singleton's, else mpidp's default)."""
    if isinstance(manager, DistributedManager):
        return manager
    if manager is None:
        manager = get_domain_parallel_manager()
    return manager.manager if manager is not None else get_manager()
