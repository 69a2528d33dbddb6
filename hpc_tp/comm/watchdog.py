"""Collective watchdog: every collective and point-to-point wait carries a name and a sequence
number, a daemon thread aborts the job when one has been in flight longer than ``timeout`` and
says which ranks wait where and which rank is missing.

    world = watched(mpi.world(), timeout=60.0, debug=False)   # any Communicator; splits stay watched
    world.watchdog.start(shared_folder)                          # the thread, for the training run
    ... ProcessGrid(tp, pp, dp, world) ... training ...
    world.watchdog.stop()

What each rank tracks (the main thread, a few attribute writes per call): the operation it is
blocked in now (``all_reduce(sum) #57 on dp [0, 2]``, shape, dtype, since when), or the last one
it finished and how long ago. Non-blocking calls (``iall_reduce``, ``isend``, ``irecv``) count
while their ``wait()`` blocks. The unhandled-exception hook (``hpc_tp.launch``) reads the same
record to name the collective a failing rank was in.

How a rank learns what the others are doing, without the communicator that is stuck: each
rank's watchdog thread rewrites one small JSON file, ``rank-<r>.json`` in a folder every rank
sees (the trainer uses its ``--cache-dir``, which corpora already require to be shared), every
``period`` seconds: its current operation and a wall-clock heartbeat. Why files and not MPI:

- The channel must work exactly when MPI does not: a rank stuck inside the progress engine, a
  wedged transport, a process that lost its peers. A file write needs none of them.
- A second MPI channel from the thread (probes on a duplicated communicator) needs
  ``MPI_THREAD_MULTIPLE`` progress on the very transport that may be stuck; one-sided RMA in
  Open MPI 5 (osc/rdma over TCP) needs the *target* to make progress, which a rank sleeping in
  Python or spinning in numpy does not, and osc/sm only spans one node.
- The files outlive an abort: the last state of every rank stays on disk for a post-mortem.

A rank killed outright stops its heartbeat; its file goes stale and the report says so (with
Open MPI the launcher usually ends the job first and names the rank itself).

When this rank's operation is overdue, its thread reads every file, prints the report and calls
``MPI_Abort``. Only the lowest overdue rank with a fresh heartbeat reports; the others give it a
grace period first, and whichever rank reports first claims the report (a file created
exclusively in the folder), so one report appears, not one per rank, however slow the abort is on
a loaded machine. The report is one block written at once (``comm.abort.last_words``). Detection
takes at most ``timeout + period``.

Debug mode (``debug=True``, ``hpc-tp train --debug-collectives``): before each collective every
rank of the group exchanges a fingerprint of what it is about to call (sequence number,
operation, shape, dtype) with ``allgather_object``, and every rank raises ``CollectiveMismatch``
naming the first divergence: which ranks call what at which sequence number. A rank that skips
a collective shows up as a sequence number or an operation that differs at the next one.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from .abort import abort_job, last_words
from .base import Communicator, Request

MAX_REPORTED_RANKS = 16  # lines about individual ranks in a report; the rest are counted

_active: Watchdog | None = None
_shortest_started_timeout: float | None = None  # of the watchdog threads this process started


class CollectiveMismatch(RuntimeError):
    """Ranks of one group issued different collectives (debug mode)."""


@dataclass(slots=True)
class Operation:
    name: str  # e.g. "all_reduce(sum)", "wait irecv from 1 tag 2"
    group: str  # e.g. "dp [0, 2]": the same string on every member
    seq: int  # collectives issued on the group so far, this one included
    shape: tuple | None = None  # as the array gives them: turned into text only when reported
    dtype: object = None
    peer: int | None = None  # world rank of the other side of a point-to-point wait
    members: tuple = field(default=(), repr=False)  # world ranks of the group: who must arrive
    started: float = field(default=0.0, repr=False)  # monotonic

    def key(self) -> tuple:
        """What must agree across the group in debug mode (the peer does not: it is relative)."""
        return (
            self.seq,
            self.name,
            None if self.shape is None else tuple(int(d) for d in self.shape),
            None if self.dtype is None else str(self.dtype),
        )

    def call(self) -> str:
        """The call alone, e.g. "all_reduce(sum) (2, 16, 32) float32"."""
        return self.name if self.shape is None else f"{self.name} {_shape_text(self.shape)} {self.dtype}"

    def __str__(self):
        what = f"{self.name} #{self.seq} on {self.group}"
        if self.shape is not None:
            what += f" ({_shape_text(self.shape)} {self.dtype})"
        return what

    def to_dict(self) -> dict:
        return {"text": str(self), "group": self.group, "seq": self.seq, "name": self.name, "peer": self.peer}


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


class Watchdog:
    """One per process: the operation in flight, the status file and the thread that checks it."""

    def __init__(
        self, rank: int, size: int, timeout: float = 0.0, debug: bool = False, period: float | None = None, abort=None
    ):
        self.rank, self.size, self.timeout, self.debug = rank, size, float(timeout), debug
        self.period = period if period is not None else min(5.0, max(0.1, self.timeout / 4))
        self.current: Operation | None = None
        self.last: Operation | None = None
        self.last_done = time.monotonic()
        self.failed: Operation | None = None  # the operation an exception left through
        self.folder: Path | None = None
        self._abort = abort or abort_job
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        global _active
        _active = self

    # -- the main thread: a few attribute writes per call -------------------------------------------
    def enter(self, op: Operation):
        op.started = time.monotonic()
        self.current, self.failed = op, None

    def leave(self, op: Operation, failed: bool = False):
        self.current, self.last, self.last_done = None, op, time.monotonic()
        if failed:
            self.failed = op

    @contextmanager
    def inside(self, op: Operation):
        self.enter(op)
        try:
            yield op
        except BaseException:
            self.leave(op, failed=True)
            raise
        self.leave(op)

    def where(self) -> str:
        """Where this rank is: the operation an exception left, the one in flight, or the last one."""
        if self.failed is not None:
            return f"in {self.failed}"
        if self.current is not None:
            return f"in {self.current}"
        if self.last is not None:
            return f"outside collectives (last: {self.last}, {time.monotonic() - self.last_done:.1f} s ago)"
        return "before its first collective"

    # -- the thread --------------------------------------------------------------------------------
    def start(self, folder):
        """Publish status into ``folder`` (shared by every rank) and abort on an overdue operation."""
        if self.timeout <= 0 or self._thread is not None:
            return
        global _shortest_started_timeout
        _shortest_started_timeout = min(self.timeout, _shortest_started_timeout or self.timeout)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._publish()
        self._thread = threading.Thread(target=self._watch, name="hpc-tp-watchdog", daemon=True)
        self._thread.start()

    def stop(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _watch(self):
        try:
            while not self._stop.wait(self.period):
                self._publish()
                op = self.current
                if op is not None and time.monotonic() - op.started > self.timeout:
                    self._fire(op)
        except BaseException as e:  # the thread must never die silently: say so and end the job
            self._say(f"watchdog on rank {self.rank} failed: {type(e).__name__}: {e}; aborting the job")
            self._abort(1)

    def status(self) -> dict:
        now = time.monotonic()
        op, last = self.current, self.last
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "op": op.to_dict() if op else None,
            "in_op_s": now - op.started if op else 0.0,
            "last": last.to_dict() if last else None,
            "idle_s": 0.0 if op else now - self.last_done,
        }

    def _publish(self):
        path = self.folder / f"rank-{self.rank}.json"
        temp = path.with_suffix(".tmp")
        try:
            temp.write_text(json.dumps(self.status()))
            os.replace(temp, path)  # readers see the old record or the new one, never half of one
        except OSError:
            pass  # a full or flaky disk must not kill training; the others will see a stale heartbeat

    def _read_all(self) -> dict[int, dict | None]:
        states = {}
        for r in range(self.size):
            try:
                states[r] = json.loads((self.folder / f"rank-{r}.json").read_text())
            except (OSError, ValueError):
                states[r] = None
        return states

    def _fire(self, op: Operation):
        states = self._read_all()
        stale_after = max(3 * self.period, 2.0)
        now = time.time()
        overdue = [
            r
            for r, s in states.items()
            if s and s["op"] and now - s["time"] < stale_after and s["in_op_s"] + now - s["time"] > self.timeout
        ]
        if overdue and min(overdue) < self.rank:  # a lower rank reports; report anyway if it does not
            if self._stop.wait(3 * self.period + 1.0) or self.current is not op:
                return
            states = self._read_all()
        if not self._claim_report():
            return  # another rank's report is out, and its abort ends the job
        self._say(report(op, time.monotonic() - op.started, self.timeout, states, time.time(), stale_after))
        self._abort(1)

    def _claim_report(self) -> bool:
        """True for the one rank whose report the job log gets (the first to create the claim file).
        A folder that cannot take the file does not silence the report."""
        try:
            os.close(os.open(self.folder / "report.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            pass
        return True

    def _say(self, text: str):
        last_words(text)


def report(op: Operation, waited: float, timeout: float, states: dict, now: float, stale_after: float) -> str:
    """Who waits where and who is missing, from every rank's last published status."""

    def describe(r):
        s = states.get(r)
        if s is None:
            return f"rank {r}: no status file (never started its watchdog?)"
        age = now - s["time"]
        where = f"rank {r} ({s['host']} pid {s['pid']})"
        if age > stale_after:
            return f"{where}: no heartbeat for {age:.1f} s (killed or frozen)"
        if s["op"]:
            return f"{where}: waiting {s['in_op_s'] + age:.1f} s in {s['op']['text']}"
        last = f" (last: {s['last']['text']})" if s["last"] else ""
        return f"{where}: outside collectives for {s['idle_s'] + age:.1f} s{last}"

    def arrived(r):
        s = states.get(r)
        return bool(
            s
            and s["op"]
            and now - s["time"] <= stale_after
            and s["op"]["group"] == op.group
            and (op.peer is not None or s["op"]["seq"] == op.seq)
        )

    expected = [op.peer] if op.peer is not None else list(op.members)
    missing = [r for r in expected if not arrived(r)]
    lines = [
        f"collective timeout: {op} waited {waited:.1f} s (--comm-timeout {timeout:g}); "
        f"missing: {', '.join(f'rank {r}' for r in missing) or 'none (all arrived; MPI itself is stuck)'}; "
        "aborting the job"
    ]
    for r in missing:
        lines.append("  missing " + describe(r))
    others = [r for r in sorted(states) if r not in missing]
    for r in others[:MAX_REPORTED_RANKS]:
        lines.append("  " + describe(r))
    if len(others) > MAX_REPORTED_RANKS:
        lines.append(f"  ... and {len(others) - MAX_REPORTED_RANKS} more ranks")
    return "\n".join(lines)


