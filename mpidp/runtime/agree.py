"""What the ranks must agree on before a manager builds anything: the same arguments and
environment everywhere (the domain grid that divides the world: mpidp.runtime.grid), and checks
that may fail on some ranks only, turned into the same error on every rank (so that no rank
waits for a peer that raised).

Collective over the world where MPI spans the job (one ``allgather`` a check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpidp.errors import BackendError, ConfigError, LaunchError

__all__ = ["agree", "same_everywhere"]


def same_everywhere(table: list[dict[str, Any]], rank: int) -> None:
    """Every rank raises the same ConfigError when ranks passed different arguments (a
    layout built from them would mix two jobs' meanings silently)."""
    lines = [
        f"rank {r}: {name}={value!r}"
        for name in table[0]
        if len({repr(row.get(name)) for row in table}) > 1
        for r, value in enumerate(row.get(name) for row in table)
    ]
    if lines:
        raise ConfigError(
            f"rank {rank}: the ranks "
            f"initialised mpidp with different arguments or environment ({'; '.join(lines)}); "
            f"pass the same values on every rank"
        )


def agree(world: Any, step: Callable[..., Any], *args: Any) -> Any:
    """``step(*args)``, a check that may differ between ranks; when MPI runs the job
    (``world``, the MPI world or None, spans more than one process), every rank raises the
    same error with every failing rank's message instead of some ranks waiting."""
    result, error = None, None
    try:
        result = step(*args)
    except (ConfigError, BackendError, LaunchError) as exc:
        error = exc
    if error is not None and not str(error).startswith("rank ") and world is not None:
        error = type(error)(f"rank {world.Get_rank()}: {error}")
    if world is not None and world.Get_size() > 1:
        mine = None if error is None else (type(error).__name__, str(error))
        errors = [e for e in world.allgather(mine) if e is not None]
        if errors:
            kinds = {k.__name__: k for k in (ConfigError, BackendError, LaunchError)}
            raise kinds[errors[0][0]]("; ".join(msg for _, msg in errors))
    elif error is not None:
        raise error
    return result
