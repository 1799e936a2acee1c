"""The scaling model (mpidp/preflight/scaling.py) against its formula on a model small enough to
price by hand: one 3x3 conv over 9 rows at P = 2."""

from __future__ import annotations

import pytest
from torch import nn

from mpidp.preflight.plan import plan_model
from mpidp.preflight.scaling import Network, predict_scaling


def test_one_conv_at_two_ranks_is_its_formula():
    model = nn.Conv2d(2, 2, 3, padding=1)
    shape = (1, 2, 9, 8)
    net = Network("test", alpha=1e-3, beta=1e6)
    one, two = predict_scaling(model, shape, [1, 2], serial_step=1.0, network=net, per_call=1e-4)
    assert (one.step, one.comm, one.calls) == (1.0, 0.0, 0.0)
    priced = plan_model(model, shape, 2, simulate=False)
    busiest = priced.ranks[0]  # 5 of the 9 rows
    params = sum(p.numel() for p in model.parameters()) * 4
    # compute: 5 of 9 rows; halo: one message each way per step (forward and backward);
    # gradient all-reduce: 2 log2(2) latencies and 2 (P - 1) / P of the parameter bytes
    halo = 2 * net.alpha + max(busiest.send_bytes, busiest.recv_bytes) / net.beta
    grads = 2 * net.alpha + params / net.beta
    assert two.rows == 5
    assert two.compute == pytest.approx(5 / 9)
    assert two.comm == pytest.approx(halo + grads)
    assert two.calls == pytest.approx(2 * 1e-4)
    assert two.step == pytest.approx(5 / 9 + halo + grads + 2e-4)
    assert two.memory == 4 * params + busiest.activation_bytes
    # the front end's cost per step is added at every P, and nothing else changes
    one_f, two_f = predict_scaling(
        model, shape, [1, 2], serial_step=1.0, network=net, per_call=1e-4, fixed=0.25
    )
    assert (one_f.step, two_f.step) == (pytest.approx(1.25), pytest.approx(two.step + 0.25))


def test_rank_counts_beyond_the_rows_are_left_out():
    points = predict_scaling(
        nn.Conv2d(1, 1, 3, padding=1), (1, 1, 5, 4), [1, 2, 4, 8], serial_step=1.0,
        network=Network("test", 0.0, 1e9),
    )  # fmt: skip
    assert [p.parts for p in points] == [1, 2, 4]


def test_a_grid_is_priced_as_given_and_its_activations_are_the_plans():
    """An entry (P_lat, P_lon) prices that grid (the validation measures 1 x 2 and 2 x 2), and
    the point's activations are the plan's for its busiest rank, inside its memory."""
    model = nn.Conv2d(2, 2, 3, padding=1)
    shape = (1, 2, 8, 8)
    net = Network("test", alpha=1e-3, beta=1e6)
    bands, blocks = predict_scaling(model, shape, [2, (1, 2)], serial_step=1.0, network=net)
    assert (bands.grid, blocks.grid) == ((2, 1), (1, 2))
    priced = plan_model(model, shape, (1, 2), simulate=False)
    assert blocks.activations == priced.ranks[0].activation_bytes > 0
    params = sum(p.numel() for p in model.parameters()) * 4
    assert blocks.memory == 4 * params + blocks.activations


def test_the_command_offers_every_network_preset():
    from mpidp.cli import build_parser
    from mpidp.preflight.scaling import NETWORKS

    plan = build_parser()._subparsers._group_actions[0].choices["plan"]  # type: ignore[union-attr]
    network = next(a for a in plan._actions if a.dest == "network")
    assert tuple(network.choices) == tuple(NETWORKS)
    assert all(n.source and n.beta > 0 and n.alpha > 0 for n in NETWORKS.values())


def test_a_point_repriced_on_another_network_is_that_networks_prediction():
    model = nn.Conv2d(2, 2, 3, padding=1)
    shape = (1, 2, 9, 8)
    slow, fast = Network("slow", 1e-3, 1e6), Network("fast", 1e-6, 1e10)
    (two,) = predict_scaling(model, shape, [2], serial_step=1.0, network=slow)
    (want,) = predict_scaling(model, shape, [2], serial_step=1.0, network=fast)
    got = two.on(fast)
    assert (got.step, got.comm) == (pytest.approx(want.step), pytest.approx(want.comm))
    assert two.comm == pytest.approx(slow.seconds(two.messages, two.comm_bytes))
