"""Compat entry points on the user's own groups, as their users run them: torch.distributed set
up by the user (gloo, no ``mpidp.init`` first) and domain groups from their own
``dist.new_group`` (4 ranks: two groups of 2, in runs {0, 1}, {2, 3} and strided {0, 2},
{1, 3}; 3 ranks: {0, 1} and {2}), each group on its own sample, against serial torch in
float64 on uneven bands (H = 13):

* CREDIT's ``apply_domain_parallel(model, group)``: the model runs on the user's group (never
  mpidp's default one), and so do CREDIT's layers, ``HaloExchange``, ``shard_tensor`` and
  ``gather_tensor`` given no manager (they read the process-wide manager
  apply_domain_parallel sets, as CREDIT's do): forward, input gradient, every parameter
  gradient after ``sync_domain_gradients``; the manager's ``neighbor_ranks`` are global;
* ``apply_fsdp2(model, None, conf)`` after it is refused on every rank (the data-parallel
  partners of the user's group are unknown; never the world);
* a layer called with a ShardedTensor of a group while mpidp's default manager is another
  (blocks over the world): a layer bound to no manager computes on the tensor's group; one
  bound to the default manager is refused on every rank (never run over another group); a
  model converted with no manager computes on the tensor's group too; a CREDIT layer given
  no manager computes on CREDIT's process-wide one, not the default;
* ``mpidp.sync_gradients`` and ``GradientSync`` with the manager of a user's group sum over
  that group alone (they summed over the world: the other group's gradients came in).

Checks are asserted only after every collective of a test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import close, own_process_group, rand, refusal
from mpi4py import MPI
from test_compat_credit import serial_net
from torch import nn

import mpidp
from mpidp.compat.credit import domain_parallel as dp
from mpidp.compat.credit import parallel as cp
from mpidp.layers import DomainParallelConv2d
from mpidp.runtime import adopt
from mpidp.runtime.adopt import manager_for
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import ShardedTensor

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()
H, W = 13, 8

#: the user's domain groups at this world size (every rank makes every group, in this order)
LAYOUTS = {
    1: {"one": [[0]]},
    2: {"pair": [[0, 1]]},
    3: {"runs": [[0, 1], [2]]},
    4: {"runs": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]]},
}[WORLD]


@pytest.fixture(scope="module")
def own_torch():
    """The user's own torch.distributed set-up (no mpidp)."""
    with own_process_group():
        yield
        adopt.release()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def group(own_torch, request):
    """(this rank's group, its index, its ranks) from the user's ``dist.new_group`` calls."""
    mine = None
    for i, ranks in enumerate(LAYOUTS[request.param]):
        g = dist.new_group(ranks)
        mine = (g, i, ranks) if ME in ranks else mine
    return mine


def _band(t, ranks):
    return t[..., ShardSpec.balanced(H, len(ranks)).slice(ranks.index(ME)), :]


