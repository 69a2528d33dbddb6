"""How this process was launched (mpiexec, srun, or alone), where it sits, and how it fails.

Rank, world size, node-local rank and node names come from MPI itself (``COMM_WORLD``,
``Split_type(COMM_TYPE_SHARED)``, ``Get_processor_name``); launcher variables are only hints,
used to name the launcher and to catch the classic mistake of every process forming a world of one
(``srun`` without a PMI plugin the MPI library speaks, or mpi4py built against another MPI).

Which hints can be trusted, as measured under SLURM 22.05 and Open MPI 5 (tests/test_slurm.py):

- Inside an ``sbatch`` script, ``SLURM_NTASKS`` and ``SLURM_PROCID=0`` describe the allocation even
  for a single ``python`` started without ``srun``: not a hint about this world.
- A job step started by ``srun`` has ``SLURM_STEP_ID`` and ``SLURM_PROCID``; its task count is
  ``SLURM_STEP_NUM_TASKS`` (``SLURM_NTASKS`` in the step is the same number).
- ``mpirun``/``mpiexec`` of Open MPI sets ``OMPI_COMM_WORLD_SIZE``; MPICH's and Intel MPI's Hydra, and
  ``srun --mpi=pmi2``, set ``PMI_SIZE``. On several nodes these launchers start their daemons with
  ``srun`` (one task per node), so the ranks also carry that daemon step's ``SLURM_*`` variables:
  when an MPI launcher's variable is present, it is the one that counts ranks.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from mpi4py import MPI

from .comm.abort import abort_job, last_words
from .comm.watchdog import error_agreement_seconds, where_this_rank_is
from .errors import ConfigError

LAUNCHERS = ("slurm", "openmpi", "mpich", "none")
# Variables only Hydra (MPICH, Intel MPI) sets; srun --mpi=pmi2 sets PMI_SIZE/PMI_RANK/PMI_FD but none of these.
_HYDRA_VARS = ("HYDI_CONTROL_FD", "MPI_LOCALNRANKS", "PMI_PORT")


def world_rank() -> int:
    return MPI.COMM_WORLD.Get_rank()


# After install_abort_on_exception: a duplicate of COMM_WORLD on which failing ranks agree (see report_error).
_failure_comm = None
AGREE_SECONDS = 10.0  # how long a rank with a user error waits for the others to report the same
_agree_seconds = AGREE_SECONDS


def agree_within(seconds: float):
    """Wait at most ``seconds`` (and never longer than before) for the other ranks to share a user
    error. A collective watchdog's half timeout bounds it too (``comm.watchdog.error_agreement_seconds``):
    waiting longer, this rank would go silent while the others' watchdog aborts the job for it."""
    global _agree_seconds
    _agree_seconds = min(_agree_seconds, seconds)


def report_error(error: Exception):
    """One line on rank 0 when every rank raised the error, which is the rule for user errors.

    After ``install_abort_on_exception``, the ranks first agree on it (a non-blocking barrier on a
    communicator of their own): a rank whose error the others do not share within ``AGREE_SECONDS``
    (less after ``agree_within``, and under a collective watchdog)
    prints it with its rank and aborts the job, because returning would leave it waiting in
    ``MPI_Finalize`` for ranks that wait in a collective for it.
    """
    seconds = min(_agree_seconds, error_agreement_seconds() or _agree_seconds)
    if _failure_comm is not None and not _all_ranks_agree(_failure_comm, seconds):
        last_words(f"error: rank {world_rank()}: {error} (the other ranks did not fail alike: aborting the job)")
        abort_job(2, _failure_comm)
    if world_rank() == 0:
        print(f"hpc-tp: error: {error}", file=sys.stderr, flush=True)


def _all_ranks_agree(comm, seconds: float) -> bool:
    request, deadline = comm.Ibarrier(), time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _int(env, name):
    value = env.get(name, "")
    return int(value) if value.strip().isdigit() else None