def where_this_rank_is() -> str | None:
    """For error messages: where the latest watchdog of this process says its rank is (None: unwatched)."""
    return _active.where() if _active is not None else None


def error_agreement_seconds() -> float | None:
    """How long a rank with a user error may wait for the others to share it (``launch.report_error``)
    once this process has started a watchdog thread (stopped since, maybe, while the error unwound
    the run; the other ranks' threads still run): half the shortest timeout, so the rank's own error
    is printed before the others' watchdog fires and aborts the job for it. None: never watched."""
    return None if _shortest_started_timeout is None else _shortest_started_timeout / 2


class _WatchedRequest(Request):
    def __init__(self, request: Request, watchdog: Watchdog, op: Operation):
        self.request, self.watchdog, self.op = request, watchdog, op

    def wait(self):
        with self.watchdog.inside(self.op):
            return self.request.wait()


class WatchedCommunicator(Communicator):
    """Any Communicator, each call named, numbered and watched; ``split`` results are watched too.

    ``label`` names the group in reports ("world", or "tp"/"pp"/"dp" once the trainer knows);
    ``members`` are the world ranks of the group, in group-rank order. The ``seconds``/``bytes``
    counters are the wrapped communicator's; attributes this class does not define (``comm``,
    ``abort``) are the wrapped communicator's too.
    """

    def __init__(self, inner: Communicator, watchdog: Watchdog, members: list[int], label: str = "world"):
        # No super().__init__(): the counters live in ``inner`` (see the properties below).
        self.inner, self.watchdog, self.members = inner, watchdog, tuple(members)
        self.rank, self.size = inner.rank, inner.size
        self.label = label
        self._seq = 0
        self._p2p = 0

    seconds = property(lambda self: self.inner.seconds, lambda self, v: setattr(self.inner, "seconds", v))
    bytes = property(lambda self: self.inner.bytes, lambda self, v: setattr(self.inner, "bytes", v))
    stream_ordered = property(lambda self: self.inner.stream_ordered)

    def __getattr__(self, name):
        if name in ("inner", "_label"):  # not yet set (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def label(self) -> str:
        return self._label

    @label.setter
    def label(self, label: str):
        self._label = label
        self.group = f"{label} [{', '.join(map(str, self.members))}]"  # built once, not per call

    def _call(self, name: str, x, function, *args):
        """``function(*args)`` as collective number ``seq`` of this group, watched (and checked in debug mode)."""
        self._seq += 1
        op = Operation(
            name, self.group, self._seq, getattr(x, "shape", None), getattr(x, "dtype", None), members=self.members
        )
        watchdog = self.watchdog
        watchdog.enter(op)
        try:
            if watchdog.debug and self.size > 1:
                self._check_same(op)
            result = function(*args)
        except BaseException:
            watchdog.leave(op, failed=True)
            raise
        watchdog.leave(op)
        return result

    def _check_same(self, op: Operation):
        keys = self.inner.allgather_object(op.key())
        if len(set(keys)) > 1:
            raise CollectiveMismatch(_divergence(op, keys, self.members))

    def _p2p_wait(self, request: Request, what: str, x, peer: int) -> Request:
        self._p2p += 1
        op = Operation(f"wait {what}", self.group, self._p2p, x.shape, x.dtype, peer=self.members[peer])
        return _WatchedRequest(request, self.watchdog, op)

    def all_reduce(self, x, op: str = "sum"):
        return self._call(f"all_reduce({op})", x, self.inner.all_reduce, x, op)

    def iall_reduce(self, x, op: str = "sum") -> Request:
        return self._posted(f"iall_reduce({op})", x, self.inner.iall_reduce, x, op)

    def _posted(self, name: str, x, function, *args) -> Request:
        """A non-blocking collective: posting it is watched, and so is its ``wait``."""
        request = self._call(name, x, function, *args)
        posted = self.watchdog.last
        waited = Operation(f"wait {name}", posted.group, posted.seq, posted.shape, posted.dtype, members=posted.members)
        return _WatchedRequest(request, self.watchdog, waited)

    def ireduce_scatter_flat(self, x, counts) -> Request:
        return self._posted("ireduce_scatter_flat", x, self.inner.ireduce_scatter_flat, x, counts)

    def iall_gather_flat(self, x, counts) -> Request:
        return self._posted("iall_gather_flat", x, self.inner.iall_gather_flat, x, counts)

    def igather_flat(self, x, counts, root: int = 0) -> Request:
        # Named by the whole buffer, which every rank agrees on (root holds it, the others a piece).
        whole = SimpleNamespace(shape=(sum(counts),), dtype=x.dtype)
        return self._posted(f"igather_flat(root={root})", whole, self.inner.igather_flat, x, counts, root)

    def all_gather(self, x, axis: int = 0):
        return self._call(f"all_gather(axis={axis})", x, self.inner.all_gather, x, axis)

    def reduce_scatter(self, x, axis: int = 0):
        return self._call(f"reduce_scatter(axis={axis})", x, self.inner.reduce_scatter, x, axis)

    def broadcast(self, x, root: int = 0):
        return self._call(f"broadcast(root={root})", x, self.inner.broadcast, x, root)

    def all_to_all(self, x):
        return self._call("all_to_all", x, self.inner.all_to_all, x)

    def isend(self, x, dest: int, tag: int = 0) -> Request:
        return self._p2p_wait(self.inner.isend(x, dest, tag), f"isend to {self.members[dest]} tag {tag}", x, dest)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        request = self.inner.irecv(buf, source, tag)
        return self._p2p_wait(request, f"irecv from {self.members[source]} tag {tag}", buf, source)

    def barrier(self):
        self._call("barrier", None, self.inner.barrier)

    def split(self, color: int, key: int) -> WatchedCommunicator:
        return self._watch(self._call("split", None, self.inner.split, color, key), "group")

    def split_node(self) -> WatchedCommunicator:
        return self._watch(self._call("split_node", None, self.inner.split_node), "node")

    def _watch(self, inner: Communicator, label: str) -> WatchedCommunicator:
        members = inner.allgather_object(self.members[self.rank])  # world ranks, in the new group's order
        return WatchedCommunicator(inner, self.watchdog, members, label)

    def bcast_object(self, obj, root: int = 0, idle: bool = False):
        return self._call(f"bcast_object(root={root})", None, self.inner.bcast_object, obj, root, idle)

    def allgather_object(self, obj) -> list:
        return self._call("allgather_object", None, self.inner.allgather_object, obj)

    # Messages, not collectives: a sequence of collectives has no place for them, and a router thread
    # sends them beside the main thread's collectives.
    def send_object(self, obj, dest: int, tag: int = 0):
        self.inner.send_object(obj, dest, tag)

    def poll_object(self, tag: int = 0):
        return self.inner.poll_object(tag)


def _divergence(op: Operation, keys: list, members: list[int]) -> str:
    """One line: what each set of ranks of the group calls at ``op``'s place in the sequence."""
    callers: dict[tuple, list[int]] = {}
    for key, rank in zip(keys, members):
        callers.setdefault(key, []).append(rank)
    calls = []
    for (seq, name, shape, dtype), ranks in callers.items():
        who = f"rank {ranks[0]} calls" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} call"
        calls.append(f"{who} {Operation(name, op.group, seq, shape, dtype).call()}")
    return f"collectives diverge on {op.group} at #{op.seq}: {'; '.join(calls)}"


def watched(
    comm: Communicator, timeout: float = 0.0, debug: bool = False, period: float | None = None, abort=None
) -> WatchedCommunicator:
    """``comm`` watched by a new Watchdog (its thread starts with ``.watchdog.start(folder)``).
    The ranks in reports are ``comm``'s ranks (the world's, for the world)."""
    return WatchedCommunicator(
        comm, Watchdog(comm.rank, comm.size, timeout, debug, period, abort), list(range(comm.size))
    )
