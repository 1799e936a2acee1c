"""Launcher detection from plain dict environments: every launcher, the mixes, the errors."""

from __future__ import annotations

import pytest

from mpidp.errors import LaunchError
from mpidp.runtime.bootstrap import LaunchInfo, detect_launch, expand_nodelist, slurm_port

HOST = "node7"


def detect(env: dict[str, str]) -> LaunchInfo:
    return detect_launch(env, host=HOST)


def test_single_process():
    info = detect({"HOME": "/root"})
    assert info == LaunchInfo("single", 0, 1, 0, 1, HOST)
    assert not info.is_distributed


def test_host_defaults_to_this_machine():
    import socket

    assert detect_launch({}).host == socket.gethostname()


def test_torchrun():
    info = detect(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "n0",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "abc",
        }
    )
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 5, 8)
    assert (info.local_rank, info.local_world_size) == (1, 4)
    assert (info.master_addr, info.master_port, info.job_id) == ("n0", 29500, "abc")


def test_torchrun_under_srun_wins_over_slurm():
    # srun starts one torchrun per node; torchrun's numbering describes the workers.
    info = detect(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0",
        }
    )
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 3, 4)


def test_openmpi():
    info = detect(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "PMIX_RANK": "2",
        }
    )
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "openmpi",
        2,
        4,
        0,
        2,
    )


def test_mpich_hydra():
    info = detect(
        {
            "PMI_RANK": "3",
            "PMI_SIZE": "4",
            "MPI_LOCALRANKID": "3",
            "MPI_LOCALNRANKS": "4",
            "PMI_FD": "9",
        }
    )
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "mpich",
        3,
        4,
        3,
        4,
    )


def test_intel_mpi_uses_the_pmi_variables():
    info = detect(
        {
            "PMI_RANK": "1",
            "PMI_SIZE": "2",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2",
            "I_MPI_ROOT": "/opt/intel/mpi",
        }
    )
    assert (info.launcher, info.rank, info.world_size) == ("mpich", 1, 2)


def test_cray_pals():
    info = detect(
        {
            "PALS_RANKID": "6",
            "PALS_LOCAL_RANKID": "2",
            "PALS_NODEID": "1",
            "PMI_RANK": "6",
            "PMI_SIZE": "8",
            "PMI_LOCAL_SIZE": "4",
            "PALS_APID": "1234",
            "PBS_JOBID": "99.pbs",
        }
    )
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "pals",
        6,
        8,
        2,
        4,
    )
    assert info.job_id == "1234"


def test_pmix_standalone():
    info = detect(
        {
            "PMIX_RANK": "1",
            "PMIX_SIZE": "3",
            "PMIX_LOCAL_RANK": "1",
            "PMIX_LOCAL_SIZE": "3",
            "PMIX_NAMESPACE": "prterun-vm-1@1",
        }
    )
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("pmix", 1, 3, 1)


SLURM_4 = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "nid[001-004,010]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
}


def test_slurm_srun():
    info = detect(SLURM_4)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "slurm",
        3,
        8,
        1,
        2,
    )
    assert info.nodelist == ("nid001", "nid002", "nid003", "nid004", "nid010")
    assert info.master_addr == "nid001"
    assert info.master_port == slurm_port("4242", "0")
    assert info.job_id == "4242"


def test_slurm_uneven_tasks_per_node():
    env = dict(
        SLURM_4,
        SLURM_STEP_TASKS_PER_NODE="3(x2),2",
        SLURM_NTASKS="8",
        SLURM_NODEID="2",
        SLURM_STEP_NODELIST="a[1-3]",
    )
    assert detect(env).local_world_size == 2


def test_slurm_falls_back_to_job_nodelist():
    env = {k: v for k, v in SLURM_4.items() if k != "SLURM_STEP_NODELIST"}
    env["SLURM_JOB_NODELIST"] = "gpu[07-08]"
    assert detect(env).master_addr == "gpu07"


def test_srun_pmi2_is_reported_as_slurm():
    env = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "2",
        "SLURM_STEP_NODELIST": "vm",
        "SLURM_JOB_ID": "7",
        "PMI_RANK": "2",
        "PMI_SIZE": "4",
        "PMI_FD": "5",
    }
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 2, 4, 2)


