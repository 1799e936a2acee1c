"""The silent-result hunt: every function in the dispatch registry, and the torch functions
real models call that have no handler, called on a ShardedTensor, must give the serial result
(gathered) or refuse on every rank. A band that differs from serial fails the test, whatever
the function. Float64, H = 13 (uneven bands), at every rank count."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpidp
from mpidp.errors import MpidpError
from mpidp.sharded import Replicated, ShardedTensor, dispatch, shard
from tests.mpi.helpers import rand

WORLD = MPI.COMM_WORLD.Get_size()
SHAPE = (2, 3, 13, 8)  # sharded along dim 2

# functions whose point is a side effect, or that only exist for an accelerator
_SIDE_EFFECTS = (
    "backward",
    "register_hook",
    "retain_grad",
    "requires_grad_",
    "cuda",
    "pin_memory",
    "data_ptr",
    "untyped_storage",
    "storage_offset",
    "get_device",
    "numpy",
    "tolist",
    "empty_like",
    "new_empty",
)


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


def _data():
    x = rand(SHAPE, 1).abs() * 0.8 + 0.1  # in (0.1, ~3): most functions' domain
    y = rand(SHAPE, 2).abs() * 0.5 + 0.2
    return x, y


# extra arguments tried in order; "Y" is a second tensor of the same global shape
_EXTRAS = [(), ("Y",), (2.0,), (-2,), (2,), (-1,), (1,), (0,), ("Y", "Y"), ("Y", 0.5), (0.5, 1.5)]


def _materialise(extra, y):
    return tuple(y.clone() if a == "Y" else a for a in extra)


def _value(out):
    """A comparable, gathered form of a result."""
    if isinstance(out, ShardedTensor):
        return ("tensor", out.full_tensor().as_subclass(torch.Tensor).detach())
    if isinstance(out, Replicated):
        return ("tensor", out.as_subclass(torch.Tensor).detach())
    if isinstance(out, torch.Tensor):
        return ("tensor", out.detach())
    if isinstance(out, tuple | list):
        return ("seq", [_value(o) for o in out])
    return ("other", out)


def _same(a, b):
    if a[0] != b[0]:
        return False
    if a[0] == "tensor":
        x, y = a[1], b[1]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() or x.is_complex():
            return bool(torch.allclose(x, y, rtol=1e-10, atol=1e-12, equal_nan=True))
        return bool(torch.equal(x, y))
    if a[0] == "seq":
        return len(a[1]) == len(b[1]) and all(_same(p, q) for p, q in zip(a[1], b[1], strict=True))
    return a[1] == b[1]


def _serial(func, x, y):
    """The first extra-argument list the serial function takes, and its result; None for a
    function that takes none of them or is random (two calls differ)."""
    for extra in _EXTRAS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                first = func(x.clone(), *_materialise(extra, y))
                torch.manual_seed(1)  # a random function draws otherwise
                again = func(x.clone(), *_materialise(extra, y))
        except Exception:
            continue
        if not _same(_value(first), _value(again)):
            return None
        return extra, _value(first)
    return None


def _outcome(m, func, x, y, extra, want):
    """'exact', 'refused' or 'WRONG' (each rank; the ranks' verdicts are compared)."""
    xs, ys = shard(x.clone(), 2, m), shard(y.clone(), 2, m)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = func(xs, *(ys if a == "Y" else a for a in extra))
        value = _value(got)
    except (MpidpError, NotImplementedError):
        return "refused"
    return "exact" if _same(value, want) else "WRONG"


def _hunt(m, calls):
    x, y = _data()
    serial = {name: _serial(func, x, y) for name, func in calls}
    # only what every rank found the same way (an uninitialised empty_like may look
    # deterministic on one rank): the sharded calls are collectives
    mine = {name: found[0] for name, found in serial.items() if found is not None}
    every_found = MPI.COMM_WORLD.allgather(mine)
    common = [n for n in mine if all(r.get(n) == mine[n] for r in every_found)]
    verdicts = {}
    for name, func in calls:
        if name in common:
            verdicts[name] = _outcome(m, func, x, y, *serial[name])
    every = MPI.COMM_WORLD.allgather(verdicts)
    wrong = sorted(n for n, v in verdicts.items() if v == "WRONG")
    disagree = sorted(n for n in verdicts if len({r.get(n) for r in every}) > 1)
    return verdicts, wrong, disagree


def _registry():
    """(stable name, function) for every callable handled, in one order on every rank (the
    registry's own order follows sets of functions, which differ between processes)."""
    calls = {}
    for k in list(dispatch._HANDLERS):
        if isinstance(k, tuple) or not callable(k):
            continue
        name = dispatch.name_of(k)
        qual = getattr(k, "__qualname__", getattr(k, "__name__", ""))
        stable = f"{name} [{getattr(k, '__module__', '')}.{qual}]"
        if any(s in name for s in _SIDE_EFFECTS):
            continue
        calls.setdefault(stable, k)
    return sorted(calls.items())


def test_every_registered_function_is_exact_or_refused(m):
    calls = _registry()
    verdicts, wrong, disagree = _hunt(m, calls)
    assert not wrong, f"silently wrong on a ShardedTensor: {wrong}"
    assert not disagree, f"the ranks disagree (exact on some, refused on others): {disagree}"
    # the hunt must exercise most of the registry (not pass by finding no arguments)
    assert len(verdicts) >= 0.6 * len(calls), (len(verdicts), len(calls))
    assert sum(v == "exact" for v in verdicts.values()) >= 0.5 * len(calls)


_UNHANDLED = [
    ("roll", lambda x: torch.roll(x, 3, 2)),
    ("flip", lambda x: torch.flip(x, (2,))),
    ("rot90", lambda x: torch.rot90(x, 1, (2, 3))),
    ("cumsum", lambda x: torch.cumsum(x, 2)),
    ("sort", lambda x: torch.sort(x, 2)),
    ("topk", lambda x: torch.topk(x, 3, 2)),
    ("argmax", lambda x: torch.argmax(x, 2)),
    ("argmax_flat", lambda x: torch.argmax(x)),
    ("gather", lambda x: torch.gather(x, 2, torch.zeros(2, 3, 13, 8, dtype=torch.long))),
    ("index_select", lambda x: torch.index_select(x, 2, torch.tensor([12, 0, 5]))),
    ("masked_select", lambda x: torch.masked_select(x, x > 1)),
    ("nonzero", lambda x: torch.nonzero(x > 1)),
    ("unique", lambda x: torch.unique(torch.round(x))),
    ("where_band_condition", lambda x: torch.where(x > 1, x, -x)),
    ("einsum_over_sharded", lambda x: torch.einsum("bchw,bchw->bw", x, x)),
    ("diff", lambda x: torch.diff(x, dim=2)),
    ("trapz", lambda x: torch.trapz(x, dim=2)),
    ("unfold", lambda x: F.unfold(x, 3, padding=1)),
    ("grid_sample", lambda x: F.grid_sample(x, torch.zeros(2, 5, 4, 2, dtype=x.dtype))),
    ("stft", lambda x: torch.stft(x[0, 0, :, 0], 4, return_complex=True)),
    ("cumprod", lambda x: torch.cumprod(x, 2)),
    ("median", lambda x: torch.median(x, 2)),
    ("kthvalue", lambda x: torch.kthvalue(x, 2, 2)),
    ("tril", lambda x: torch.tril(x)),
]


@pytest.mark.parametrize("name, func", _UNHANDLED, ids=[n for n, _ in _UNHANDLED])
def test_common_functions_without_a_rule_are_exact_or_refused(m, name, func):
    x, _ = _data()
    want = _value(func(x.clone()))
    verdict = _outcome(m, lambda t: func(t), x, x, (), want)
    every = MPI.COMM_WORLD.allgather(verdict)
    assert verdict != "WRONG", f"{name}: silently wrong on a ShardedTensor"
    assert len(set(every)) == 1, f"{name}: ranks disagree: {every}"
