"""The fidelity oracle: run a function domain-parallel and compare it with the serial one.

:func:`assert_matches_serial` is the helper every layer test uses. It runs ``serial`` on the
full inputs and ``distributed`` on this rank's bands, backpropagates the same fixed random
output gradient through both, gathers outputs and input gradients, sums parameter gradients
over the domain group, and compares everything. The verdict is agreed across the domain
group: every rank raises the same AssertionError, or none does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import h5py
import torch

from mpidp.comm import Transport
from mpidp.comm.counting import CountingTransport, Traffic
from mpidp.errors import ConfigError
from mpidp.ops.halo_plan import Boundary, Plan
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import offsets
from mpidp.runtime.transports import wrapped_transports

_LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)

__all__ = [
    "CommBudget",
    "CountingFile",
    "count_traffic",
    "SerialComparison",
    "counting_opener",
    "assert_matches_serial",
    "default_tolerance",
    "halo_traffic",
    "serial_halo",
]


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a domain-parallel result with the serial one, element by
    element: used for float64 (a few units in the last place of sums reordered across ranks),
    and for lower precisions only where no float64 run of the serial code can be built (see
    ``low_precision_factor`` of :func:`assert_matches_serial`)."""
    if dtype == torch.float64:
        return 1e-11, 1e-12
    if dtype == torch.float32:
        return 1.3e-6, 1e-5
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0, 0.0  # integers (a BatchNorm's num_batches_tracked): exact
    return 1.6e-2, 1e-2  # float16 / bfloat16


@dataclasses.dataclass(frozen=True)
class CommBudget:
    """The most one rank may send during the distributed forward and backward of
    :func:`assert_matches_serial`: ``bytes`` and ``messages`` (point-to-point messages plus
    collective calls), as :class:`~mpidp.comm.counting.Traffic` counts them. None: no limit."""

    bytes: int | None = None
    messages: int | None = None


@dataclasses.dataclass(frozen=True)
class SerialComparison:
    """Largest absolute differences found, by what was compared (``output``, ``grad_input[i]``,
    ``grad[name]``, ``buffer[name]``), the output partition, and what this rank sent during the
    distributed forward and backward."""

    max_abs_diff: dict[str, float]
    out_sizes: tuple[int, ...] = ()
    traffic: Traffic = dataclasses.field(default_factory=Traffic)


def _show(t: torch.Tensor, where: tuple[int, ...]) -> str:
    return repr(t[where].item()) if t.numel() else "(empty)"


def _compare(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    tol: tuple[float, float],
    found: dict[str, float],
    failures: list[str],
) -> None:
    """Element by element: finite entries within ``atol + rtol * |want|``, every NaN where the
    serial result has a NaN and every infinity equal to the serial one."""
    if got.shape != want.shape:
        failures.append(f"{name}: shape {tuple(got.shape)} != serial {tuple(want.shape)}")
        return
    if got.dtype != want.dtype:
        failures.append(f"{name}: dtype {got.dtype} != serial {want.dtype}")
        return
    rtol, atol = tol
    g, w = got.detach().to(torch.float64), want.detach().to(torch.float64)
    both_finite = torch.isfinite(g) & torch.isfinite(w)
    diff = torch.where(both_finite, (g - w).abs(), torch.zeros_like(g))
    same_special = (torch.isnan(g) & torch.isnan(w)) | (~torch.isfinite(w) & (g == w))
    within = (
        diff <= atol + rtol * w.abs()
        if rtol < float("inf")
        else torch.ones_like(g, dtype=torch.bool)
    )
    bad = ~(same_special | (both_finite & within))
    found[name] = float(diff.max()) if diff.numel() else 0.0
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        failures.append(
            f"{name}: max |diff| {found[name]:.3e} (finite entries; rtol {rtol:g}, atol "
            f"{atol:g}), {int(bad.sum())} of {bad.numel()} entries differ; first at {where}: "
            f"got {_show(got, where)} want {_show(want, where)}"
        )


def _low_precision_check(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    truth: torch.Tensor,
    factor: float,
    failures: list[str],
) -> None:
    """float32/float16/bfloat16: the distributed result's error against a float64 run of the
    serial code may be at most ``factor`` times the serial result's own error (relative norm
    over the tensor) plus one eps of the dtype."""
    t = truth.detach().to(torch.float64)
    scale = float(t.norm()) or 1.0
    err_d = float((got.detach().to(torch.float64) - t).norm()) / scale
    err_s = float((want.detach().to(torch.float64) - t).norm()) / scale
    eps = torch.finfo(got.dtype).eps
    if not err_d <= factor * err_s + eps:
        failures.append(
            f"{name}: relative error against float64 {err_d:.3e} > {factor:g} x the serial "
            f"{got.dtype} error {err_s:.3e} + eps {eps:g}"
        )


