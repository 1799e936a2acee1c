"""DistributedManager under a real MPI launch: layouts, groups, errors agreed on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidp
from mpidp.errors import BackendError, ConfigError, LaunchError

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
LAYOUTS = [p for p in range(1, WORLD + 1) if WORLD % p == 0]


@pytest.mark.parametrize("domain", LAYOUTS)
def test_layout_groups_and_communicators(domain):
    with mpidp.init(domain_parallel_size=domain) as m:
        assert mpidp.get_manager() is m
        assert (m.rank, m.world_size) == (RANK, WORLD)
        assert (m.dp_world_size, m.domain_world_size) == (WORLD // domain, domain)
        assert (m.dp_rank, m.domain_rank) == divmod(RANK, domain)
        assert m.mesh.mesh.tolist() == torch.arange(WORLD).reshape(WORLD // domain, domain).tolist()
        assert m.mesh.mesh_dim_names == ("dp", "domain")
        first = m.dp_rank * domain
        assert dist.get_process_group_ranks(m.domain_group) == list(range(first, first + domain))
        assert dist.get_process_group_ranks(m.data_parallel_group) == list(
            range(m.domain_rank, WORLD, domain)
        )
        assert (m.domain_comm.Get_size(), m.domain_comm.Get_rank()) == (domain, m.domain_rank)
        assert (m.dp_comm.Get_size(), m.dp_comm.Get_rank()) == (WORLD // domain, m.dp_rank)
        assert m.is_first_domain_rank == (m.domain_rank == 0)
        assert m.is_last_domain_rank == (m.domain_rank == domain - 1)
        nb = m.neighbor_ranks()
        assert nb.before == (RANK - 1 if m.domain_rank > 0 else None)
        assert nb.after == (RANK + 1 if m.domain_rank < domain - 1 else None)
        nb = m.neighbor_ranks(periodic=True)
        assert nb.before == first + (m.domain_rank - 1) % domain
        assert nb.after == first + (m.domain_rank + 1) % domain
        assert m.local_rank == MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        assert m.launch_info.launcher == "mpich"  # these tests always run under mpiexec
        assert m.device == torch.device("cpu") and m.backend == "gloo"
        assert m.transport().name == "mpi" and m.transport(device="cpu").size == domain
        text = repr(m)
        assert f"rank={RANK}/{WORLD}" in text and f"domain={domain}" in text
        # torch.distributed and MPI agree on who is who in the domain group.
        t = m.transport(m.domain_group)
        assert t.all_gather_object(RANK) == list(range(first, first + domain))
    assert not mpidp.is_initialized() and not dist.is_initialized()


def test_init_twice():
    with mpidp.init(domain_parallel_size=1) as m:
        assert mpidp.init(domain_parallel_size=1) is m
        assert mpidp.DistributedManager.initialize(domain_parallel_size=1) is m
        with pytest.raises(
            ConfigError,
            match=rf"rank {RANK} of \d+: mpidp is already initialised with "
            r"domain_parallel_size=1.*called again with "
            r"domain_parallel_size=2.*shutdown\(\) first",
        ):
            mpidp.init(domain_parallel_size=2)


def test_get_manager_without_init():
    with pytest.raises(ConfigError, match=r"call mpidp\.init"):
        mpidp.get_manager()


def test_world_not_divisible():
    bad = WORLD + 1
    with pytest.raises(
        ConfigError,
        match=rf"rank {RANK}: world size {WORLD} is not divisible by "
        rf"domain_parallel_size {bad}; use one of",
    ):
        mpidp.init(domain_parallel_size=bad)
    assert not dist.is_initialized()


@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_domain_size_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="domain_parallel_size must be an integer >= 1"):
        mpidp.init(domain_parallel_size=bad)


def test_unknown_backend_and_transport():
    with pytest.raises(ConfigError, match="backend 'ucc' is not one of gloo, nccl, mpi"):
        mpidp.init(backend="ucc")
    with pytest.raises(ConfigError, match="transport 'shm' is not one of auto, mpi, torch"):
        mpidp.init(transport="shm")


def test_device_beyond_visible_devices():
    count = torch.cuda.device_count()
    with pytest.raises(BackendError, match=rf"device cuda:{count} but {count} CUDA devices"):
        mpidp.init(device=f"cuda:{count}")
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_without_gpu():
    # A CPU wheel has no NCCL at all; a CUDA wheel on a machine without GPUs has no device.
    with pytest.raises(BackendError, match=rf"rank {RANK}: .*backend 'nccl' .*use backend='gloo'"):
        mpidp.init(backend="nccl")


def test_error_on_one_rank_is_raised_on_every_rank():
    """Only the last rank has a broken environment; all ranks raise, none waits."""
    import os

    env = dict(os.environ)
    if RANK == WORLD - 1:
        env["MPIDP_LAUNCHER"] = "lsf"
    with pytest.raises(
        LaunchError, match=rf"rank {WORLD - 1}: MPIDP_LAUNCHER='lsf' is not a launcher"
    ):
        mpidp.DistributedManager(env=env)
    assert not dist.is_initialized()


def test_forced_torch_transport():
    with mpidp.DistributedManager(domain_parallel_size=WORLD, transport="torch") as m:
        t = m.transport()
        assert (t.name, t.size) == ("torch", WORLD)
        assert t.all_reduce(torch.ones(2)).tolist() == [WORLD, WORLD]


def test_unknown_group():
    with mpidp.DistributedManager() as m, pytest.raises(ConfigError, match="unknown group 'rows'"):
        m.transport("rows")


def test_describe_has_what_info_prints():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as m:
        d = m.describe()
        assert d["rank"] == RANK and d["mesh_coords"] == [0, RANK]
        assert d["mpi_library"].startswith("MPICH")
