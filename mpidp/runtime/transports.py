"""The transport of a group for tensors on a device, made once and kept by its manager: the one
rule for a manager's own groups, an adopted group (:mod:`mpidp.runtime.adopt`) and the axes of
a grid of blocks (:mod:`mpidp.runtime.grid`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from mpidp.comm import TorchTransport, Transport
from mpidp.errors import BackendError

if TYPE_CHECKING:
    from mpidp.runtime.manager import DistributedManager

__all__ = ["built_transport", "hands_out_bare", "wrapped_transports"]


def built_transport(
    m: DistributedManager,
    key: str,
    dev: torch.device,
    *,
    cpu: Callable[[], Transport],
    mpi_comm: Callable[[], Any],
    torch_group: Callable[[], Any],
) -> Transport:
    """The transport of ``m``'s group ``key`` for tensors on ``dev``, made the first time and
    kept in ``m``. Meta tensors (mpidp explain): shapes only, objects through ``cpu()``. Else
    ``m``'s transport policy; ``"auto"``: MPI (over ``mpi_comm()``) for CPU tensors when MPI
    runs the job, torch.distributed (over ``torch_group()``) otherwise. Local."""
    if dev.type == "meta":
        from mpidp.comm.meta import MetaTransport

        meta = m._transports.get((key, "meta"))
        return meta if meta is not None else m._remember((key, "meta"), MetaTransport(cpu()))
    kind = m.transport_policy
    if kind == "auto":
        kind = "mpi" if dev.type == "cpu" and m.mpi_available else "torch"
    if kind == "mpi" and not m.mpi_available:
        raise BackendError(
            f"rank {m.rank}: the MPI transport needs a job launched by MPI (this one: "
            f"{m.launch_info.launcher}); use transport='torch'"
        )
    cached = m._transports.get((key, kind + dev.type))
    if cached is not None:
        return cached
    made: Transport
    if kind == "mpi":  # mpi4py loads when a job first uses it
        from mpidp.comm.mpi import MPITransport, deadline_seconds

        made = MPITransport(mpi_comm(), timeout=deadline_seconds(m.timeout.total_seconds()))
    else:
        group = torch_group()
        assert group is not None  # the manager initialised or adopted the default group
        made = TorchTransport(group, dev)
    return m._remember((key, kind + dev.type), made)


def hands_out_bare(m: Any) -> bool:
    """Whether manager ``m`` is open and hands out its own transports (no
    :func:`wrapped_transports` block: counting, profiling): what a call kept over a transport
    it handed out needs to serve again."""
    return bool(m._transports) and "transport" not in m.__dict__


@contextlib.contextmanager
def wrapped_transports(
    m: DistributedManager,
    wrap: Callable[[Transport], Transport],
    made: dict[int, Transport] | None = None,
) -> Iterator[None]:
    """Inside the block, every transport ``m`` hands out is ``wrap(inner)``, made once per
    inner transport and kept in ``made`` (default: for the block; pass the same dict to
    reuse the wrappers in a later block); blocks nest, the innermost wrapper outermost. Code
    that was given a transport before the block keeps the bare one. How
    :func:`mpidp.testing.count_traffic` counts and :func:`mpidp.profile` times. Local."""
    real = m.transport
    made = {} if made is None else made

    def transport(group: Any = None, device: Any = None) -> Transport:
        inner = real(group, device)
        if any(inner is w for w in made.values()):
            return inner  # reached through another group (a grid axis that is the domain)
        if id(inner) not in made:
            made[id(inner)] = wrap(inner)
        return made[id(inner)]

    outer = m.__dict__.get("transport")  # an enclosing block's
    m.transport = transport  # type: ignore[method-assign]
    try:
        yield
    finally:
        if outer is None:
            del m.transport
        else:
            m.transport = outer  # type: ignore[method-assign]