def _float64_truth(
    serial: Callable[..., torch.Tensor],
    modules: tuple[torch.nn.Module, torch.nn.Module] | None,
    full: list[torch.Tensor],
    grad_out: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """For float32/float16/bfloat16 outputs: output, input and parameter gradients of the
    serial code run in float64 on the same inputs and output gradient (empty when it cannot be
    built)."""
    if dtype not in _LOW_PRECISION:
        return {}
    twin = _float64_twin(serial, modules)
    if twin is None:
        return {}
    fn, module = twin
    xs = [t.double().requires_grad_() if t.is_floating_point() else t for t in full]
    try:
        out = fn(*xs)
        (out * grad_out.double()).sum().backward()
    except RuntimeError:  # a function of fixed dtype (closes over a float32 module)
        return {}
    truth = {"output": out.detach()}
    truth.update({f"grad_input[{i}]": x.grad for i, x in enumerate(xs) if x.grad is not None})
    if module is not None:
        truth.update(
            {f"grad[{n}]": q.grad for n, q in module.named_parameters() if q.grad is not None}
        )
    return truth


def _over_budget(traffic: Traffic, budget: CommBudget) -> list[str]:
    out = []
    if budget.bytes is not None and traffic.bytes > budget.bytes:
        out.append(f"sent {traffic.bytes} bytes, budget {budget.bytes}: {traffic!r}")
    if budget.messages is not None and traffic.messages > budget.messages:
        out.append(f"sent {traffic.messages} messages, budget {budget.messages}: {traffic!r}")
    return out


@contextlib.contextmanager
def count_traffic(manager: DistributedManager | None = None) -> Iterator[Traffic]:
    """Count what this rank sends through ``manager``'s transports inside the block.

    Every transport the manager hands out in the block is wrapped in a
    :class:`~mpidp.comm.counting.CountingTransport` sharing one :class:`Traffic`; code that
    was given a transport directly is not seen (wrap that one yourself). Local."""
    manager = manager or get_manager()
    traffic = Traffic()
    with wrapped_transports(manager, lambda inner: CountingTransport(inner, traffic)):
        yield traffic


def halo_traffic(pl: Plan, row_bytes: int) -> dict[str, list[int]]:
    """The point-to-point traffic of one forward and backward halo exchange with plan ``pl``,
    in :attr:`Traffic.ops` form (no entry when nothing travels): the plan's messages and rows
    out in the forward, the received rows' gradients back in the backward."""
    rows = sum(hi - lo for _, lo, hi in pl.send + pl.recv)
    if not rows:
        return {}
    return {"exchange": [len(pl.send) + len(pl.recv), rows * row_bytes]}


def _agreed(comm: Transport, failures: list[str], header: str) -> None:
    """Raise one AssertionError on every rank when any rank found a failure."""
    everyone = comm.all_gather_object(failures)
    by_text: dict[str, list[int]] = {}
    for r, msgs in enumerate(everyone):
        for msg in msgs:
            by_text.setdefault(msg, []).append(r)
    lines = [
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
        for msg, rs in by_text.items()
    ]
    if lines:
        raise AssertionError(header + "\n" + "\n".join(lines))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exactly equal, NaN where NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _start_state_problems(comm: Transport, modules: tuple[torch.nn.Module, torch.nn.Module]):
    """Both modules must start from the same state, the serial one the same on every rank: the
    oracle checks, it does not repair (loading the serial state would hide a broken
    conversion)."""
    s_state, d_state = modules[0].state_dict(), modules[1].state_dict()
    first = comm.broadcast_object({k: v.detach().cpu() for k, v in s_state.items()}, 0)
    problems = []
    if list(s_state) != list(first):
        problems.append(f"serial state_dict keys {list(s_state)} differ from rank 0's")
    if set(s_state) != set(d_state):
        problems.append(
            f"state_dict keys differ: only serial {sorted(set(s_state) - set(d_state))}, "
            f"only distributed {sorted(set(d_state) - set(s_state))}"
        )
    for k, v in s_state.items():
        if k in first and not _same(v, first[k]):
            problems.append(
                f"serial {k} differs from domain rank 0's; build the module alike "
                f"on every rank (same seed, or load one state_dict)"
            )
        if k in d_state and not _same(d_state[k], v):
            problems.append(f"distributed {k} differs from the serial one before the run")
    return problems


def _float64_twin(
    serial: Callable[..., torch.Tensor], modules: tuple[torch.nn.Module, torch.nn.Module] | None
) -> tuple[Callable[..., torch.Tensor], torch.nn.Module | None] | None:
    """The serial computation in float64 (the reference for lower-precision runs), when the
    oracle can build it: a plain function, or the serial module itself."""
    if modules is None:
        return serial, None
    if serial is modules[0]:
        twin = copy.deepcopy(modules[0]).double()
        return twin, twin
    return None


def _output_partition(
    manager: DistributedManager,
    comm: Transport,
    out_s: torch.Tensor,
    out_d: torch.Tensor,
    dim: int,
    out_sizes: Sequence[int] | None,
    failures: list[str],
) -> tuple[int, ...] | None:
    """Every rank's output extent along ``dim``, after checking the shapes against the serial
    output and the partition against the policy (or ``out_sizes``). None: the outputs cannot
    be gathered (a shape is wrong on some rank; every rank knows)."""
    d = dim % out_s.dim()
    shapes = comm.all_gather_object(tuple(out_d.shape))
    rest = [s for i, s in enumerate(out_s.shape) if i != d]
    if any(len(s) != out_s.dim() or [n for i, n in enumerate(s) if i != d] != rest for s in shapes):
        if comm.rank == 0:
            failures.append(
                f"output: shapes by rank {shapes} do not cut the serial shape "
                f"{tuple(out_s.shape)} along dim {d}"
            )
        return None
    got = tuple(s[d] for s in shapes)
    if out_sizes is not None:
        want: tuple[int, ...] | None = tuple(int(s) for s in out_sizes)
    else:
        try:  # a length the model derived: the policy, with empty parts below the ranks
            want = manager.partition.derived(out_s.size(d), manager.domain_world_size).sizes
        except ConfigError as err:
            want = None
            failures.append(f"output: the policy cannot split {out_s.size(d)} rows: {err}")
    if got != want and comm.rank == 0:
        failures.append(
            f"output: partition {got} along dim {d} is not the expected {want} "
            f"({'given' if out_sizes is not None else f'{manager.partition!r} policy'})"
        )
    if sum(got) != out_s.size(d):
        return None
    return got


def assert_matches_serial(
    serial: Callable[..., torch.Tensor],
    distributed: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    manager: DistributedManager | None = None,
    dim: int = -2,
    sizes: Sequence[int] | None = None,
    out_sizes: Sequence[int] | None = None,
    modules: tuple[torch.nn.Module, torch.nn.Module] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    budget: CommBudget | None = None,
    low_precision_factor: float = 2.0,
) -> SerialComparison:
    """Check that ``distributed`` on bands computes what ``serial`` computes on the whole field.

    Parameters
    ----------
    serial, distributed:
        Called with the full inputs and with this rank's bands of them.
    inputs:
        Full tensors, identical on every rank (domain rank 0's are broadcast to make sure).
        Every input is cut along ``dim`` by ``sizes`` (default: the manager's partition policy).
    out_sizes:
        The partition the output must have along ``dim``; default: the manager's policy
        applied to the serial output's length. A layer that keeps its input's partition (a
        norm fed a thin or skewed cut) is tested with ``out_sizes=sizes``.
    modules:
        ``(serial_module, distributed_module)``. They must start from the same state (same
        keys, same values; the serial one the same on every rank): a difference fails, it is
        not repaired. Every parameter gradient of the distributed one, summed over the domain
        group, must equal the serial one (matched by name; a gradient missing on every rank
        fails), and after the run every buffer must equal the serial one on every rank.
    rtol, atol:
        Override :func:`default_tolerance` (element-wise: finite entries within
        ``atol + rtol |want|``, NaN exactly where the serial result has NaN, equal infinities).
    budget:
        The most each rank may send during the distributed forward and backward, counted at
        the manager's transports (:func:`count_traffic`).
    low_precision_factor:
        float32/float16/bfloat16: the distributed result's error against a float64 run of the
        serial code may be this many times the serial result's own error (relative norm over
        each tensor) plus one eps of the dtype: the distributed code must be as accurate as
        the serial code, not equal to it bit for bit (a sum split across ranks rounds
        differently). Used when the oracle can build the float64 run (a plain function, or
        ``serial`` being ``modules[0]``); otherwise the element-wise bounds. NaN and
        infinities are compared element by element either way.

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
    header = f"domain-parallel result differs from the serial one (P={p}, sizes {in_sizes}):"
    if modules is not None:
        _agreed(comm, _start_state_problems(comm, modules), header + " (before the run)")

    xs = [t.clone().requires_grad_(t.is_floating_point()) for t in full]
    out_s = serial(*xs)
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out_s.shape, generator=gen, dtype=torch.float64).to(out_s.dtype)
    if out_s.requires_grad:
        (out_s * grad_out).sum().backward()
    truth = _float64_truth(serial, modules, full, grad_out, out_s.dtype)

    xd = [
        t.narrow(dim, offsets(s)[me], s[me]).clone().requires_grad_(t.is_floating_point())
        for t, s in zip(full, in_sizes, strict=False)
    ]
    failures: list[str] = []
    with count_traffic(manager) as traffic:
        out_d = distributed(*xd)
        got_sizes = _output_partition(manager, comm, out_s, out_d, dim, out_sizes, failures)
        if got_sizes is not None and out_d.requires_grad:
            d = dim % out_s.dim()
            g_local = grad_out.narrow(d, offsets(got_sizes)[me], got_sizes[me])
            (out_d * g_local).sum().backward()

    found: dict[str, float] = {}
    tol = default_tolerance(out_s.dtype)
    tol = (rtol if rtol is not None else tol[0], atol if atol is not None else tol[1])

    def compare(name: str, got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor | None):
        if ref is not None and want.dtype in _LOW_PRECISION and got.dtype == want.dtype:
            _low_precision_check(name, got, want, ref, low_precision_factor, failures)
            _compare(name, got, want, (float("inf"), float("inf")), found, failures)
        else:
            _compare(name, got, want, tol, found, failures)

    if got_sizes is not None:
        gathered = comm.all_gather_v(out_d.detach(), got_sizes, dim)
        compare("output", gathered, out_s.detach(), truth.get("output"))
    dist_params = dict(modules[1].named_parameters()) if modules is not None else {}
    serial_params = dict(modules[0].named_parameters()) if modules is not None else {}
    have = comm.all_gather_object(
        [x.grad is not None for x in xd] + [q.grad is not None for q in dist_params.values()]
    )
    for i, (x_s, x_d, s) in enumerate(zip(xs, xd, in_sizes, strict=False)):
        anywhere = any(row[i] for row in have)
        if x_s.grad is None and not anywhere:
            continue
        if x_s.grad is not None and not anywhere and got_sizes is not None and me == 0:
            failures.append(f"grad_input[{i}]: no gradient on any rank")
        g_d = x_d.grad if x_d.grad is not None else torch.zeros_like(x_d)
        g_s = x_s.grad if x_s.grad is not None else torch.zeros_like(x_s)
        compare(
            f"grad_input[{i}]",
            comm.all_gather_v(g_d, list(s), dim),
            g_s,
            truth.get(f"grad_input[{i}]"),
        )
    if modules is not None:
        _compare_parameters(
            comm, serial_params, dist_params, have, len(xd), truth, compare, failures
        )
        for name, b_s in modules[0].named_buffers():
            b_d = dict(modules[1].named_buffers()).get(name)
            if b_d is None:
                failures.append(f"buffer[{name}]: missing from the distributed module")
            else:
                _compare(f"buffer[{name}]", b_d, b_s, default_tolerance(b_s.dtype), found, failures)
    if budget is not None:
        failures += _over_budget(traffic, budget)
    _agreed(comm, failures, header)
    return SerialComparison(found, got_sizes or (), traffic)


def _compare_parameters(
    comm, serial_params, dist_params, have, n_inputs, truth, compare, failures
) -> None:
    extra = sorted(set(dist_params) - set(serial_params))
    if extra:
        failures.append(f"parameters {extra} of the distributed module are not in the serial one")
    names = list(dist_params)
    for name, p_s in serial_params.items():
        p_d = dist_params.get(name)
        if p_d is None:
            failures.append(f"grad[{name}]: parameter missing from the distributed module")
            continue
        anywhere = any(row[n_inputs + names.index(name)] for row in have)
        if p_s.grad is not None and not anywhere and comm.rank == 0:
            failures.append(f"grad[{name}]: no gradient on any rank")
        g_d = p_d.grad if p_d.grad is not None else torch.zeros_like(p_d)
        g_s = p_s.grad if p_s.grad is not None else torch.zeros_like(p_s)
        compare(f"grad[{name}]", comm.all_reduce(g_d), g_s, truth.get(f"grad[{name}]"))


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
