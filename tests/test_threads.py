"""kernels.threads: the rank's thread count from OMP_NUM_THREADS or its cores, one bad value one
ConfigError line; the ranges kernels split their outputs into cover every output once, a shared
split hands each range to one thread, and a rank's threads stop spinning once its kernels are done."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from hpc_tp.errors import ConfigError
from hpc_tp.kernels import threads


@pytest.fixture
def thread_count():
    """``thread_count(n)`` runs the rest of the test at n threads; the rank's count is put back after."""
    before = threads.COUNT
    yield threads.use
    threads.use(before)


@pytest.fixture
def cores(monkeypatch):
    """``cores(machine, affinity)``: the node's core count and the cores this rank is bound to."""

    def set_cores(machine, affinity):
        monkeypatch.setattr(os, "cpu_count", lambda: machine)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity), raising=False)

    return set_cores


@pytest.mark.parametrize("value, count", [("3", 3), (" 2 ", 2), ("4,2", 4)])
def test_omp_num_threads_decides_where_it_is_set(value, count, cores):
    cores(16, range(16))
    assert threads.decide({"OMP_NUM_THREADS": value, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}) == count


@pytest.mark.parametrize(
    "machine, affinity, count, says",
    [
        (2, {0}, 1, r"this rank is bound to 1 of the node's cores .*--map-by slot:PE=4.*: running 1 thread$"),
        (16, {2, 3}, 2, r"this rank is bound to 2 of the node's cores .*--cpus-per-task=4.*: running 2 threads$"),
        (2, {0, 1}, 2, r"this machine has 2 cores: running 2 threads$"),
    ],
)
def test_omp_num_threads_never_puts_two_threads_on_one_core(machine, affinity, count, says, cores):
    # Open MPI binds a lone rank to one core: OMP_NUM_THREADS=4 there would be four threads taking turns.
    cores(machine, affinity)
    assert threads._decided({"OMP_NUM_THREADS": "4"})[0] == count
    assert re.search(r"^hpc-tp: OMP_NUM_THREADS=4, but " + says, threads._decided({"OMP_NUM_THREADS": "4"})[1])
    assert threads._decided({"OMP_NUM_THREADS": str(count)}) == (count, None)


