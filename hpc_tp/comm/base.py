"""The one communicator interface layers talk to. Layers never import mpi4py.

Array arguments are numpy (or cupy) arrays. Collectives that can work in place do
(``all_reduce``, ``broadcast``) and return their argument; the others return new arrays.
Every blocking call adds its wall time to ``seconds`` so a step can be split into compute
and communication.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy

from ..errors import ConfigError

# The generic ``igather_flat``'s messages: MPI's least upper bound on tags, far from the pipeline's,
# which count up from 0.
GATHER_TAG = 32767


def piece_starts(counts) -> list[int]:
    """Where each rank's piece of a flat buffer begins (pieces of ``counts`` elements, in rank order)."""
    return [sum(counts[:r]) for r in range(len(counts))]


class _Timed:
    """The context ``Communicator.timed`` returns: a plain class, since a generator-based context
    manager costs a few microseconds per call, which is measurable on a 64 KiB all-reduce."""

    __slots__ = ("owner", "nbytes", "start")

    def __init__(self, owner, nbytes: int):
        self.owner, self.nbytes = owner, nbytes

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.owner.seconds += time.perf_counter() - self.start
        self.owner.bytes += self.nbytes
        return False


class Request(ABC):
    @abstractmethod
    def wait(self):
        """Block until the operation completes; returns its result array (if any)."""


class Done(Request):
    """A request whose work is done, queued on the device stream, or left to ``finish``, which
    ``wait`` runs once (MPI's collectives run there)."""

    def __init__(self, result, finish=None):
        self.result, self.finish = result, finish

    def wait(self):
        finish, self.finish = self.finish, None  # once: a second wait must not run a collective again
        if finish is not None:
            finish()
        return self.result


