"""Serving with several tp groups: world = tp x replicas, one endpoint.

A model whose heads allow tp 1, 3 or 9 still uses every rank of a 2- or 4-rank job: each tp group
(a data-parallel replica of the grid) holds the whole model and runs its own continuous batching
(``serve.continuous``) with its own KV cache. World rank 0 runs the HTTP server, and replica 0
besides; every other replica's tp rank 0 (its leader) takes requests from there.

Replicas pull work: HTTP handler threads queue jobs (``CompletionServer.jobs``); replica 0's loop takes
from that queue as its rows free up, and rank 0's ``Router`` thread takes from it for a remote replica
while that replica has fewer requests in flight than its rows. A request so goes to whichever replica
has room first, and none waits behind a full replica while another has a free row.

Everything between rank 0 and the leaders is a small pickled message on a communicator of their own
(``send_object`` / ``poll_object``), so replica 0's collectives never wait on it:

    rank 0 -> leader   ("job", id, prompt ids, sampling params, seconds it already waited)
                       ("cancel", id): its client went away;  ("stop",): the server is shutting down
    leader -> rank 0   ("text", id, args) and ("finish", id, args): the calls the batcher makes on the
                       job, made on the real job by the router (which streams it to the client)

Both sides wait by testing between short sleeps (``IDLE_SLEEP_S``), so an idle leader and the
router cost no CPU to speak of and react within a millisecond or two.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

TAG = 41  # the replicas' messages, on their own communicator
IDLE_SLEEP_S = 1e-3


class Router:
    """Rank 0: hands queued jobs to remote replicas with room, relays their text and completions to
    the jobs' clients, tells them of cancellations, and finally to stop."""

    def __init__(self, comm, leaders: list[int], server, rows: int):
        self.comm, self.leaders, self.server, self.rows = comm, leaders, server, rows
        self.in_flight = {leader: {} for leader in leaders}  # leader -> {job id: job}
        self.sent = dict.fromkeys(leaders, 0)  # jobs each leader was given
        self._cancelled: set[int] = set()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-router", daemon=True)
        self._thread.start()

    def close(self):
        """Once every request is answered: tell the leaders to stop, and end the thread."""
        self._stop.set()
        self._thread.join()
        for leader in self.leaders:
            self.comm.send_object(("stop",), leader, TAG)

    def _run(self):
        while not self._stop.is_set():
            if not (self._dispatch() | self._relay() | self._cancel()):
                time.sleep(IDLE_SLEEP_S)

    def _dispatch(self) -> bool:
        sent = False
        for leader, jobs in self.in_flight.items():
            while len(jobs) < self.rows:
                try:
                    job = self.server.jobs.get_nowait()
                except queue.Empty:
                    return sent
                job_id = next(self._ids)
                jobs[job_id] = job
                self.sent[leader] += 1
                self.server.metrics.admitted(1)
                waited = time.perf_counter() - job.arrived
                self.comm.send_object(("job", job_id, job.ids, job.params, waited), leader, TAG)
                sent = True
        return sent

    def _relay(self) -> bool:
        got = False
        while (message := self.comm.poll_object(TAG)) is not None:
            leader, (kind, job_id, args) = message
            jobs = self.in_flight[leader]
            if kind == "text":
                jobs[job_id].text(*args)
            else:
                jobs.pop(job_id).finish(*args)
                self._cancelled.discard(job_id)
            got = True
        return got

    def _cancel(self) -> bool:
        told = False
        for leader, jobs in self.in_flight.items():
            for job_id, job in jobs.items():
                if job.cancelled and job_id not in self._cancelled:
                    self._cancelled.add(job_id)
                    self.comm.send_object(("cancel", job_id), leader, TAG)
                    told = True
        return told


class RemoteJob:
    """A job on a remote replica's leader: what the batcher reads of it, and its calls sent to rank 0."""

    def __init__(self, source: RemoteJobs, job_id: int, ids, params, waited: float):
        self.source, self.job_id, self.ids, self.params = source, job_id, ids, params
        self.arrived = time.perf_counter() - waited  # the wait at rank 0 counts as queueing
        self.cancelled = False

    def text(self, *args):
        self.source.comm.send_object(("text", self.job_id, args), 0, TAG)

    def finish(self, *args):
        del self.source.jobs[self.job_id]
        self.source.comm.send_object(("finish", self.job_id, args), 0, TAG)


class RemoteJobs:
    """A remote leader's source for its batcher (``take(limit, idle)``, as the HTTP server's): the jobs
    rank 0 sent it; None once rank 0 says stop and nothing is left."""

    def __init__(self, comm):
        self.comm = comm
        self.queued: list[RemoteJob] = []
        self.jobs: dict[int, RemoteJob] = {}  # sent and not finished, by id
        self.stopping = False

    def take(self, limit: int, idle: bool):
        while True:
            self._receive()
            if self.queued or not idle:
                break
            if self.stopping:
                return None
            time.sleep(IDLE_SLEEP_S)
        taken, self.queued = self.queued[:limit], self.queued[limit:]
        return taken

    def _receive(self):
        while (message := self.comm.poll_object(TAG)) is not None:
            kind, *rest = message[1]
            if kind == "job":
                job = RemoteJob(self, *rest)
                self.jobs[job.job_id] = job
                self.queued.append(job)
            elif kind == "cancel" and rest[0] in self.jobs:  # not if it finished meanwhile
                self.jobs[rest[0]].cancelled = True
            elif kind == "stop":
                self.stopping = True
