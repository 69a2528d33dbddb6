"""The one communicator interface layers talk to. Layers never import mpi4py.

Array arguments are numpy (or cupy) arrays. Collectives that can work in place do
(``all_reduce``, ``broadcast``) and return their argument; the others return new arrays.
Every blocking call adds its wall time to ``seconds`` so a step can be split into compute
and communication.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod


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
    """A request whose work is already done (or queued on the device stream): ``wait`` runs ``finish``."""

    def __init__(self, result, finish=None):
        self.result, self.finish = result, finish

    def wait(self):
        if self.finish is not None:
            self.finish()
        return self.result


class Communicator(ABC):
    rank: int
    size: int

    def __init__(self):
        self.seconds = 0.0
        self.bytes = 0

    def timed(self, nbytes: int = 0) -> "_Timed":
        """``with comm.timed(nbytes):`` around a transfer adds its wall time and bytes to the counters."""
        return _Timed(self, nbytes)

    @abstractmethod
    def all_reduce(self, x, op: str = "sum"):
        """Reduce ``x`` over the group, in place; returns ``x``. op: 'sum', 'max' or 'min'."""

    @abstractmethod
    def iall_reduce(self, x, op: str = "sum") -> Request:
        """Non-blocking in-place all-reduce; ``wait()`` returns ``x``."""

    @abstractmethod
    def all_gather(self, x, axis: int = 0):
        """Concatenate every rank's ``x`` along ``axis``, in rank order."""

    @abstractmethod
    def reduce_scatter(self, x, axis: int = 0):
        """Sum ``x`` over the group and return this rank's equal piece along ``axis``."""

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
    def split(self, color: int, key: int) -> "Communicator":
        """Sub-communicators of the ranks that share ``color``, ordered by ``key``."""

    @abstractmethod
    def split_node(self) -> "Communicator":
        """Sub-communicator of the ranks that share this rank's node (shared memory)."""

    @abstractmethod
    def bcast_object(self, obj, root: int = 0):
        """Broadcast a small picklable object (control messages, not tensors)."""

    @abstractmethod
    def allgather_object(self, obj) -> list: ...

    def all_reduce_scalar(self, value: float, op: str = "sum") -> float:
        import numpy

        buf = numpy.array([value], dtype=numpy.float64)
        return float(self.all_reduce(buf, op)[0])