def test_credit_apply_domain_parallel_runs_on_the_users_group(group):
    g, i, ranks = group
    x, y = rand((1, 2, H, W), 10 + i), rand((1, 2, H, W), 20 + i)  # a sample per group
    ref = serial_net()
    xr = x.clone().requires_grad_()
    want = ref(xr)
    F.mse_loss(want, y).backward()
    torch.manual_seed(3)
    conv, norm = nn.Conv2d(2, 3, 3, padding=1).double(), nn.GroupNorm(1, 2).double()
    serial_layers = [conv(x), norm(x), F.pad(x, (0, 0, 1, 1))]

    model = cp.apply_domain_parallel(serial_net(), g)
    man = cp.get_domain_manager(model)
    xb = cp.shard_spatial(x, man).requires_grad_()
    out = model(xb)
    whole = dp.gather_tensor(out)  # no manager: the process-wide one, as CREDIT's
    F.mse_loss(out, cp.shard_spatial(y, man)).backward()
    cp.sync_domain_gradients(model, man)
    grads = [
        close(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    ]
    # CREDIT's layers and HaloExchange given no manager: the process-wide one (the group's)
    band = xb.detach()
    layers = [dp.DomainParallelConv2d(conv)(band), dp.DomainParallelGroupNorm(norm)(band)]
    halo = dp.HaloExchange(1)(band)
    fsdp = refusal(lambda: cp.apply_fsdp2(model, None, {}))  # CREDIT's None: dp not known
    k = ranks.index(ME)
    rows = ShardSpec.balanced(H, len(ranks)).slice(k)
    padded = serial_layers[2][..., rows.start : rows.stop + 2, :]

    i_before, i_after = k - 1 if k > 0 else None, k + 1 if k < len(ranks) - 1 else None
    assert dp.get_domain_parallel_manager() is man and man.domain_group is g
    assert man.manager.domain_ranks == tuple(ranks)
    assert tuple(man.neighbor_ranks()) == tuple(
        None if j is None else ranks[j] for j in (i_before, i_after)
    )
    assert not mpidp.is_initialized()  # nothing initialised behind the user's back
    assert close(dp.shard_tensor(x), _band(x, ranks))  # no manager: likewise
    assert close(out, _band(want.detach(), ranks)) and close(whole, want.detach())
    # every rank's loss is its share of the mean times the group's size (CREDIT's average)
    assert close(xb.grad, len(ranks) * _band(xr.grad, ranks))
    assert all(grads), grads
    pairs = zip(layers, serial_layers[:2], strict=True)
    assert [close(a, _band(b.detach(), ranks)) for a, b in pairs] == [True, True]
    assert close(halo, padded)
    assert fsdp is not None and "pass the data-parallel mesh" in fsdp, fsdp


@pytest.fixture(scope="module")
def decoy(group):
    """mpidp's default manager over every rank as blocks (1, P): not the user's group (nor,
    on one rank, anything else)."""
    with mpidp.init(domain_parallel_size=(1, WORLD)) as m:
        yield m


def test_a_layer_on_a_sharded_tensor_takes_the_tensors_group_or_is_refused(group, decoy):
    g, i, ranks = group
    m = manager_for(g)
    x = rand((1, 2, H, W), 30 + i)
    torch.manual_seed(4)
    serial = nn.Conv2d(2, 3, 3, padding=1).double()
    want = serial(x)

    free = DomainParallelConv2d.from_module(serial)  # bound to no manager
    got = free(ShardedTensor.from_local(_band(x, ranks), dim=-2, manager=m))
    net = mpidp.convert_to_domain_parallel(nn.Sequential(copy.deepcopy(serial)))  # no manager
    via_net = net(ShardedTensor.from_local(_band(x, ranks), dim=-2, manager=m))
    cp.apply_domain_parallel(nn.Identity(), g)  # CREDIT's process-wide manager: the group's
    credit = dp.DomainParallelConv2d(serial)(_band(x, ranks))  # no manager: that one
    tied = DomainParallelConv2d.from_module(serial, decoy)  # bound to the default manager
    why = refusal(lambda: tied(ShardedTensor.from_local(_band(x, ranks), dim=-2, manager=m)))
    whole = got.full_tensor()

    assert got.manager is m and close(whole, want.detach())
    assert close(credit, _band(want.detach(), ranks))
    assert close(via_net, _band(want.detach(), ranks))
    if m is decoy:  # one rank: the group is the default manager's
        assert why is None
    else:
        assert why is not None and f"rank {ME}: DomainParallelConv2d runs on the domain" in why, why
        assert f"ShardedTensor of the domain group {ranks}" in why, why


def test_mpidp_sync_gradients_on_the_users_group(group):
    """mpidp's own training step on a user's group: the model converted over it, the
    gradients summed by ``mpidp.sync_gradients(model, manager_for(group))`` and by
    ``GradientSync`` over the group alone (the other group's sample never enters)."""
    g, i, ranks = group
    x = rand((1, 2, H, W), 40 + i)
    ref = serial_net()
    (ref(x) ** 2).sum().backward()

    m = manager_for(g)
    model = mpidp.parallel.apply_domain_parallel(serial_net(), g)
    (model(_band(x, ranks)) ** 2).sum().backward()
    mpidp.sync_gradients(model, m)
    synced = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    overlapped = mpidp.GradientSync(model, m)
    (model(_band(x, ranks)) ** 2).sum().backward()
    overlapped.wait()
    overlapped.remove()

    for got in (synced, [p.grad for p in model.parameters()]):
        pairs = zip(got, ref.parameters(), strict=True)
        assert [close(a, q.grad) for a, q in pairs] == [True] * len(got)
