"""``validate_sharding_constraints`` (mpidp/preflight/validate.py) agrees with the real run: for
models whose own ``forward`` code mixes rows through ops with band forms, adds a global grid,
checks its input shape, or calls an op without a band form, the report is clean exactly when
the converted model, run for real on this job's bands, succeeds and equals serial (forward and
input gradient), and a refused run's message is the report's problem."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.errors import MpidpError
from mpidp.models.nets import WeatherUNet
from tests.mpi.helpers import rand
from tests.unit.test_validate import EXACT, REFUSED, _GlobalPosEmbed, _Mixing, _ShapeCheck

WORLD = MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


def _cases():
    cases = {op: (lambda op=op: _Mixing(op), (2, 3, 20, 8)) for op in [*EXACT, *REFUSED]}
    cases["global-pos-embed"] = (_GlobalPosEmbed, (2, 3, 20, 8))
    cases["shape-check"] = (_ShapeCheck, (2, 3, 20, 8))
    cases["unet"] = (lambda: WeatherUNet(3, 2, (37, 16), width=4), (1, 3, 37, 16))
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_the_report_is_clean_exactly_when_the_real_run_equals_serial(m, name):
    make, shape = CASES[name]
    torch.manual_seed(3)
    serial = make().double()
    with torch.no_grad():  # zero-initialised parameters would hide a wrong row
        for p in serial.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * 0.3)
    report = mpidp.validate_sharding_constraints(copy.deepcopy(serial), shape, manager=m)
    full = rand(shape, 7).requires_grad_()
    converted = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager=m)
    spec = m.spec(shape[-2])
    lo, rows = spec.start(m.domain_rank), spec.sizes[m.domain_rank]
    band = full.detach().narrow(-2, lo, rows).clone().requires_grad_()
    try:
        out = converted(band)
    except MpidpError as err:
        assert not report.ok, f"the real run fails ({err}) and the report is clean"
        assert report.problems[0].split(": ", 1)[1] == str(err).split(": ", 1)[1]
        return
    assert report.ok, report.problems
    want = serial(full)
    torch.testing.assert_close(out, want.narrow(-2, lo, rows), rtol=1e-10, atol=1e-12)
    weight = rand(tuple(want.shape), 9)
    (want * weight).sum().backward()
    (out * weight.narrow(-2, lo, rows)).sum().backward()
    torch.testing.assert_close(band.grad, full.grad.narrow(-2, lo, rows), rtol=1e-10, atol=1e-12)


@pytest.mark.mpi(min_size=2)  # one rank holds the whole field: nothing is refused
def test_every_refused_case_is_refused(m):
    """The agreement test above cannot tell a refusal from a clean report on its own: at more
    than one rank the refused cases are refused."""
    for op in REFUSED:
        report = mpidp.validate_sharding_constraints(_Mixing(op), (2, 3, 20, 8), manager=m)
        assert not report.ok