class Communicator(ABC):
    rank: int
    size: int
    # Whether its device collectives are queued on the current stream with no host work, so a CUDA
    # graph can hold them (``cuda_graph.capturable``): NCCL's are; MPI's run on the host.
    stream_ordered = False

    def __init__(self):
        self.seconds = 0.0
        self.bytes = 0

    def timed(self, nbytes: int = 0) -> _Timed:
        """``with comm.timed(nbytes):`` around a transfer adds its wall time and bytes to the counters."""
        return _Timed(self, nbytes)

    @abstractmethod
    def all_reduce(self, x, op: str = "sum"):
        """Reduce ``x`` over the group, in place; returns ``x``. op: 'sum', 'max' or 'min'."""

    @abstractmethod
    def iall_reduce(self, x, op: str = "sum") -> Request:
        """Non-blocking in-place all-reduce; ``wait()`` returns ``x``. Non-blocking collectives must
        be waited in the order they were posted: a transport may run them inside ``wait`` (MPI does)."""

    @abstractmethod
    def all_gather(self, x, axis: int = 0):
        """Concatenate every rank's ``x`` along ``axis``, in rank order."""

    @abstractmethod
    def reduce_scatter(self, x, axis: int = 0):
        """Sum ``x`` over the group and return this rank's equal piece along ``axis``."""

    def ireduce_scatter_flat(self, x, counts) -> Request:
        """Non-blocking, in place: the 1-D ``x`` summed over the group, of which this rank receives
        its piece (``counts[rank]`` elements from offset ``sum(counts[:rank])``; pieces may differ in
        size), in ``x[:counts[rank]]``, MPI's in-place convention; ``wait()`` returns that view. The
        rest of ``x`` is left undefined. The adjoint of ``iall_gather_flat``; ZeRO's gradient sum.

        This generic form is an all-reduce and a copy (twice the traffic of a reduce-scatter);
        transports with a native one override it."""
        start, count = sum(counts[: self.rank]), counts[self.rank]
        request = self.iall_reduce(x)

        def finish():
            request.wait()
            if start:
                x[:count] = x[start : start + count].copy()  # the two may overlap

        return Done(x[:count], finish)

    def iall_gather_flat(self, x, counts) -> Request:
        """Non-blocking, in place: every rank's piece of the 1-D ``x`` (as ``ireduce_scatter_flat``
        cuts it) copied to every rank; ``wait()`` returns ``x``. ZeRO's parameter gather.

        Generic form: the other pieces zeroed, then an all-reduce (a sum with one non-zero term
        is exact; a -0.0 comes back as +0.0)."""
        start = sum(counts[: self.rank])
        x[:start] = 0
        x[start + counts[self.rank] :] = 0
        return self.iall_reduce(x)

    def igather_flat(self, x, counts, root: int = 0) -> Request:
        """Non-blocking: every rank's piece of a 1-D buffer (as ``ireduce_scatter_flat`` cuts it)
        to ``root`` alone. On ``root``, ``x`` is the whole buffer with its own piece in place and
        receives the others'; elsewhere ``x`` is this rank's piece alone (``counts[rank]`` elements),
        so those ranks hold nothing buffer-sized. ``wait()`` returns ``x``. The adjoint of a
        scatter; ZeRO's checkpoint gather, to the rank that writes.

        Generic form: each piece sent to root point to point (any transport with ``isend``/``irecv``
        moves device arrays too)."""
        if self.rank != root:
            requests = [self.isend(x, root, GATHER_TAG)] if counts[self.rank] else []
        else:
            requests = [
                self.irecv(x[start : start + count], r, GATHER_TAG)
                for r, (start, count) in enumerate(zip(piece_starts(counts), counts))
                if r != root and count
            ]
        return Done(x, lambda: [request.wait() for request in requests])

    @abstractmethod
    def broadcast(self, x, root: int = 0):
        """Overwrite ``x`` with root's ``x``, in place; returns ``x``."""

    @abstractmethod
    def all_to_all(self, x):
        """Split ``x`` into ``size`` equal pieces along axis 0; piece j goes to rank j.
        Returns the pieces received, stacked in source-rank order along axis 0."""

    @abstractmethod
    def isend(self, x, dest: int, tag: int = 0) -> Request: ...

    @abstractmethod
    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        """Receive into ``buf``; ``wait()`` returns ``buf``."""

    def send(self, x, dest: int, tag: int = 0):
        self.isend(x, dest, tag).wait()

    def recv(self, buf, source: int, tag: int = 0):
        return self.irecv(buf, source, tag).wait()

    @abstractmethod
    def barrier(self): ...

    @abstractmethod
    def split(self, color: int, key: int) -> Communicator:
        """Sub-communicators of the ranks that share ``color``, ordered by ``key``."""

    @abstractmethod
    def split_node(self) -> Communicator:
        """Sub-communicator of the ranks that share this rank's node (shared memory)."""

    @abstractmethod
    def bcast_object(self, obj, root: int = 0, idle: bool = False):
        """Broadcast a small picklable object (control messages, not tensors). ``idle``: the other
        ranks may wait long for it (a server between requests), so they sleep while they wait rather
        than spin in MPI's progress loop."""

    @abstractmethod
    def allgather_object(self, obj) -> list: ...

    @abstractmethod
    def send_object(self, obj, dest: int, tag: int = 0):
        """Send a small picklable object to one rank (messages between replicas, not tensors)."""

    @abstractmethod
    def poll_object(self, tag: int = 0):
        """(source, object) of a message with ``tag`` that has arrived from any rank, or None at once."""

    def all_reduce_scalar(self, value: float, op: str = "sum") -> float:
        buf = numpy.array([value], dtype=numpy.float64)
        return float(self.all_reduce(buf, op)[0])


def on_rank0(comm: Communicator, work, idle: bool = False):
    """``work()`` on rank 0 of ``comm``; its result, or its ConfigError, on every rank (a user error
    found by the rank that reads the input fails every rank alike). ``idle``: the work may take long
    (waiting for requests), and the other ranks sleep while they wait."""
    payload = None
    if comm.rank == 0:
        try:
            payload = (work(), None)
        except ConfigError as e:
            payload = (None, str(e))
    result, error = comm.bcast_object(payload, idle=idle)
    if error is not None:
        raise ConfigError(error)
    return result
