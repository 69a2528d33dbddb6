"""hpc_tp.launch: launcher hints (which variables speak for this world), LaunchInfo from MPI, GPU index.

The environments below are the ones measured under SLURM 22.05 and Open MPI 5 (tests/test_slurm.py
runs the real thing): an sbatch script, an srun step with and without PMI, mpirun inside an allocation.
"""

import pytest
from mpi4py import MPI

from hpc_tp.backend import device_index
from hpc_tp.errors import ConfigError
from hpc_tp.launch import LaunchInfo, check_launch, detect_launcher, in_srun_step, launch_hints

BATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_NPROCS": "4"}
STEP = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4"}
OMPI = {**BATCH, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "PRTE_LAUNCHED": "1"}
# A rank mpirun started on a second node: its prted came from `srun --ntasks-per-node=1` over 2 nodes.
OMPI_REMOTE = {**OMPI, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}
PMI2 = {**STEP, "PMI_SIZE": "4", "PMI_RANK": "1", "PMI_FD": "11"}
HYDRA = {"PMI_SIZE": "4", "PMI_RANK": "1", "PMI_FD": "5", "MPI_LOCALNRANKS": "4"}
HYDRA_REMOTE = {**HYDRA, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}


@pytest.mark.parametrize(
    "env, launcher, hints",
    [
        ({}, "none", {}),
        (BATCH, "none", {}),  # a lone `python` inside sbatch: SLURM_NTASKS is the allocation's, not a hint
        (STEP, "slurm", {"SLURM_STEP_NUM_TASKS": 4}),
        ({k: v for k, v in STEP.items() if k != "SLURM_STEP_NUM_TASKS"}, "slurm", {"SLURM_NTASKS": 4}),
        (OMPI, "openmpi", {"OMPI_COMM_WORLD_SIZE": 4}),
        (OMPI_REMOTE, "openmpi", {"OMPI_COMM_WORLD_SIZE": 4}),  # the daemon step's SLURM_NTASKS=2 is not about ranks
        (PMI2, "slurm", {"PMI_SIZE": 4}),
        (HYDRA, "mpich", {"PMI_SIZE": 4}),
        (HYDRA_REMOTE, "mpich", {"PMI_SIZE": 4}),
    ],
)
def test_launcher_and_hints(env, launcher, hints):
    assert detect_launcher(env) == launcher
    assert launch_hints(env) == hints


def test_in_srun_step_needs_step_and_procid():
    assert not in_srun_step(BATCH)
    assert in_srun_step(STEP)
    assert not in_srun_step({"SLURM_STEP_ID": "0"})


def _scaled(env, size):
    """``env`` with every task count replaced by ``size``."""
    counts = ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    return {k: (str(size) if k in counts else v) for k, v in env.items()}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "env", [STEP, OMPI, OMPI_REMOTE, PMI2, HYDRA], ids=["step", "ompi", "ompi-remote", "pmi2", "hydra"]
)
def test_check_launch_agrees_with_matching_hints(env):
    check_launch(_scaled(env, MPI.COMM_WORLD.Get_size()))


@pytest.mark.mpi(min_size=1)
def test_check_launch_ignores_the_allocation_outside_a_step():
    check_launch({**BATCH, "SLURM_NTASKS": str(MPI.COMM_WORLD.Get_size() + 3)})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "env, var",
    [(STEP, "SLURM_STEP_NUM_TASKS"), (OMPI, "OMPI_COMM_WORLD_SIZE"), (PMI2, "PMI_SIZE"), (HYDRA, "PMI_SIZE")],
)
def test_check_launch_rejects_a_disagreeing_launcher(env, var):
    size = MPI.COMM_WORLD.Get_size()
    with pytest.raises(ConfigError, match=f"{var}={size + 1} but MPI formed a world of") as info:
        check_launch(_scaled(env, size + 1))
    assert ("world of one" in str(info.value)) == (size == 1)
    assert "--mpi=pmix" in str(info.value)


@pytest.mark.mpi(min_size=1)
def test_check_launch_reads_the_process_environment(monkeypatch):
    size = MPI.COMM_WORLD.Get_size()
    for var in ("OMPI_COMM_WORLD_SIZE", "PRTE_LAUNCHED", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in _scaled(STEP, size + 1).items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match="SLURM_STEP_NUM_TASKS"):
        check_launch()
    monkeypatch.delenv("SLURM_STEP_ID")  # the same variables in an sbatch script: not a job step
    check_launch()


@pytest.mark.mpi(min_size=1)
def test_launch_info_from_mpi():
    world = MPI.COMM_WORLD
    info = LaunchInfo.from_mpi()
    names = world.allgather(MPI.Get_processor_name())
    assert (info.rank, info.world_size) == (world.Get_rank(), world.Get_size())
    assert info.nodes == list(dict.fromkeys(names))
    assert info.nodes[info.node_index] == MPI.Get_processor_name()
    assert info.local_size == names.count(MPI.Get_processor_name())
    assert 0 <= info.local_rank < info.local_size
    local_ranks = world.allgather((info.node_index, info.local_rank))
    assert len(set(local_ranks)) == world.Get_size()  # (node, local rank) names each rank once
    assert info.launcher in ("slurm", "openmpi", "mpich", "none")
    assert f"{info.world_size} ranks" in info.summary()


@pytest.mark.mpi(min_size=1)
def test_launch_info_on_a_subcommunicator():
    world = MPI.COMM_WORLD
    sub = world.Split(color=world.Get_rank() % 2, key=world.Get_rank())
    try:
        info = LaunchInfo.from_mpi(sub)
        assert (info.rank, info.world_size) == (sub.Get_rank(), sub.Get_size())
        assert info.local_size <= sub.Get_size()
    finally:
        sub.Free()


@pytest.mark.parametrize("local_rank, n_devices, expected", [(0, 1, 0), (3, 1, 0), (3, 4, 3), (5, 4, 1), (7, 8, 7)])
def test_device_index(local_rank, n_devices, expected):
    assert device_index(local_rank, n_devices) == expected


def test_device_index_without_devices_says_what_to_request():
    with pytest.raises(ConfigError, match="gpus-per-node"):
        device_index(0, 0)
    with pytest.raises(ConfigError, match="local rank -1"):
        device_index(-1, 2)
