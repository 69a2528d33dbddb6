"""How this process was launched (mpiexec, srun, or alone) and how it fails.

Rank and world size come from MPI itself; launcher variables are only hints used to catch the
classic mistake of every process forming a world of one.
"""
from __future__ import annotations

import os
import sys

from .errors import ConfigError


def world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def report_error(error: Exception):
    """One line on rank 0 (every rank raised the same error, so one line is enough)."""
    if world_rank() == 0:
        print(f"hpc-tp: error: {error}", file=sys.stderr, flush=True)


def check_launch():
    """The world MPI built must match what the launcher was asked for."""
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        hinted = os.environ.get(var)
        if hinted and hinted.isdigit() and int(hinted) != size:
            raise ConfigError(f"{var}={hinted} but MPI formed a world of {size}: the launcher and the MPI library "
                              "disagree (srun without --mpi=pmix, or mpi4py built against another MPI)")


def install_abort_on_exception():
    """An unhandled exception on one rank aborts the whole job instead of leaving the others waiting."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.write(f"hpc-tp: rank {MPI.COMM_WORLD.Get_rank()} raised {kind.__name__}; aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
