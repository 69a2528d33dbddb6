"""How many threads a rank computes on, decided once for its numba kernels and for MKL.

``COUNT`` is ``OMP_NUM_THREADS`` where it is set (the Makefile and ``jobs/`` set 1: ranks that share
cores must not also share threads; one rank alone on a 2-core machine: 2). Where it is unset, a rank
that its launcher bound to some of the machine's cores takes those (its affinity); an unbound one
takes an equal share of the cores among the ranks on its node (Open MPI's or MPICH's local size).
Numba's pool and MKL (unless ``MKL_NUM_THREADS`` sets its own) are set to it at import.

Kernels split their output into ``COUNT`` ranges [start, stop) (``columns``, or ``balanced`` for
work of unequal sizes) and numba's ``prange`` runs one range on each thread (``run``). A range is a
whole set of outputs, each summed by one thread in the same order as without a split, so the results
are the same bits at any thread count. At one thread the kernel runs directly, with no parallel
launch. Kernels that call MKL per small tile (``cpu_attention``, ``mkl_jit.column_blocks``) make it
sequential on each of their threads (``mkl_jit.local_threads``): MKL's own threads would be woken
for every tile. OpenMP's threads sleep between regions (``OMP_WAIT_POLICY=PASSIVE`` where it is unset).
Numba's threading layer is asked for a thread-safe one (TBB or OpenMP: its ``workqueue``
aborts when two Python threads launch kernels at once; serving calls them from its main thread).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os

import numpy

from ..errors import ConfigError
from .mkl import LIBRARY

try:
    import numba
except ImportError:  # optional: without numba only MKL's count is set
    numba = None

# Where launchers say how many ranks share the node: Open MPI, then MPICH's Hydra.
_LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def decide(env) -> int:
    """The thread count for the environment ``env`` (see the module's docstring)."""
    value = env.get("OMP_NUM_THREADS")
    if value is not None:
        first = value.split(",")[0].strip()  # OpenMP's list of nesting levels: the outer one is ours
        if not first.isdigit() or int(first) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={value!r}: expected a number of threads >= 1")
        return int(first)
    machine = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    if cores < machine:
        return cores
    local = next((int(env[name]) for name in _LOCAL_SIZE_VARIABLES if env.get(name, "").isdigit()), 1)
    return max(1, cores // max(1, local))


def use(count: int):
    """Make ``count`` the rank's thread count: ``COUNT``, MKL's and numba's (benchmarks compare counts
    in one process with it)."""
    global COUNT
    COUNT = count
    # MKL reads OMP_NUM_THREADS itself, but where it is unset MKL's default is every core of the node;
    # MKL_NUM_THREADS, where set, is MKL's own count and stays.
    if LIBRARY is not None and "MKL_NUM_THREADS" not in os.environ:
        ctypes.CDLL(LIBRARY).MKL_Set_Num_Threads(ctypes.c_int(count))
    if numba is not None and count > 1:
        if "NUMBA_THREADING_LAYER" not in os.environ:
            numba.config.THREADING_LAYER = "threadsafe"
        # numba's pool holds at most NUMBA_NUM_THREADS (the machine's cores); this sets the importing
        # thread's share of it, and ``run`` splits into COUNT ranges whatever a thread's share.
        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))


# Where unset, OpenMP's threads (numba's pool and MKL's) sleep between parallel regions rather than
# spin: read when each runtime starts, so before ``use`` starts them. A spinning thread holds a core the
# rank's own main thread, or a neighbour, needs: on a loaded 2-core machine workload B at 2 threads
# took 1.4-4x as long spinning (docs/performance.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
COUNT = 1
use(decide(os.environ))


def columns(n: int, align: int, parts: int | None = None):
    """Bounds (int64, ``len - 1`` ranges) splitting ``n`` outputs into up to ``parts`` (COUNT) ranges
    of near-equal width; every inner bound a multiple of ``align``."""
    units = -(-n // align)
    parts = max(1, min(COUNT if parts is None else parts, units))
    bounds = (numpy.arange(parts + 1, dtype=numpy.int64) * units // parts) * align
    bounds[-1] = n
    return bounds


def balanced(work, parts: int | None = None):
    """Bounds splitting items of sizes ``work`` (>= 0) into up to ``parts`` (COUNT) consecutive
    ranges of near-equal total work, none empty."""
    parts = max(1, min(COUNT if parts is None else parts, len(work)))
    if parts == 1:
        return numpy.array([0, len(work)], numpy.int64)
    # In Python over a list: a decode step's 24 items took 39-160 us through numpy's calls, 14-28 us
    # this way (load 8). + 1: an item costs something at 0.
    total = list(itertools.accumulate(w + 1.0 for w in numpy.asarray(work, numpy.float64).tolist()))
    cuts = {bisect.bisect_right(total, total[-1] * i / parts) for i in range(1, parts)}
    return numpy.array(sorted(cuts | {0, len(work)}), numpy.int64)


def run(kernel, parallel, args, bounds):
    """``kernel(*args, start, stop)`` for every range of ``bounds``: directly where there is one,
    else through ``parallel(*args, bounds)``, the kernel's ``prange`` over the ranges."""
    if bounds.shape[0] == 2:
        kernel(*args, bounds[0], bounds[1])
    else:
        parallel(*args, bounds)


if numba is not None:
    prange = numba.prange

    def parallel_jit(function):
        """A kernel's ``prange`` over ranges (``run``'s ``parallel``), cached on disk as the kernels are."""
        return numba.njit(cache=True, nogil=True, parallel=True)(function)

else:  # never called: the kernels' ``takes``/``supported`` answer False without numba
    prange = range

    def parallel_jit(function):
        return function
