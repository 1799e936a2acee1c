"""The scaling model (mpidp/preflight/scaling.py) against its formula on a model small enough to
price by hand (one 3x3 conv over 9 rows at P = 2), its measured terms never negative, and
call costs by layer kind."""

from __future__ import annotations

import pytest
from torch import nn

from mpidp.preflight.plan import plan_model
from mpidp.preflight.scaling import Network, excess, predict_scaling


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


def test_a_measured_excess_is_the_median_round_difference_and_never_negative():
    """Two costs timed in interleaved rounds: a slow spell in one round cancels in its
    difference; two equal costs measured noisily can differ either way, and the term a
    prediction adds stays at 0 (a negative fixed cost gave a negative step at P = 4)."""
    over, base = [5.0, 9.0, 5.5, 5.2, 5.1], [4.0, 8.0, 4.0, 4.2, 4.3]
    assert excess(over, base) == pytest.approx(1.0)  # differences 1, 1, 1.5, 1, 0.8
    assert excess([4.0, 4.1, 3.9, 4.0], [4.2, 4.0, 4.1, 4.3]) == 0.0  # median -0.15: floored
    assert excess([], []) == 0.0
    with pytest.raises(ValueError, match="pair them"):
        excess([1.0], [1.0, 2.0])


def test_a_negative_fixed_or_call_cost_never_lowers_the_step():
    model = nn.Conv2d(2, 2, 3, padding=1)
    shape = (1, 2, 9, 8)
    net = Network("test", alpha=1e-3, beta=1e6)
    kw = {"serial_step": 1.0, "network": net}
    base = predict_scaling(model, shape, [1, 2], per_call=0.0, **kw)
    noisy = predict_scaling(model, shape, [1, 2], per_call=-1.0, fixed=-5.0, **kw)
    kinds = predict_scaling(model, shape, [1, 2], per_call={"Conv2d": -1.0}, fixed=-5.0, **kw)
    for got in (noisy, kinds):
        assert [p.step for p in got] == pytest.approx([p.step for p in base])
        assert all(p.step > 0 and p.fixed == 0.0 and p.calls == 0.0 for p in got)


def test_call_costs_by_kind_price_each_layer_of_the_kind():
    """A 3x3 conv, a 3x3 max pool and a 1x1 conv (both convs of kind Conv2d) at P = 2: a
    mapping prices each layer by its kind, forward and backward; a kind it does not name
    costs nothing; one figure prices every layer. (A pool, not the U-Net's GroupNorm: a
    norm's dry run on meta tensors costs seconds of torch's first compile.)"""
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.MaxPool2d(3, 1, 1), nn.Conv2d(2, 2, 1))
    shape = (1, 2, 9, 8)
    kw = {"serial_step": 1.0, "network": Network("test", 0.0, 1e9)}
    (pools,) = predict_scaling(model, shape, [2], per_call={"MaxPool2d": 1e-3}, **kw)
    assert pools.calls == pytest.approx(2 * 1e-3)
    (both,) = predict_scaling(model, shape, [2], per_call={"Conv2d": 1e-4, "MaxPool2d": 1e-3}, **kw)
    assert both.calls == pytest.approx(2 * (2 * 1e-4 + 1e-3))
    assert both.step == pytest.approx(pools.step + 4e-4)
    (one,) = predict_scaling(model, shape, [2], per_call=1e-4, **kw)
    assert one.calls == pytest.approx(2 * 3 * 1e-4)


def test_the_command_takes_one_call_cost_or_one_per_kind():
    from mpidp.cli.plan import _per_call
    from mpidp.errors import ConfigError

    assert _per_call(["2e-4"]) == 2e-4
    assert _per_call(["GroupNorm=1e-3", "Conv2d=0"]) == {"GroupNorm": 1e-3, "Conv2d": 0.0}
    for bad in (["GroupNorm"], ["GroupNorm=fast"], ["=1e-3"], ["1e-4", "2e-4"]):
        with pytest.raises(ConfigError, match="KIND=SECONDS"):
            _per_call(bad)
