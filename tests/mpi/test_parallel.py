"""Domain parallelism composed with DDP, FSDP2 and tensor parallelism (mpidp.parallel).

Every layout that fits the world (1-4 ranks) trains a small model for five steps in float64;
the losses and the gathered weights must be the serial run's, and the checkpoint must load
into the serial model (and its optimizer) and back into a fresh parallel model. Shards are
uneven: 11 latitude rows and 5 hidden channels.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.errors import ConfigError
from mpidp.io import load_checkpoint, save_checkpoint
from mpidp.parallel import (
    ParallelismConfig,
    TensorParallelConv2d,
    TensorParallelLinear,
    apply_ddp,
    apply_domain_parallel,
    apply_fsdp2,
    apply_tensor_parallel,
    build_device_mesh,
    full_state_dict,
    sync_domain_gradients,
)

WORLD = MPI.COMM_WORLD
SIZE, ME = WORLD.Get_size(), WORLD.Get_rank()
C, H, W, HIDDEN, STEPS = 3, 11, 8, 5, 5
DT = torch.float64


class ChannelMLP(nn.Module):
    """Channels-last linears: a block that opts in to tensor parallelism on its own."""

    _tp_col = ("fc1",)
    _tp_row = ("fc2",)

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(self.act(self.fc1(x.permute(0, 2, 3, 1))))
        return x + y.permute(0, 3, 1, 2)


class Net(nn.Module):
    """3x3 convs (halos, circular in longitude), GroupNorm (band statistics), a 1x1-conv
    column/row pair declared at the root and a Linear pair declared by a child block."""

    _tp_col = ("mix.0",)
    _tp_row = ("mix.2",)
    _fsdp_blocks = ("stem", "mix", "mlp")

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(C, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.SiLU())
        self.mix = nn.Sequential(nn.Conv2d(6, HIDDEN, 1), nn.SiLU(), nn.Conv2d(HIDDEN, 6, 1))
        self.mlp = ChannelMLP(6, HIDDEN)
        self.head = nn.Conv2d(6, C, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = h + self.mix(h)
        return x + self.head(self.mlp(h))


# (data, tensor, domain) per world size: the 2 x 2 combinations at 4 ranks, uneven
# channel splits (5 hidden channels over 2, 3 and 4 tp ranks), thin bands (11 rows over 4),
# and dp > 1 with each data mode; every entry runs (nothing is skipped).
_LAYOUTS = {
    1: [("ddp", 1, 1), ("fsdp2", 1, 1), ("none", 1, 1)],
    2: [("ddp", 1, 2), ("fsdp2", 1, 2), ("none", 2, 1), ("fsdp2", 2, 1), ("ddp", 1, 1)],
    3: [("ddp", 1, 3), ("fsdp2", 1, 1), ("none", 3, 1), ("fsdp2", 3, 1), ("none", 1, 1)],
    4: [
        ("ddp", 1, 2),
        ("fsdp2", 1, 2),
        ("none", 2, 2),
        ("fsdp2", 2, 1),
        ("ddp", 2, 2),
        ("fsdp2", 2, 2),
        ("none", 4, 1),
        ("none", 1, 4),
        ("ddp", 1, 1),
    ],
    # the 3-D mesh, oversubscribed in scripts/test.sh (-k five_steps): 80 s on 2 cores
    8: [("fsdp2", 2, 2), ("ddp", 2, 2)],
}


def _layouts(world: int) -> list[tuple[str, int, int]]:
    if world in _LAYOUTS:
        return _LAYOUTS[world]
    return [(data, 1, world) for data in ("ddp", "fsdp2", "none")]


LAYOUTS = _layouts(SIZE)


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    path = WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-parallel-") if ME == 0 else None)
    yield Path(path)
    WORLD.Barrier()
    if ME == 0:
        shutil.rmtree(path, ignore_errors=True)


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, batch, C, H, W, generator=g, dtype=DT)
    target = torch.randn(STEPS, batch, C, H, W, generator=g, dtype=DT)
    lat = torch.linspace(89.0, -89.0, H, dtype=DT)
    weights = torch.cos(torch.deg2rad(lat)).unsqueeze(-1)
    return x, target, weights


def _serial_run(batch: int) -> tuple[Net, torch.optim.Optimizer, list[float]]:
    torch.manual_seed(3)
    model = Net().to(DT)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, target, weights = _data(batch)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        err = (model(x[s]) - target[s]).square()
        w = weights.expand_as(err)
        loss = (err * w).sum() / w.sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


def _build(data: str, tensor: int, domain: int, manager: mpidp.DistributedManager):
    meshes = build_device_mesh({"data": data, "tensor": tensor, "domain": domain}, manager=manager)
    torch.manual_seed(3)
    model = Net().to(DT)
    mpidp.broadcast_parameters(model, manager)
    apply_tensor_parallel(model, meshes.get("tp"))
    model = apply_domain_parallel(model, meshes.get("domain", manager))
    if data == "fsdp2":
        apply_fsdp2(model, meshes["dp"])
    elif data == "ddp":
        model = apply_ddp(model, meshes["dp"])
    return meshes, model


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: f"{c[0]}-tp{c[1]}-domain{c[2]}")
def test_five_steps_match_serial_and_checkpoint_loads_serially(layout, shared):
    data, tensor, domain = layout
    dp = SIZE // (tensor * domain)
    batch = 2 * dp
    serial, serial_opt, serial_losses = _serial_run(batch)
    with mpidp.DistributedManager(domain_parallel_size=domain) as manager:
        meshes, model = _build(data, tensor, domain, manager)
        assert (meshes.dp_size, meshes.tp_size, meshes.domain_size) == (dp, tensor, domain)
        assert manager.domain_rank == meshes.domain_rank and manager.dp_rank == (
            meshes.dp_rank * tensor + meshes.tp_rank
        )
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x, target, weights = _data(batch)
        mine = slice(meshes.dp_rank * 2, meshes.dp_rank * 2 + 2)
        rows = manager.spec(H).slice(manager.domain_rank)
        world = manager.transport("world")
        losses = []
        for s in range(STEPS):
            opt.zero_grad()
            out = model(x[s, mine, :, rows])
            err = (out - target[s, mine, :, rows]).square()
            loss = mpidp.global_mean(err, weights[rows], manager=manager)
            loss.backward()
            meshes.sync_gradients(model)
            opt.step()
            losses.append(world.all_reduce(loss.detach(), "sum").item() / SIZE)
        assert losses == pytest.approx(serial_losses, rel=1e-11, abs=1e-13)

        full = full_state_dict(model)
        want = serial.state_dict()
        assert sorted(full) == sorted(want)
        for k in want:
            torch.testing.assert_close(full[k], want[k], rtol=1e-12, atol=1e-14, msg=k)

        path = shared / f"{data}-{tensor}-{domain}.pt"
        save_checkpoint(path, model, opt, step=STEPS, manager=manager)
        saved = torch.load(path, weights_only=False)
        assert saved["layout"] == {"world": SIZE, "dp": dp, "tensor": tensor, "domain": domain}
        fresh = Net().to(DT)
        fresh.load_state_dict(saved["model"])  # the serial model loads it as it is
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        fresh_opt.load_state_dict(saved["optimizer"])
        for (name, p), q in zip(serial.named_parameters(), fresh.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14, msg=name)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    fresh_opt.state[q][key], serial_opt.state[p][key], rtol=1e-12, atol=1e-14
                )

        # ... and back into a fresh parallel model, which then takes the same sixth step.
        _, again = _build(data, tensor, domain, manager)
        again_opt = torch.optim.Adam(again.parameters(), lr=0.01)
        load_checkpoint(path, again, again_opt, manager=manager)
        reloaded = full_state_dict(again)
        for k in want:
            torch.testing.assert_close(reloaded[k], want[k], rtol=1e-12, atol=1e-14, msg=k)
        for m, o in ((model, opt), (again, again_opt)):
            o.zero_grad()
            out = m(x[0, mine, :, rows])
            loss = mpidp.global_mean(
                (out - target[0, mine, :, rows]).square(), weights[rows], manager=manager
            )
            loss.backward()
            meshes.sync_gradients(m)
            o.step()
        after, after_again = full_state_dict(model), full_state_dict(again)
        for k in want:
            torch.testing.assert_close(after_again[k], after[k], rtol=1e-12, atol=1e-14, msg=k)


def test_tensor_parallel_shards_are_slices_and_untouched_by_the_domain_sum():
    """With tensor x domain = world (or the largest tp that fits): every rank's shard gradient
    is its slice of the serial gradient after the domain sum, not a sum over tp shards."""
    tensor = 2 if SIZE % 2 == 0 else SIZE
    domain = SIZE // tensor
    torch.manual_seed(3)
    serial = Net().to(DT)
    x, target, weights = _data(1)
    err = (serial(x[0]) - target[0]).square()
    w = weights.expand_as(err)
    ((err * w).sum() / w.sum()).backward()
    with mpidp.DistributedManager(domain_parallel_size=domain) as manager:
        meshes = build_device_mesh(
            ParallelismConfig(data="none", tensor=tensor, domain=domain), manager=manager
        )
        model = copy.deepcopy(serial)
        model.zero_grad()
        apply_tensor_parallel(model, meshes.get("tp"))
        model = apply_domain_parallel(model, manager)
        rows = manager.spec(H).slice(manager.domain_rank)
        out = model(x[0, :, :, rows])
        err = (out - target[0, :, :, rows]).square()
        mpidp.global_mean(err, weights[rows], manager=manager).backward()
        sync_domain_gradients(model, manager)
        layers = [
            m for m in model.modules() if isinstance(m, TensorParallelConv2d | TensorParallelLinear)
        ]
        assert len(layers) == (4 if tensor > 1 else 0)
        serial_params = dict(serial.named_parameters())
        for name, p in model.named_parameters():
            owner = model.get_submodule(name.rpartition(".")[0])
            want = serial_params[name].grad
            dim = getattr(owner, "shards", {}).get(name.rpartition(".")[2])
            if dim is not None:
                part = owner.spec.slice(meshes.tp_rank)
                want = want.narrow(dim, part.start, part.stop - part.start)
                assert p.shape[dim] == owner.spec.sizes[meshes.tp_rank]
            torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-13, msg=name)
        with (
            pytest.raises(ConfigError, match="sync_domain_gradients") if tensor > 1 else _nothing()
        ):
            mpidp.sync_gradients(model, manager)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_fsdp2_mixed_precision_from_the_config():
    """param_dtype float32 on a float64 model: the float32 run's losses are the serial float64
    losses to float32 accuracy, and the sharded master weights stay float64."""
    domain = 2 if SIZE % 2 == 0 else 1
    dp = SIZE // domain
    conf = {
        "data": "fsdp2",
        "tensor": 1,
        "domain": domain,
        "mixed_precision": {"param_dtype": "float32", "reduce_dtype": "float64"},
    }
    _, _, serial_losses = _serial_run(2 * dp)
    with mpidp.DistributedManager(domain_parallel_size=domain) as manager:
        meshes = build_device_mesh(conf, manager=manager)
        torch.manual_seed(3)
        model = apply_domain_parallel(Net().to(DT), manager)
        apply_fsdp2(model, meshes["dp"], config=meshes.config)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x, target, weights = _data(2 * dp)
        mine = slice(meshes.dp_rank * 2, meshes.dp_rank * 2 + 2)
        rows = manager.spec(H).slice(manager.domain_rank)
        losses = []
        for s in range(STEPS):
            opt.zero_grad()
            out = model(x[s, mine, :, rows])
            assert out.dtype == torch.float32
            err = (out.double() - target[s, mine, :, rows]).square()
            loss = mpidp.global_mean(err, weights[rows], manager=manager)
            loss.backward()
            sync_domain_gradients(model, manager)
            opt.step()
            losses.append(manager.transport("world").all_reduce(loss.detach()).item() / SIZE)
        assert all(p.dtype == DT for p in model.parameters())
        assert losses == pytest.approx(serial_losses, rel=1e-4)
        assert losses != pytest.approx(serial_losses, rel=1e-12, abs=0)  # really float32


def test_errors_name_the_sizes():
    with pytest.raises(
        ConfigError,
        match=rf"world size {SIZE} is not divisible by tensor 1 x "
        rf"domain {SIZE + 1} = {SIZE + 1}",
    ):
        build_device_mesh({"data": "ddp", "tensor": 1, "domain": SIZE + 1})
    with pytest.raises(ConfigError, match="data='nccl' is not one of"):
        ParallelismConfig.coerce({"data": "nccl"})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['tensr'\]"):
        ParallelismConfig.coerce({"data": "ddp", "tensr": 2})
    with pytest.raises(ConfigError, match="tensor must be an integer >= 1, got 0"):
        ParallelismConfig(tensor=0)
    with pytest.raises(ConfigError, match="mixed_precision is applied by FSDP2"):
        ParallelismConfig(data="ddp", mixed_precision={"param_dtype": "bfloat16"})
    with pytest.raises(
        ConfigError, match=r"data='none' with tensor 2 leaves dp = 8 / \(2 x 1\) = 4"
    ):
        ParallelismConfig(data="none", tensor=2).sizes(8)


def test_tensor_parallel_refuses_what_it_cannot_split():
    class Bad(nn.Module):
        _tp_col = ("conv", "missing", "small")
        _tp_row = ("lin",)

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3)
            self.small = nn.Linear(4, 1)
            self.lin = nn.Linear(1, 4)

    tensor = SIZE
    with mpidp.DistributedManager(domain_parallel_size=1) as manager:
        meshes = build_device_mesh({"data": "none", "tensor": tensor, "domain": 1}, manager=manager)
        if tensor == 1:
            model = Bad()
            assert apply_tensor_parallel(model, meshes.get("tp")) is model  # nothing to split
            return
        with pytest.raises(ConfigError) as err:
            apply_tensor_parallel(Bad(), meshes["tp"])
        text = str(err.value)
        assert "conv: a tensor-parallel Conv2d must be 1x1" in text
        assert "missing: no such module" in text
        assert f"small: 1 output channels cannot be split over {tensor}" in text
        assert f"lin: 1 input channels cannot be split over {tensor}" in text


def test_sub_meshes_present_and_unpacking():
    with mpidp.DistributedManager(domain_parallel_size=SIZE) as manager:
        meshes = build_device_mesh({"data": "ddp", "tensor": 1, "domain": SIZE}, manager=manager)
        mesh, submeshes = meshes
        assert mesh.mesh_dim_names == ("dp", "tp", "domain")
        assert "dp" in meshes and "tp" not in meshes
        assert ("domain" in meshes) == (SIZE > 1)
        assert meshes["dp"].size() == 1 and set(submeshes) == set(meshes.submeshes)
        with pytest.raises(KeyError, match="no 'tp' sub-mesh"):
            meshes["tp"]
        if SIZE > 1:
            assert meshes["domain"].mesh.tolist() == list(range(SIZE))


_CREDIT = {1: ("fsdp2", 1), 2: ("none", 2), 3: ("none", 3), 4: ("fsdp2", 2)}


@pytest.mark.skipif(SIZE not in _CREDIT, reason="the CREDIT loop runs at 1-4 ranks")
def test_credit_training_loop_with_only_the_import_changed():
    """CREDIT's gen2 wrapper: build_device_mesh, apply_domain_parallel, apply_fsdp2(model,
    dp_mesh, conf); each rank's loss the mean over its rows (CREDIT's); the domain average of
    sync_domain_gradients (row-weighted: exact on 11 rows over 2-3 ranks); three Adam steps
    give the serial weights."""
    from mpidp.compat.credit.domain_parallel import shard_tensor
    from mpidp.compat.credit.parallel import (
        apply_domain_parallel as credit_domain,
    )
    from mpidp.compat.credit.parallel import (
        apply_fsdp2 as credit_fsdp2,
    )
    from mpidp.compat.credit.parallel import (
        build_device_mesh as credit_mesh,
    )
    from mpidp.compat.credit.parallel import (
        sync_domain_gradients as credit_sync,
    )

    data, domain = _CREDIT[SIZE]
    dp = SIZE // domain
    batch, steps = 2 * dp, 3
    x, target, _ = _data(batch)
    torch.manual_seed(3)
    serial = Net().to(DT)
    serial_opt = torch.optim.Adam(serial.parameters(), lr=0.01)
    for s in range(steps):
        serial_opt.zero_grad()
        nn.functional.mse_loss(serial(x[s]), target[s]).backward()
        serial_opt.step()

    conf = {"trainer": {"parallelism": {"data": data, "tensor": 1, "domain": domain}}}
    with mpidp.init(domain_parallel_size=domain) as manager:
        _mesh, submeshes = credit_mesh(conf["trainer"]["parallelism"], device="cpu")
        assert ("dp" in submeshes) == (dp > 1)  # CREDIT's keys: "dp" only when dp > 1
        torch.manual_seed(3)
        model = Net().to(DT)
        if submeshes.get("domain"):
            model = credit_domain(model, submeshes["domain"])
        if data == "fsdp2":
            model = credit_fsdp2(model, submeshes.get("dp"), conf)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        dm = getattr(model, "_domain_parallel_manager", None)
        mine = slice(manager.dp_rank * 2, manager.dp_rank * 2 + 2)
        for s in range(steps):
            opt.zero_grad()
            xs, ys = x[s, mine], target[s, mine]
            if dm is not None:
                xs, ys = shard_tensor(xs, manager=dm), shard_tensor(ys, manager=dm)
            nn.functional.mse_loss(model(xs), ys).backward()
            credit_sync(model, dm)
            opt.step()
        full = full_state_dict(model)
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-10, atol=1e-12, msg=k)
