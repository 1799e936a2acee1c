"""The fidelity oracle: run a function domain-parallel and compare it with the serial one.

:func:`assert_matches_serial` is the helper every layer test uses. It runs ``serial`` on the
full inputs and ``distributed`` on this rank's bands, backpropagates the same fixed random
output gradient through both, gathers outputs and input gradients, sums parameter gradients
over the domain group, and compares everything. The verdict is agreed across the domain
group: every rank raises the same AssertionError, or none does.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from typing import Any

import h5py
import torch

from mpidp.comm import Transport
from mpidp.halo_plan import Boundary
from mpidp.manager import DistributedManager, get_manager
from mpidp.partition import offsets

__all__ = [
    "CountingFile",
    "SerialComparison",
    "counting_opener",
    "assert_matches_serial",
    "default_tolerance",
    "serial_halo",
]


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
        ``(serial_module, distributed_module)``. Both first get domain rank 0's serial
        state_dict (the same keys: a conversion keeps them), so weights agree everywhere.
        Every parameter gradient of the distributed one, summed over the domain group, must
        equal the serial one (matched by name).
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

    if modules is not None:  # the same weights everywhere: domain rank 0's serial module's
        state = {k: comm.broadcast(v.detach().cpu(), 0) for k, v in modules[0].state_dict().items()}
        for module in modules:
            module.load_state_dict(state)
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


def _edge_rows(full: torch.Tensor, m: int, kind: str, low: bool, dim: int, roll_dim: int):
    """The ``m`` rows beyond one edge of ``full``, built from torch.flip / torch.roll."""
    h = full.size(dim)
    if kind == "zeros":
        shape = list(full.shape)
        shape[dim] = m
        return full.new_zeros(shape)
    if kind == "replicate":
        return torch.cat([full.narrow(dim, 0 if low else h - 1, 1)] * m, dim)
    if kind == "circular":
        return full.narrow(dim, h - m, m) if low else full.narrow(dim, 0, m)
    if kind in ("reflect", "polar"):
        rows = full.narrow(dim, 1, m) if low else full.narrow(dim, h - 1 - m, m)
    elif kind in ("symmetric", "polar_half"):
        rows = full.narrow(dim, 0, m) if low else full.narrow(dim, h - m, m)
    else:
        raise ValueError(f"boundary {kind!r} supplies no rows beyond the edge")
    rows = rows.flip(dim)
    return rows.roll(full.size(roll_dim) // 2, roll_dim) if kind.startswith("polar") else rows


def serial_halo(
    full: torch.Tensor,
    lo: int,
    hi: int,
    dim: int = -2,
    boundary: object = "zeros",
    roll_dim: int = -1,
) -> torch.Tensor:
    """Global rows ``[lo, hi)`` of ``full`` with the rows beyond its edges filled by
    ``boundary`` -- the serial reference for :func:`mpidp.halo_exchange`, written with
    ``torch.cat``, ``torch.flip`` and ``torch.roll`` on the whole field (differentiable)."""
    b = Boundary.of(boundary, roll_dim)
    dim = dim % full.dim()
    h = full.size(dim)
    m_low, m_high = max(0, -lo), max(0, hi - h)
    parts = [full]
    if m_low:
        parts.insert(0, _edge_rows(full, m_low, b.low, True, dim, b.roll_dim))
    if m_high:
        parts.append(_edge_rows(full, m_high, b.high, False, dim, b.roll_dim))
    ext = torch.cat(parts, dim) if len(parts) > 1 else full
    return ext.narrow(dim, lo + m_low, hi - lo)


class CountingFile(io.RawIOBase):
    """A read-only file object that records every read (offset, bytes): pass it to
    ``h5py.File`` (or use :func:`counting_opener`) to see exactly what HDF5 reads. Close the
    h5py file before this object goes away."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._f = open(path, "rb")
        self.reads: list[tuple[int, int]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer: Any) -> int:
        at = self._f.tell()
        n = self._f.readinto(buffer)
        self.reads.append((at, n))
        return n

    def close(self) -> None:
        self._f.close()
        super().close()

    @property
    def bytes_read(self) -> int:
        return sum(n for _, n in self.reads)


def counting_opener(log: list[CountingFile]) -> Callable[[str], h5py.File]:
    """An ``opener`` for :class:`mpidp.io.ShardedH5Dataset` that appends each file object it
    opens to ``log``."""

    def opener(path: str) -> h5py.File:
        counted = CountingFile(path)
        log.append(counted)
        return h5py.File(counted, "r")

    return opener
