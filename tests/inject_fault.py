"""``hpc-tp`` with one fault injected on one rank, for tests/test_reliability.py (never in the library).

    mpiexec -n 4 python tests/inject_fault.py FAULT RANK STEP train --tp 2 ...

The fault strikes rank RANK just before the trainer computes step STEP + 1:
- raise: the rank's next tensor-parallel all-reduce raises RuntimeError("injected fault")
- sleep: the rank stops calling collectives (sleeps for ten minutes)
- skip: the rank skips its next all-reduce over the world (returns without communicating)
- shape: the rank issues an extra tensor-parallel all-reduce of another shape and dtype
- kill: the rank kills itself with SIGKILL
- config: the rank alone raises a ConfigError (a user error the others do not see), and waits
  only a second for the others to agree on it
- user-error: the same, waiting as long as the engine decides
"""

import os
import signal
import sys
import time

import numpy
from mpi4py import MPI

from hpc_tp import cli, launch
from hpc_tp.errors import ConfigError
from hpc_tp.train.trainer import Trainer


def _once(communicator, replacement):
    """Make ``communicator.all_reduce`` call ``replacement`` once, then behave again."""
    original = communicator.all_reduce

    def patched(x, op="sum"):
        communicator.all_reduce = original
        return replacement(x, op)

    communicator.all_reduce = patched


def _raise(x, op):
    raise RuntimeError("injected fault")


def strike(trainer, fault):
    if fault == "raise":
        _once(trainer.grid.tp.inner, _raise)
    elif fault == "sleep":
        time.sleep(600)
    elif fault == "skip":
        _once(trainer.grid.world.inner, lambda x, op: x)
    elif fault == "shape":
        trainer.grid.tp.all_reduce(numpy.zeros(2))
    elif fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault in ("config", "user-error"):
        if fault == "config":
            launch.agree_within(1.0)
        raise ConfigError("injected user error")
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def main():
    fault, rank, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    train_step = Trainer.train_step

    def faulty_step(self):
        if MPI.COMM_WORLD.Get_rank() == rank and self.step == step:
            strike(self, fault)
        return train_step(self)

    Trainer.train_step = faulty_step
    return cli.main(sys.argv[4:])


if __name__ == "__main__":
    sys.exit(main())