def test_srun_pmix_is_reported_as_slurm():
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "vm",
        "SLURM_JOB_ID": "7",
        "PMIX_RANK": "1",
    }
    assert detect(env).launcher == "slurm"


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_mpirun_inside_sbatch_mpi_wins(rank):
    # sbatch exports SLURM_PROCID=0 to the batch script; every rank mpirun starts inherits it.
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "55",
        "SLURM_JOB_NODELIST": "vm",
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == (
        "openmpi",
        rank,
        4,
        rank,
    )


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_hydra_mpiexec_inside_sbatch_mpi_wins(rank):
    # Even rank 0, whose PMI numbers agree with SLURM's by coincidence, is labelled consistently.
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "55",
        "SLURM_JOB_NODELIST": "vm",
        "PMI_RANK": str(rank),
        "PMI_SIZE": "4",
        "MPI_LOCALRANKID": str(rank),
        "MPI_LOCALNRANKS": "4",
    }
    info = detect(env)
    assert (info.launcher, info.rank, info.local_rank) == ("mpich", rank, rank)


def test_override_forces_a_source():
    env = dict(SLURM_4, PMI_RANK="0", PMI_SIZE="1", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="1")
    assert detect(env).launcher == "mpich"
    assert detect(dict(env, MPIDP_LAUNCHER="slurm")).rank == 3
    assert detect(dict(env, MPIDP_LAUNCHER="single")).world_size == 1


def test_override_with_missing_variables():
    with pytest.raises(LaunchError, match="MPIDP_LAUNCHER=torchrun but RANK, WORLD_SIZE"):
        detect({"MPIDP_LAUNCHER": "torchrun"})


def test_override_unknown_name():
    with pytest.raises(LaunchError, match="'lsf' is not a launcher; use one of torchrun"):
        detect({"MPIDP_LAUNCHER": "lsf"})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PMI_RANK": "4", "PMI_SIZE": "4"}, r"rank 4 is outside \[0, 4\)"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, "world size 0 < 1"),
        ({"PMI_RANK": "1"}, "PMI_RANK is set but none of PMI_SIZE is"),
        ({"PALS_RANKID": "1"}, "none of PALS_SIZE, PMI_SIZE is"),
        ({"PMIX_RANK": "0"}, "cannot tell the world size"),
        ({"SLURM_PROCID": "0"}, "SLURM_NTASKS is not"),
        (
            {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"},
            "WORLD_SIZE='two' is not an integer",
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "5", "MPI_LOCALNRANKS": "4"},
            r"local rank 5 is outside \[0, 4\)",
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"},
            "local world size 3 > world size 2",
        ),
        (dict(SLURM_4, SLURM_STEP_TASKS_PER_NODE="2(x"), "cannot read SLURM tasks per node"),
    ],
)
def test_inconsistent_environments_raise(env, message):
    with pytest.raises(LaunchError, match=message):
        detect(env)


def test_nodelist_expansion():
    assert expand_nodelist("nid[001-003],login1") == ("nid001", "nid002", "nid003", "login1")
    assert expand_nodelist("r[1-2]n[01-02]") == ("r1n01", "r1n02", "r2n01", "r2n02")
    with pytest.raises(LaunchError, match="cannot expand SLURM node list"):
        expand_nodelist("nid[003-001")


def test_slurm_port_is_stable_and_in_range():
    ports = {slurm_port(str(j), "0") for j in range(1000, 1100)}
    assert len(ports) == 100
    assert all(12000 <= p < 32000 for p in ports)
    assert slurm_port("123", "0") != slurm_port("123", "1")
    assert slurm_port("123", None) == slurm_port("123", "0")
    # the old linear mix gave job J step 7 and job J + 1 step 0 one port (issue 19)
    assert all(slurm_port(str(j), "7") != slurm_port(str(j + 1), "0") for j in range(1000, 2000))
    steps = {slurm_port(str(j), str(s)) for j in range(1000, 1100) for s in range(8)}
    assert len(steps) >= 760  # 800 steps: a hash, about 16 chance collisions in 20000 ports


def test_an_exported_master_port_wins_under_slurm():
    env = {**SLURM_4, "MASTER_PORT": "23456", "MASTER_ADDR": "n9"}
    info = detect_launch(env, host="node7")
    assert (info.master_addr, info.master_port) == ("n9", 23456)


def test_repr_is_readable():
    text = repr(detect(SLURM_4))
    assert text.startswith("LaunchInfo(slurm, rank=3/8, local_rank=1/2, host=node7")
