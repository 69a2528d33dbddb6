"""How many threads a rank computes on, decided once for its numba kernels and for MKL.

``COUNT`` is ``OMP_NUM_THREADS`` where it is set (the Makefile and ``jobs/`` set 1: ranks that share
cores must not also share threads; one rank alone on a 2-core machine: 2), but never more than the
cores the launcher bound the rank to: Open MPI's ``mpiexec`` binds one or two ranks to a core each by
default, and two threads taking turns on one core made workload B slower than one thread (a line on
stderr says so and how to give the rank its cores). Where it is unset, a bound rank takes its cores
(its affinity); an unbound one takes an equal share of the cores among the ranks on its node (Open
MPI's or MPICH's local size).
Numba's pool and MKL (unless ``MKL_NUM_THREADS`` sets its own) are set to it at import.

Kernels split their output into ranges [start, stop) (``columns``, or ``balanced`` for work of
unequal sizes) and numba's ``prange`` runs them on the threads (``run``: one range a thread, handed
out up front; ``share``: more ranges than threads, each taken by whichever thread asks next, so a
thread the system has descheduled holds back only the range it took, not its share). A range is a
whole set of outputs, each summed by one thread in the same order as without a split, so the results
are the same bits at any thread count and whichever thread takes a range. At one thread the kernel
runs directly, with no parallel launch. Kernels that call MKL per small tile (``cpu_attention``,
``mkl_jit.column_blocks``) make it sequential on each of their threads (``mkl_jit.local_threads``):
MKL's own threads would be woken for every tile. OpenMP's threads spin a bounded while after a region
before they sleep (``SPIN_MS``, below). Numba's threading layer is asked for a thread-safe one (TBB or
OpenMP: its ``workqueue`` aborts when two Python threads launch kernels at once; serving calls them
from its main thread).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import sys

import numpy

from ..errors import ConfigError
from .mkl import LIBRARY

try:
    import numba
except ImportError:  # optional: without numba only MKL's count is set
    numba = None

# Where launchers say how many ranks share the node (Open MPI, then MPICH's Hydra) and which of them
# this rank is (Open MPI, Hydra, srun).
_LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
_LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def decide(env) -> int:
    """The thread count for the environment ``env`` (see the module's docstring)."""
    return _decided(env)[0]


def _decided(env) -> tuple[int, str | None]:
    """The thread count, and the line saying why it is fewer than ``OMP_NUM_THREADS`` asks (or None)."""
    machine = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    value = env.get("OMP_NUM_THREADS")
    if value is not None:
        first = value.split(",")[0].strip()  # OpenMP's list of nesting levels: the outer one is ours
        if not first.isdigit() or int(first) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={value!r}: expected a number of threads >= 1")
        if int(first) <= cores:
            return int(first), None
        if cores == machine:
            where = f"this machine has {cores} cores"
        else:  # the launcher's binding, most often: tell how to widen it
            where = (
                f"this rank is bound to {cores} of the node's cores (to give each rank {first}, launch with "
                f"`mpiexec --map-by slot:PE={first}` (Open MPI), `srun --cpus-per-task={first}`, or `mpiexec "
                "--bind-to none`)"
            )
        return cores, f"hpc-tp: OMP_NUM_THREADS={value}, but {where}: running {cores} thread{'s' * (cores > 1)}"
    if cores < machine:
        return cores, None
    local = next((int(env[name]) for name in _LOCAL_SIZE_VARIABLES if env.get(name, "").isdigit()), 1)
    return max(1, cores // max(1, local)), None


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


# OpenMP's threads spin this long after a parallel region before they sleep, where OMP_WAIT_POLICY is
# unset. A decode step launches a region for every product, ~125 of them 0.05-0.3 ms apart: a thread
# that sleeps at once must be woken by a futex for each (an empty two-thread region took 8.9-9.8 us so,
# 1.4-1.6 spinning), while an idle server's threads stop spinning within SPIN_MS (1.5-2.5 ms of CPU
# after the last region). Numba's regions run on whichever OpenMP runtime the process loaded first:
# Intel's (MKL's libiomp5, which serves libgomp's entry points too) reads KMP_BLOCKTIME in ms, GNU's
# libgomp (where MKL is not loaded) GOMP_SPINCOUNT in spins, 25000 a ms on the AMD VM. The spin is for a
# rank on cores of its own: where other jobs load the cores, a spinning thread uses up its share of the
# scheduler and then queues behind them when a region needs it (load 8-13: workload B's decode passes at
# 2 threads 1.21-1.23x their time at 1 spinning, 1.08-1.14x asleep; without bound, OMP_WAIT_POLICY=active,
# B took 1.4-4x as long): there OMP_WAIT_POLICY=passive, or one thread (docs/performance.md).
SPIN_MS = 2
if "OMP_WAIT_POLICY" not in os.environ:  # read when each runtime starts, so before ``use`` starts them
    os.environ.setdefault("KMP_BLOCKTIME", str(SPIN_MS))
    os.environ.setdefault("GOMP_SPINCOUNT", str(25000 * SPIN_MS))
COUNT = 1
_count, _short = _decided(os.environ)
if _short and next((os.environ[name] for name in _LOCAL_RANK_VARIABLES if name in os.environ), "0") == "0":
    print(_short, file=sys.stderr, flush=True)  # once a node: every rank there was launched alike
use(_count)


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


# Ranges ``shared`` cuts for each thread: a late thread's share is taken by the others a range at a time,
# but every range restarts a kernel's walk through the weight. CPU time of both threads at 8 rows from
# memory, 1 / 2 / 4 ranges a thread (best of 12, load 8): bf16 [576, 3072] 0.278 / 0.289 / 0.319 ms,
# [1536, 576] 0.152 / 0.180 / 0.217, float32 [576, 3072] 0.414 / 0.431 / 0.468.
RANGES_PER_THREAD = 2
# The least weight a range of a product reads: below it a range costs more to hand out than a thread
# saves (64 KiB streams in ~3-4 us at one core's 15-22 GB/s; a spinning region costs 1.4). Chosen, not
# tuned: the machine was loaded (8-13) while it was built.
SMALLEST_RANGE_BYTES = 64 * 1024


def _shared_parts(n: int, column_bytes: int) -> int:
    return 1 if COUNT == 1 else max(1, min(COUNT * RANGES_PER_THREAD, n * column_bytes // SMALLEST_RANGE_BYTES))


def shared(n: int, align: int, column_bytes: int):
    """Bounds ``share`` splits ``n`` output columns into, for a product that reads ``column_bytes`` of
    weight a column: ranges of near-equal width, every inner bound a multiple of ``align``, up to
    RANGES_PER_THREAD a thread and none reading less than SMALLEST_RANGE_BYTES."""
    return columns(n, align, _shared_parts(n, column_bytes))


def split_columns(column_bytes: int, align: int) -> int:
    """Columns (a multiple of ``align``) of a product reading ``column_bytes`` of weight a column that
    ``shared`` cuts into ranges at 2 threads or more: warm-ups compile the drivers with it."""
    return align * -(-2 * SMALLEST_RANGE_BYTES // (column_bytes * align))


def share(kernel, parallel, args, start: int, stop: int, align: int, column_bytes: int):
    """``kernel(*args, first, last)`` for every range of output columns [start, stop) that ``shared``
    gives: one range runs directly, with no bounds array built (at one thread a product's whole call
    costs a few microseconds); more go to ``parallel(*args, bounds, taken)``, a driver whose ``prange``
    iterations each take ranges (``take(taken)``) until none is left."""
    parts = _shared_parts(stop - start, column_bytes)
    bounds = None if parts == 1 else start + columns(stop - start, align, parts)
    if bounds is None or bounds.shape[0] == 2:
        kernel(*args, start, stop)
    else:
        parallel(*args, bounds, numpy.zeros(1, numpy.int64))


if numba is not None:
    from numba import types
    from numba.core.extending import intrinsic

    prange = numba.prange

    def parallel_jit(function):
        """A kernel's ``prange`` over ranges (``run``'s ``parallel``), cached on disk as the kernels are."""
        return numba.njit(cache=True, nogil=True, parallel=True)(function)

    @intrinsic
    def take(typingctx, taken):
        """The next range's index for a ``share`` driver: ``taken[0]``, incremented by one atomic add
        (each index goes to one thread; the region's end orders the ranges' writes)."""

        def codegen(context, builder, signature, args):
            counter = context.make_array(signature.args[0])(context, builder, args[0]).data
            return builder.atomic_rmw("add", counter, context.get_constant(types.int64, 1), "monotonic")

        return types.int64(taken), codegen

else:  # never called: the kernels' ``takes``/``supported`` answer False without numba
    prange = range

    def parallel_jit(function):
        return function