@pytest.mark.parametrize("value", ["0", "two", "", "-1"])
def test_a_bad_omp_num_threads_is_one_config_error_line(value):
    with pytest.raises(ConfigError, match=rf"^OMP_NUM_THREADS={value!r}: expected a number of threads >= 1$"):
        threads.decide({"OMP_NUM_THREADS": value})


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="binding to one core narrows nothing on a 1-core machine")
def test_a_rank_bound_to_one_core_runs_one_thread_and_says_why():
    # As Open MPI's mpiexec starts one rank: bound to a core, whatever OMP_NUM_THREADS asks.
    core = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM"))}
    run = subprocess.run(
        [sys.executable, "-c", "from hpc_tp.kernels import threads; print(threads.COUNT)"],
        env={**env, "OMP_NUM_THREADS": "2"},
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.split() == ["1"], run.stderr
    assert "hpc-tp: OMP_NUM_THREADS=2, but this rank is bound to 1 of the node's cores" in run.stderr


@pytest.mark.parametrize(
    "affinity, env, count",
    [
        (range(16), {}, 16),  # alone and unbound: every core
        (range(16), {"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),  # unbound: a share of the node's cores
        (range(16), {"MPI_LOCALNRANKS": "3"}, 5),
        (range(16), {"OMPI_COMM_WORLD_LOCAL_SIZE": "32"}, 1),  # more ranks than cores: one each
        ({4, 5}, {"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 2),  # bound by the launcher: its cores
    ],
)
def test_without_omp_num_threads_a_rank_takes_its_cores(affinity, env, count, cores):
    cores(16, affinity)
    assert threads.decide(env) == count


@pytest.mark.parametrize("n, align, parts", [(1999, 64, 3), (576, 64, 2), (49152, 4, 7), (100, 64, 4), (5, 4, 1)])
def test_column_ranges_cover_every_output_once_at_aligned_starts(n, align, parts):
    bounds = threads.columns(n, align, parts)
    assert bounds[0] == 0 and bounds[-1] == n and np.all(np.diff(bounds) > 0)
    assert np.all(bounds[:-1] % align == 0) and len(bounds) - 1 == min(parts, -(-n // align))
    assert bounds.dtype == np.int64


def test_balanced_ranges_share_the_work_and_none_is_empty():
    assert threads.balanced([100, 1, 1, 100], 2).tolist() == [0, 2, 4]
    assert threads.balanced([1] * 8, 4).tolist() == [0, 2, 4, 6, 8]
    assert threads.balanced([3, 3], 5).tolist() == [0, 1, 2]
    assert threads.balanced([7, 1, 2], 1).tolist() == [0, 3]


def test_a_kernel_runs_once_per_range_and_directly_for_one():
    calls = []
    kernel = lambda *args: calls.append(("kernel", *args))  # noqa: E731 (stand-ins for jitted kernels)
    parallel = lambda *args: calls.append(("parallel", args[0], args[1].tolist()))  # noqa: E731
    threads.run(kernel, parallel, ("x",), np.array([0, 10]))
    threads.run(kernel, parallel, ("x",), np.array([0, 6, 10]))
    assert calls == [("kernel", "x", 0, 10), ("parallel", "x", [0, 6, 10])]


@pytest.mark.parametrize(
    "count, n, column_bytes, ranges",
    [
        (1, 3072, 1152, 1),
        (2, 3072, 1152, 4),
        (2, 576, 1152, 4),
        (2, 64, 1152, 1),
        (3, 49152, 1152, 6),
        (2, 256, 512, 2),
    ],
)
def test_shared_ranges_are_a_few_a_thread_and_none_reads_too_little(count, n, column_bytes, ranges, thread_count):
    """Up to RANGES_PER_THREAD a thread, each reading SMALLEST_RANGE_BYTES or more; one thread, or
    too little weight for two ranges: one range, run directly."""
    thread_count(count)
    bounds = threads.shared(n, 64, column_bytes)
    assert bounds[0] == 0 and bounds[-1] == n and np.all(np.diff(bounds) > 0) and np.all(bounds[:-1] % 64 == 0)
    assert len(bounds) - 1 == ranges
    assert ranges == 1 or np.diff(bounds).min() * column_bytes >= threads.SMALLEST_RANGE_BYTES * 0.75


def test_a_shared_kernel_runs_directly_for_one_range_else_with_a_fresh_counter(thread_count):
    """Columns [64, 320) reading 512 bytes a column: one thread runs them directly (the range as given,
    no bounds array), two split them into ``shared``'s ranges, moved to start at 64."""
    calls = []
    kernel = lambda *args: calls.append(("kernel", *args))  # noqa: E731 (stand-ins for jitted kernels)
    parallel = lambda *args: calls.append(("parallel", args[0], args[1].tolist(), args[2].tolist()))  # noqa: E731
    for count in (1, 2):
        thread_count(count)
        threads.share(kernel, parallel, ("x",), 64, 320, 64, 512)
    assert calls == [("kernel", "x", 64, 320), ("parallel", "x", [64, 192, 320], [0])]


@threads.parallel_jit
def _count_runs(runs, taken):
    """The drivers' loop (``f32_dot``'s and the others'): runs[i] += 1 for each range i taken."""
    for _ in threads.prange(runs.shape[0]):
        part = threads.take(taken)
        while part < runs.shape[0]:
            runs[part] += 1
            part = threads.take(taken)


@pytest.mark.skipif(threads.numba is None, reason="needs numba")
@pytest.mark.parametrize("ranges", [2, 3, 17, 200])
def test_take_hands_every_range_to_exactly_one_thread(ranges, thread_count):
    """However the threads race for the counter, every range is run once, and each of the loop's
    iterations stops at its first index past the last."""
    for count in (1, 2, 3):
        thread_count(count)
        for _ in range(20):
            runs, taken = np.zeros(ranges, np.int64), np.zeros(1, np.int64)
            _count_runs(runs, taken)
            assert runs.tolist() == [1] * ranges and taken[0] == 2 * ranges


@pytest.mark.skipif(threads.numba is None, reason="needs numba")
def test_threads_stop_spinning_soon_after_a_region(thread_count):
    """An idle server stays idle: after a two-thread region, a rank's threads (numba's and MKL's) spin
    SPIN_MS at most, so over the next half second the process uses well under 5% of a core."""
    from hpc_tp.kernels import f32_dot  # a kernel with a shared split, where the CPU has AVX-512

    thread_count(2)
    a, w = np.ones((8, 576), np.float32), np.ones((576, 3072), np.float32)
    product = f32_dot.matmul if f32_dot.AVAILABLE else np.matmul
    for _ in range(20):
        product(a, w)
    before = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - before < 0.05 * 0.5
