"""CREDIT's ``convert_to_domain_parallel`` and ``validate_sharding_constraints``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils._pytree import tree_map

from mpidp.compat.credit.domain_parallel.local_mean import plain, track
from mpidp.compat.credit.domain_parallel.manager import DomainParallelManager, resolve
from mpidp.errors import ConfigError
from mpidp.parallel.convert import convert_to_domain_parallel as _convert

__all__ = ["convert_to_domain_parallel", "validate_sharding_constraints"]

#: set on a model converted here: its band outputs put the row weights on every local mean,
#: which makes CREDIT's average of local gradients exact (read by
#: ``credit.parallel.sync_domain_gradients``)
MARK = "_mpidp_credit_mean_share"


def _one_argument(fn: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module, Any], Any]:
    return lambda module, _manager: fn(module)


def convert_to_domain_parallel(
    model: nn.Module,
    manager: DomainParallelManager | None,
    shard_dim: int = -2,
    custom_converters: dict[type, Callable[[nn.Module], nn.Module]] | None = None,
) -> nn.Module:
    """Convert ``model`` in place (mpidp's conversion: the model's own ``forward`` runs on
    the whole field's bands, every op exact or refused) and return it. ``custom_converters``
    are CREDIT's: ``{type: fn(module) -> module}``, checked first, their children skipped.

    The model's band outputs carry CREDIT's training rule made exact: each rank's loss on its
    band, followed by :func:`mpidp.compat.credit.parallel.sync_domain_gradients` (an average
    over the domain ranks), gives on any bands the gradient it gives on even ones: a local
    mean the global mean's, a local sum the global sum's over P, for rollouts and sums of
    losses too (:mod:`~mpidp.compat.credit.domain_parallel.local_mean`; a loss it cannot
    follow is refused on every rank).
    """
    if shard_dim >= 0:
        raise ConfigError(
            f"convert_to_domain_parallel: shard_dim={shard_dim}; count it from the end (-2: H "
            f"of (B, C, H, W) and (B, C, T, H, W)), as CREDIT's default does"
        )
    m = resolve(manager)
    converters = {k: _one_argument(fn) for k, fn in (custom_converters or {}).items()}
    out = _convert(model, m, shard_dim, converters)

    def unwrap(_module: nn.Module, args: Any, kwargs: Any) -> Any:
        return tree_map(plain, args), tree_map(plain, kwargs)

    def share(_module: nn.Module, _args: Any, result: Any) -> Any:
        if isinstance(result, tuple):
            return tuple(share(_module, _args, r) for r in result)
        if _is_band(result) and result.dim() >= -shard_dim:
            return track(result, shard_dim, m)
        return result

    out.register_forward_pre_hook(unwrap, with_kwargs=True, prepend=True)
    out.register_forward_hook(share)
    setattr(out, MARK, True)
    return out


def _is_band(x: Any) -> bool:
    from mpidp.sharded import Replicated, ShardedTensor

    return hasattr(x, "requires_grad") and not isinstance(x, (Replicated, ShardedTensor))


def validate_sharding_constraints(
    model: nn.Module, local_h: int, window_sizes: list[Any] | None = None
) -> list[str]:
    """CREDIT's check that ``local_h`` rows per rank are a multiple of every window size at
    every level (halved per level). On mpidp there is no such constraint: window attention
    moves the rows of windows that straddle a band boundary, so every cut is exact. Returns
    the warnings (none), after checking the arguments."""
    if local_h < 0:
        raise ConfigError(f"validate_sharding_constraints: local_h={local_h}; pass rows >= 0")
    for i, ws in enumerate(window_sizes or []):
        h = ws[0] if isinstance(ws, (tuple, list)) else ws
        if int(h) < 1:
            raise ConfigError(f"validate_sharding_constraints: level {i} window size {ws!r} < 1")
    return []
