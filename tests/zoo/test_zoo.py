"""The third-party zoo: unchanged PhysicsNeMo and CREDIT models on ShardedTensor bands and
blocks against the serial model (issue 34's acceptance; issue 46's "Real models on blocks"):
output, input gradient and every parameter gradient, float64 1e-9 relative where the model
runs in float64, float32 1e-4 otherwise.

Each package lives in an environment of its own (bench/zoo/setup.sh); scripts/test-zoo.sh runs
this file under ``mpiexec -n P`` in each: every case on bands at P = 2 and 3, and the
convolutional and window models of :data:`ON_BLOCKS` on 2 x 2 blocks at 4 ranks
(``MPIDP_ZOO_DOMAIN=2x2``, inputs cut by ``mpidp.shard(x, dim=(lat, lon))``). A case whose
package is not installed skips with the reason. The cases are bench/zoo/cases_*.py
(constructors, input shapes, the sharded dim); bench/zoo/harness.py makes the comparison. The
dry run (``mpidp plan``, which is ``validate_sharding_constraints`` priced) agrees on bands: no
problem in a model whose real run matches.
"""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

import mpidp
from mpidp.runtime.grid import parse_domain

ZOO = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "zoo")
sys.path.insert(0, os.path.abspath(ZOO))

import cases_credit  # noqa: E402
import cases_pnm  # noqa: E402
import harness  # noqa: E402

WORLD = MPI.COMM_WORLD.Get_size()
DOMAIN = parse_domain(os.environ.get("MPIDP_ZOO_DOMAIN", str(WORLD)))  # scripts/test-zoo.sh's
BLOCKS = not isinstance(DOMAIN, int)
PACKAGE = {"pnm": "physicsnemo", "credit": "credit"}
#: on blocks: the convolutional and window models, and what each does there: "match", or the
#: op it is refused at (on every rank, never a wrong number) while no block rule covers it
ON_BLOCKS = {
    "pnm_UNet3D": "match",
    "pnm_Pix2Pix": "match",
    "pnm_SRResNet": "match",
    "pnm_AFNO": "match",  # its patch embedding's tokens of blocks (mpidp.sharded.tokens)
    "pnm_SwinRNN": "match",  # cube tokens, its own shifted windows of 4 (one spans the 2 x 2)
    "credit_FuXi": "match",  # its windows of 4: rows cut inside (lat), window index (lon)
    "credit_UNet": "match",
    "credit_Debugger_post": "match",  # CREDIT's PostBlock fixers: masked writes, global sums
}
CASES = [("pnm", c) for c in cases_pnm.CASES] + [("credit", c) for c in cases_credit.CASES]
if BLOCKS:
    CASES = [(g, c) for g, c in CASES if c in ON_BLOCKS]


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=DOMAIN) as manager:
        yield manager


@pytest.mark.parametrize("group,name", CASES, ids=[c for _, c in CASES])
def test_an_unchanged_third_party_model_equals_serial(m, group, name):
    pytest.importorskip(PACKAGE[group], reason=f"{PACKAGE[group]} is not installed here")
    result = harness.run_case(name, m, group)
    want = ON_BLOCKS[name] if BLOCKS else "match"
    got = result["status"]
    if want != "match" and got == "refused":  # the op named is the one refused
        got = want if want in result["message_first_line"] else result["message_first_line"]
    assert got == want, {
        k: result.get(k)
        for k in ("status", "errors", "problems", "message", "traceback", "worst_params")
    }


@pytest.mark.parametrize("group,name", CASES, ids=[c for _, c in CASES])
def test_the_dry_run_agrees_with_the_real_run(m, group, name):
    """``mpidp plan`` / ``validate_sharding_constraints`` (every rank simulated in one process,
    issue 45) finds no problem in a model whose real run above equals serial. On bands: on
    blocks the dry run checks the latitude cut alone (it passes AFNO, which blocks refuse)."""
    if BLOCKS:
        pytest.skip("the dry run checks the latitude cut alone")
    pytest.importorskip(PACKAGE[group], reason=f"{PACKAGE[group]} is not installed here")
    # local and the same on every rank: rank 0 runs it (the others would repeat it on the
    # same cores), every rank checks it
    dry = None
    if m.rank == 0:
        try:
            dry = harness.dry_run(name, m, group)
        except Exception as err:  # every rank fails the test, none waits in the broadcast
            dry = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    dry = MPI.COMM_WORLD.bcast(dry)
    if dry["ok"] is None:  # a forward the dry run cannot call (HEALPixUNet's ``model([x])``)
        pytest.skip(dry["why"])
    assert dry["ok"] is True, dry