def in_srun_step(env=None) -> bool:
    """True in a task of a job step started by ``srun`` (not merely inside an ``sbatch`` allocation)."""
    env = os.environ if env is None else env
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


def detect_launcher(env=None) -> str:
    """'openmpi', 'mpich', 'slurm' or 'none', from the environment alone (a hint, not a fact)."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_SIZE" in env or "PRTE_LAUNCHED" in env:
        return "openmpi"
    if "PMI_SIZE" in env and (not in_srun_step(env) or any(v in env for v in _HYDRA_VARS)):
        return "mpich"
    if in_srun_step(env):
        return "slurm"
    return "none"


def launch_hints(env=None) -> dict[str, int]:
    """The world sizes the launcher claims, by variable name; empty when nothing speaks for this world."""
    env = os.environ if env is None else env
    hints = {}
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if _int(env, var) is not None:
            hints[var] = _int(env, var)
    if not hints and in_srun_step(env):
        for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
            if _int(env, var) is not None:
                hints[var] = _int(env, var)
                break
    return hints


def check_launch(env=None):
    """The world MPI built must match what the launcher was asked for: raises ConfigError if not."""
    size = MPI.COMM_WORLD.Get_size()
    for var, hinted in launch_hints(env).items():
        if hinted != size:
            world = "a world of one" if size == 1 else f"a world of {size}"
            raise ConfigError(
                f"{var}={hinted} but MPI formed {world}: the launcher and the MPI library disagree, so each "
                "process started alone (srun without --mpi=pmix, e.g. MpiDefault=none: use `srun --mpi=pmix` or "
                "the mpirun of the MPI mpi4py was built against; `python -m mpi4py --mpi-lib-version` names it)"
            )


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits, from MPI: its rank, its rank on its node, and the nodes of the world.

    ``nodes`` lists each node name once, in the order of the lowest rank on it; ``node_index`` is this
    process's node in that list. ``launcher`` is a hint from the environment (see ``detect_launcher``).
    """

    rank: int
    local_rank: int
    world_size: int
    local_size: int
    nodes: list[str] = field(default_factory=list)
    launcher: str = "none"
    node_index: int = 0

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @classmethod
    def from_mpi(cls, comm=None, env=None) -> LaunchInfo:
        """Collective over ``comm`` (default COMM_WORLD): every rank must call it."""
        comm = MPI.COMM_WORLD if comm is None else comm
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            local_rank, local_size = local.Get_rank(), local.Get_size()
        finally:
            local.Free()
        name = MPI.Get_processor_name()
        names = comm.allgather(name)
        nodes = list(dict.fromkeys(names))
        return cls(
            rank=comm.Get_rank(),
            local_rank=local_rank,
            world_size=comm.Get_size(),
            local_size=local_size,
            nodes=nodes,
            launcher=detect_launcher(env),
            node_index=nodes.index(name),
        )

    def summary(self) -> str:
        return (
            f"{self.world_size} ranks on {self.num_nodes} node(s) ({', '.join(self.nodes[:4])}"
            f"{', ...' if self.num_nodes > 4 else ''}), {self.local_size} on this node, launcher {self.launcher}"
        )


def install_abort_on_exception():
    """An unhandled exception on one rank aborts the whole job instead of leaving the others waiting.

    The last line names the rank, the exception and, when the run's communicators are watched
    (``hpc_tp.comm.watchdog``: the trainer's are), the collective the rank was in or had last
    finished. Collective: every rank calls it (it duplicates COMM_WORLD for ``report_error``).
    """
    global _failure_comm
    if MPI.COMM_WORLD.Get_size() == 1:
        return
    if _failure_comm is None:
        _failure_comm = MPI.COMM_WORLD.Dup()
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        where = where_this_rank_is()
        last_words(
            f"rank {world_rank()} raised {kind.__name__}: {value}{' ' + where if where else ''}; aborting the job"
        )
        abort_job(1)

    sys.excepthook = hook
