"""The fidelity oracle: run a function domain-parallel and compare it with the serial one.

:func:`assert_matches_serial` is the helper every layer test uses. It runs ``serial`` on the
full inputs and ``distributed`` on this rank's bands, backpropagates the same fixed random
output gradient through both, gathers outputs and input gradients, sums parameter gradients
over the domain group, and compares everything. The verdict is agreed across the domain
group: every rank raises the same AssertionError, or none does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from mpidp.comm import Transport
from mpidp.manager import DistributedManager, get_manager
from mpidp.partition import offsets

__all__ = ["SerialComparison", "assert_matches_serial", "default_tolerance"]


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a domain-parallel result with the serial one."""
    if dtype == torch.float64:
        return 1e-11, 1e-12
    if dtype == torch.float32:
        return 1.3e-6, 1e-5
    return 1.6e-2, 1e-2  # float16 / bfloat16


@dataclasses.dataclass(frozen=True)
class SerialComparison:
    """Largest absolute differences found, by what was compared (``output``, ``grad_input[i]``,
    ``grad[name]``)."""

    max_abs_diff: dict[str, float]


def _compare(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    rtol: float | None,
    atol: float | None,
    found: dict[str, float],
    failures: list[str],
) -> None:
    if got.shape != want.shape:
        failures.append(f"{name}: shape {tuple(got.shape)} != serial {tuple(want.shape)}")
        return
    r, a = default_tolerance(want.dtype)
    r, a = (rtol if rtol is not None else r), (atol if atol is not None else a)
    diff = (got.to(torch.float64) - want.to(torch.float64)).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    found[name] = worst
    bound = a + r * want.to(torch.float64).abs()
    bad = diff > bound
    if bool(bad.any()) or not bool(torch.isfinite(got).all() == torch.isfinite(want).all()):
        where = tuple(int(i) for i in bad.nonzero()[0]) if bool(bad.any()) else ()
        failures.append(
            f"{name}: max |diff| {worst:.3e} (rtol {r:g}, atol {a:g}); first bad index {where}: "
            f"got {got[where].item() if where else 'nan'} "
            f"want {want[where].item() if where else 'nan'}"
        )


def assert_matches_serial(
    serial: Callable[..., torch.Tensor],
    distributed: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    manager: DistributedManager | None = None,
    dim: int = -2,
    sizes: Sequence[int] | None = None,
    modules: tuple[torch.nn.Module, torch.nn.Module] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> SerialComparison:
    """Check that ``distributed`` on bands computes what ``serial`` computes on the whole field.

    Parameters
    ----------
    serial, distributed:
        Called with the full inputs and with this rank's bands of them.
    inputs:
        Full tensors, identical on every rank (domain rank 0's are broadcast to make sure).
        Every input is cut along ``dim`` by ``sizes`` (default: the manager's partition policy).
    modules:
        ``(serial_module, distributed_module)``; every parameter gradient of the distributed one,
        summed over the domain group, must equal the serial one (matched by name).
    rtol, atol:
        Override :func:`default_tolerance`.

    Collective over the domain group. Raises AssertionError on every rank when any rank finds a
    difference; the message names the ranks and the values.
    """
    manager = manager or get_manager()
    comm: Transport = manager.transport(manager.domain_group, "cpu")
    p, me = comm.size, comm.rank
    full = [comm.broadcast(t.detach().cpu(), 0) for t in inputs]
    in_sizes = [
        tuple(sizes) if sizes is not None else manager.spec(t.size(dim)).sizes for t in full
    ]

    xs = [t.clone().requires_grad_(t.is_floating_point()) for t in full]
    out_s = serial(*xs)
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out_s.shape, generator=gen, dtype=torch.float64).to(out_s.dtype)
    (out_s * grad_out).sum().backward()

    xd = [
        t.narrow(dim, offsets(s)[me], s[me]).clone().requires_grad_(t.is_floating_point())
        for t, s in zip(full, in_sizes, strict=False)
    ]
    out_d = distributed(*xd)
    out_sizes = comm.all_gather_object(out_d.size(dim))
    g_local = grad_out.narrow(dim, offsets(out_sizes)[me], out_sizes[me])
    (out_d * g_local).sum().backward()

    found: dict[str, float] = {}
    failures: list[str] = []
    _compare(
        "output",
        comm.all_gather_v(out_d.detach(), out_sizes, dim),
        out_s.detach(),
        rtol,
        atol,
        found,
        failures,
    )
    for i, (x_s, x_d, s) in enumerate(zip(xs, xd, in_sizes, strict=False)):
        if x_s.grad is None and x_d.grad is None:
            continue
        g_d = x_d.grad if x_d.grad is not None else torch.zeros_like(x_d)
        g_s = x_s.grad if x_s.grad is not None else torch.zeros_like(x_s)
        _compare(
            f"grad_input[{i}]",
            comm.all_gather_v(g_d, list(s), dim),
            g_s,
            rtol,
            atol,
            found,
            failures,
        )
    if modules is not None:
        dist_params = dict(modules[1].named_parameters())
        for name, p_s in modules[0].named_parameters():
            p_d = dist_params.get(name)
            if p_d is None:
                failures.append(f"grad[{name}]: parameter missing from the distributed module")
                continue
            g_d = p_d.grad if p_d.grad is not None else torch.zeros_like(p_d)
            g_s = p_s.grad if p_s.grad is not None else torch.zeros_like(p_s)
            _compare(f"grad[{name}]", comm.all_reduce(g_d), g_s, rtol, atol, found, failures)

    everyone = comm.all_gather_object(failures)
    lines = [f"rank {r}: {msg}" for r, msgs in enumerate(everyone) for msg in msgs]
    if lines:
        raise AssertionError(
            f"domain-parallel result differs from the serial one (P={p}, sizes {in_sizes}):\n"
            + "\n".join(lines)
        )
    return SerialComparison(found)
