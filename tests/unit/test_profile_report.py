"""ProfileReport without MPI: compute, comm and wait from the step and communication seconds
(adding up to the step), the means and rank_seconds, the table, JSON and the report command;
a profile at one rank (no peer to wait for)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import mpidp
from mpidp import cli
from mpidp.comm.timing import CommClock, TimingTransport
from mpidp.errors import ConfigError
from mpidp.runtime.profile_report import ProfileReport

# rank 1 computes 30 ms more per step; rank 0 waits for it inside its communication
REPORT = ProfileReport(
    step=((0.050, 0.052), (0.051, 0.053)), communication=((0.035, 0.036), (0.006, 0.005))
)


def test_parts_add_up_and_the_wait_is_the_slowest_peers_lead():
    parts = REPORT.parts()
    for r in range(2):
        for k in range(2):
            compute, comm, wait = parts[r][k]
            assert math.isclose(compute + comm + wait, REPORT.step[r][k])
    # step 0: rank 0 computes 15 ms, rank 1 45 ms: rank 0 waited 30 of its 35 ms
    assert parts[0][0] == pytest.approx((0.015, 0.005, 0.030))
    assert parts[1][0] == pytest.approx((0.045, 0.006, 0.0))
    assert REPORT.rank_seconds() == pytest.approx([0.0155, 0.0465])


def test_the_wait_never_exceeds_the_communication():
    # rank 0 is behind by 40 ms but communicated 10 ms: it waited at most those 10
    r = ProfileReport(step=((0.02,), (0.06,)), communication=((0.01,), (0.0,)))
    assert r.parts()[0][0] == pytest.approx((0.01, 0.0, 0.01))


def test_uneven_step_counts_are_cut_or_refused():
    assert ProfileReport.of([([1.0, 2.0, 3.0], [0.1, 0.1, 0.1]), ([1.0, 2.0], [0, 0])]).steps == 2
    with pytest.raises(ConfigError, match="same steps"):
        ProfileReport(step=((1.0,), (1.0, 2.0)), communication=((0.0,), (0.0, 0.0)))


def test_json_table_and_command(tmp_path, capsys):
    path = tmp_path / "p.json"
    REPORT.to_json(path)
    assert ProfileReport.from_json(path) == REPORT
    assert json.loads(path.read_text())["mean_seconds"][1]["compute"] == pytest.approx(0.0465)
    assert cli.main(["profile-report", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert out.strip() == REPORT.table() and "compute" in out.splitlines()[1]
    assert (tmp_path / "p.png").stat().st_size > 1000
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert cli.main(["profile-report", str(tmp_path / "bad.json")]) == 2
    assert "not a profile" in capsys.readouterr().err


def test_one_rank_profile_has_no_wait_and_restores_the_manager():
    with mpidp.DistributedManager(domain_parallel_size=1, transport="torch") as m:
        with mpidp.profile(m) as prof:
            assert isinstance(m.transport(), TimingTransport)
            for _ in range(2):
                with prof.step():
                    torch.ones(4).sum()
        assert not isinstance(m.transport(), TimingTransport)
        report = prof.report()
        assert report.steps == 2 and all(w == 0 for _, _, w in report.parts()[0])
        assert len(prof.rank_seconds()) == 1 and "1 rank," in prof.summary()


def test_timing_transport_keeps_the_exchange_numbering():
    with mpidp.DistributedManager(domain_parallel_size=1, transport="torch") as m:
        inner = m.transport()
        inner.fetches = 7
        wrapped = TimingTransport(inner, CommClock())
        assert wrapped.fetches == 7
        wrapped.fetches += 1
        assert inner.fetches == 8
