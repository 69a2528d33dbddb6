"""Test harness shared by every launch (1, 2 and 4 ranks).

- Only rank 0 reports; a failure on any rank prints that rank's report and aborts the whole
  launch at once, so no rank is left waiting in a collective of a test another rank left.
- ``comm_world`` / ``comm_self`` fixtures give the communicators, ``shared_dir`` a folder every rank sees; ``allclose_all_ranks``
  checks a condition on every rank and agrees on the verdict.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from mpi4py import MPI  # noqa: E402

WORLD = MPI.COMM_WORLD


def pytest_configure(config):
    if WORLD.Get_rank() != 0:
        config.option.verbose = -2
        config.option.reportchars = ""


def pytest_runtest_logreport(report):
    if report.failed and WORLD.Get_size() > 1:
        sys.stderr.write(
            f"\n[rank {WORLD.Get_rank()}] FAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
        WORLD.Abort(1)


@pytest.fixture
def comm_world():
    from hpc_tp.comm.mpi import world

    return world()


@pytest.fixture
def shared_dir(comm_world):
    """One temporary folder for every rank, made by rank 0 and removed once all are done with it."""
    path = comm_world.bcast_object(tempfile.mkdtemp(prefix="hpc_tp-") if comm_world.rank == 0 else None)
    yield Path(path)
    comm_world.barrier()
    if comm_world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def comm_self():
    from hpc_tp.comm.mpi import self_comm

    return self_comm()


def world_size():
    return WORLD.Get_size()


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = max(np.abs(b).max(initial=0.0), 1e-300)
    return float(np.abs(a - b).max(initial=0.0) / scale)
