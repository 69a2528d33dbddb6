"""The collective watchdog: names and sequence numbers, reports of who waits where and who is
missing, the first divergence in debug mode; and faults injected into real 4-rank ``hpc-tp train``
jobs under mpiexec (tests/inject_fault.py), each under a subprocess timeout, so a hang fails.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpc_tp.comm.mpi import world
from hpc_tp.comm.watchdog import CollectiveMismatch, Operation, Watchdog, error_agreement_seconds, report, watched

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MPIEXEC = os.environ.get("MPIEXEC", str(BIN / "mpiexec"))
JOB_TIMEOUT = 60  # a job that hangs instead of aborting fails here
TRAIN = [
    "train",
    "--model",
    "tiny",
    "--tp",
    "2",
    "--global-batch",
    "8",
    "--micro-batch",
    "2",
    "--steps",
    "8",
    "--no-progress",
    "--eval-problems",
    "4",
]


def inject(fault: str, rank: int, step: int, *flags: str, cache) -> subprocess.CompletedProcess:
    """A 4-rank tp=2 x dp=2 training job with ``fault`` on ``rank`` before step ``step + 1``."""
    command = [
        MPIEXEC,
        "-n",
        "4",
        sys.executable,
        str(ROOT / "tests" / "inject_fault.py"),
        fault,
        str(rank),
        str(step),
        *TRAIN,
        "--cache-dir",
        str(cache),
        *flags,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT)


def hpc_tp_lines(run) -> list[str]:
    """The job's own lines. Open MPI ends its abort banner with a NUL byte, which sticks to the start of
    the next line when the banner reaches the log first: the engine's messages start on a fresh line,
    so none of theirs may be lost here for it (hpc_tp.comm.abort)."""
    return [line for line in run.stderr.splitlines() if line.startswith("hpc-tp:")]


@pytest.mark.mpi(min_size=1)
def test_watched_calls_give_the_same_results_and_number_each_group():
    plain, comm = world(), watched(world())
    x = np.arange(6.0) + comm.rank
    assert np.array_equal(comm.all_reduce(x.copy()), plain.all_reduce(x.copy()))
    assert np.array_equal(comm.all_gather(x, axis=0), plain.all_gather(x, axis=0))
    assert np.array_equal(comm.iall_reduce(x.copy()).wait(), plain.all_reduce(x.copy()))
    assert comm.watchdog.last.name == "wait iall_reduce(sum)" and comm.watchdog.last.seq == 3
    assert str(comm.watchdog.last).startswith(
        f"wait iall_reduce(sum) #3 on world [{', '.join(map(str, range(comm.size)))}]"
    )
    pairs = comm.split(color=comm.rank // 2, key=comm.rank)
    assert pairs.members == tuple(r for r in range(comm.size) if r // 2 == comm.rank // 2)
    pairs.label = "tp"
    pairs.barrier()
    assert comm.watchdog.last.group == f"tp {list(pairs.members)}"
    assert comm.watchdog.last.seq == 1 and comm._seq == 4  # the split counts on the parent, not the barrier
    assert comm.seconds == comm.inner.seconds and comm.comm is comm.inner.comm  # counters and attributes pass through


@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_the_first_divergence_on_every_rank():
    comm = watched(world(), debug=True)
    comm.all_reduce(np.ones(3))  # the same call everywhere passes
    odd = np.zeros(2, dtype=np.float32) if comm.rank == 1 else np.zeros(3)
    with pytest.raises(CollectiveMismatch) as e:
        comm.all_reduce(odd)
    others = ", ".join(str(r) for r in range(comm.size) if r != 1)
    plural = "ranks" if comm.size > 2 else "rank"
    assert str(e.value) == (
        f"collectives diverge on {comm.group} at #2: {plural} {others} call"
        f"{'' if comm.size > 2 else 's'} all_reduce(sum) (3,) float64; "
        "rank 1 calls all_reduce(sum) (2,) float32"
    )
    assert (
        comm.watchdog.where()
        == f"in all_reduce(sum) #2 on {comm.group} ({'(2,) float32' if comm.rank == 1 else '(3,) float64'})"
    )
    assert comm.all_reduce(np.ones(1))[0] == comm.size  # nothing half-done: the group goes on


@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_a_gather_to_one_rank_by_its_whole_buffer():
    """Root passes the whole buffer and the others their pieces: the same call on every rank."""
    comm = watched(world(), debug=True)
    counts = [2] * comm.size
    x = np.arange(2.0 * comm.size) if comm.rank == 0 else np.full(2, 2.0 * comm.rank) + [0, 1]
    assert comm.igather_flat(x, counts).wait() is x
    assert comm.watchdog.last.call() == f"wait igather_flat(root=0) ({2 * comm.size},) float64"
    if comm.rank == 0:
        np.testing.assert_array_equal(x, np.arange(2.0 * comm.size))


def test_an_overdue_operation_is_reported_and_aborts(tmp_path, capfd):
    aborted = threading.Event()
    watchdog = Watchdog(0, 1, timeout=0.2, period=0.05, abort=lambda code: aborted.set())
    watchdog.start(tmp_path)
    try:
        with watchdog.inside(Operation("barrier", "world [0]", 7)):
            assert aborted.wait(10)  # bounded: a watchdog that never fires fails here
    finally:
        watchdog.stop()
    assert (tmp_path / "rank-0.json").is_file()
    assert watchdog.where().startswith("outside collectives (last: barrier #7 on world [0]")
    # One block on lines of its own: whatever the launcher printed before cannot stick to its first line.
    assert capfd.readouterr().err.startswith("\nhpc-tp: collective timeout: barrier #7 on world [0] waited ")
    assert error_agreement_seconds() <= 0.1  # a rank's own user error is printed before a watchdog fires


def test_only_the_rank_that_claims_the_report_prints_one(tmp_path, capfd):
    (tmp_path / "report.claim").touch()  # another rank's report is out, and its abort ends the job
    aborted = threading.Event()
    watchdog = Watchdog(1, 2, timeout=0.2, period=0.05, abort=lambda code: aborted.set())
    watchdog.start(tmp_path)
    try:
        with watchdog.inside(Operation("barrier", "world [0, 1]", 7, members=(0, 1))):
            time.sleep(1.0)  # five periods overdue
    finally:
        watchdog.stop()
    assert not aborted.is_set()
    assert "collective timeout" not in capfd.readouterr().err


def test_the_report_names_who_waits_who_is_missing_and_who_is_gone():
    now = 1000.0
    op = Operation("all_reduce(sum)", "dp [0, 1, 2, 3]", 12, (4,), "float32", members=(0, 1, 2, 3))
    waiting = {"text": str(op), "group": op.group, "seq": 12, "name": op.name, "peer": None}
    earlier = dict(waiting, seq=11, text="all_reduce(sum) #11 on dp [0, 1, 2, 3] ((4,) float32)")

    def state(rank, op=None, in_op=0.0, idle=0.0, age=0.1, last=None):
        return {
            "rank": rank,
            "host": "n1",
            "pid": 100 + rank,
            "time": now - age,
            "op": op,
            "in_op_s": in_op,
            "last": last,
            "idle_s": idle,
        }

    states = {
        0: state(0, waiting, 5.0),
        1: state(1, None, idle=4.9, last=earlier),
        2: state(2, waiting, 5.0, age=30.0),
        3: None,
    }
    text = report(op, 5.0, 5.0, states, now, stale_after=2.0).splitlines()
    assert text[0] == (
        "collective timeout: all_reduce(sum) #12 on dp [0, 1, 2, 3] ((4,) float32) waited 5.0 s "
        "(--comm-timeout 5); missing: rank 1, rank 2, rank 3; aborting the job"
    )
    assert text[1] == (
        "  missing rank 1 (n1 pid 101): outside collectives for 5.0 s "
        "(last: all_reduce(sum) #11 on dp [0, 1, 2, 3] ((4,) float32))"
    )
    assert text[2] == "  missing rank 2 (n1 pid 102): no heartbeat for 30.0 s (killed or frozen)"
    assert text[3] == "  missing rank 3: no status file (never started its watchdog?)"
    assert text[4] == f"  rank 0 (n1 pid 100): waiting 5.1 s in {op}"


def test_a_failing_rank_says_which_operation_it_left():
    watchdog = Watchdog(0, 1)
    with pytest.raises(ValueError):
        with watchdog.inside(Operation("all_gather(axis=0)", "tp [0, 1]", 3, (2, 5), "float64")):
            raise ValueError("boom")
    assert watchdog.where() == "in all_gather(axis=0) #3 on tp [0, 1] ((2, 5) float64)"
    assert Watchdog(0, 1).where() == "before its first collective"


# -- faults injected into real jobs -----------------------------------------------------------------------


def test_a_rank_that_raises_aborts_the_job_naming_rank_exception_and_collective(tmp_path):
    run = inject("raise", 1, 3, cache=tmp_path)
    assert run.returncode != 0
    named = [line for line in hpc_tp_lines(run) if "raised" in line]
    assert len(named) == 1, run.stderr
    assert named[0].startswith("hpc-tp: rank 1 raised RuntimeError: injected fault in all_reduce(sum) #")
    assert "on tp [0, 1]" in named[0] and named[0].endswith("; aborting the job")
    assert "MPI_ABORT was invoked on rank 1" in run.stderr


def test_a_rank_that_stops_calling_collectives_is_named_by_the_watchdog(tmp_path):
    run = inject("sleep", 2, 3, "--comm-timeout", "2", cache=tmp_path)
    assert run.returncode != 0
    lines = hpc_tp_lines(run)
    reports = [line for line in lines if line.startswith("hpc-tp: collective timeout: ")]
    assert len(reports) == 1, run.stderr  # one rank reports, however slow the abort
    assert "(--comm-timeout 2)" in reports[0] and reports[0].endswith("missing: rank 2; aborting the job"), run.stderr
    assert any(line.startswith("hpc-tp:   missing rank 2 ") and "outside collectives for" in line for line in lines)
    waiting = [line for line in lines if " waiting " in line]
    assert len(waiting) == 3 and all("rank 2" not in line for line in waiting), run.stderr
    status = list((tmp_path / "watchdog").glob("*/rank-2.json"))
    assert len(status) == 1  # the ranks' last words stay for a post-mortem


def test_a_rank_that_skips_a_collective_is_named_by_the_watchdog(tmp_path):
    run = inject("skip", 1, 3, "--comm-timeout", "2", cache=tmp_path)
    assert run.returncode != 0
    lines = hpc_tp_lines(run)
    reports = [line for line in lines if line.startswith("hpc-tp: collective timeout: ")]
    assert len(reports) == 1, run.stderr
    assert " on world [0, 1, 2, 3] " in reports[0] and reports[0].endswith("missing: rank 1; aborting the job")
    assert any(line.startswith("hpc-tp:   missing rank 1 ") for line in lines), run.stderr


def test_ranks_that_disagree_on_shapes_are_named_in_debug_mode(tmp_path):
    run = inject("shape", 1, 3, "--debug-collectives", "--comm-timeout", "10", cache=tmp_path)
    assert run.returncode != 0
    diverge = [line for line in run.stderr.splitlines() if line.startswith("hpc_tp.comm.watchdog.CollectiveMismatch")]
    assert diverge, run.stderr
    message = diverge[0].split(": ", 1)[1]
    assert message.startswith("collectives diverge on tp [0, 1] at #")
    assert message.endswith(
        ": rank 0 calls all_reduce(sum) (2, 16, 32) float32; rank 1 calls all_reduce(sum) (2,) float64"
    )


def test_a_user_error_on_one_rank_aborts_instead_of_waiting_in_finalize(tmp_path):
    run = inject("config", 3, 2, cache=tmp_path)
    assert run.returncode != 0
    errors = [line for line in hpc_tp_lines(run) if line.startswith("hpc-tp: error:")]
    assert errors == [
        "hpc-tp: error: rank 3: injected user error (the other ranks did not fail alike: aborting the job)"
    ], run.stderr


def test_a_user_error_on_one_rank_is_printed_before_the_watchdog_fires(tmp_path):
    """The failing rank waits for the others' agreement less than the watchdog's timeout, so its own
    line says why, rather than the others' watchdog reporting it as frozen."""
    run = inject("user-error", 3, 2, "--comm-timeout", "3", cache=tmp_path)
    assert run.returncode != 0
    assert (
        "hpc-tp: error: rank 3: injected user error (the other ranks did not fail alike: aborting the job)"
        in hpc_tp_lines(run)
    ), run.stderr
