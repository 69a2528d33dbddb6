"""Communicator over mpi4py's buffer API (upper-case methods: no pickling of tensors).

Works for numpy arrays and, with a CUDA-aware MPI, for cupy arrays: a device buffer is made
stream-complete before MPI reads it.
"""

from __future__ import annotations

import math
import pickle
import time
from time import perf_counter

import numpy
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .base import Communicator, Done, Request, piece_starts

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
# The longest sleep between two tests of an idle wait: how late a rank may wake after the broadcast.
IDLE_POLL_MAX_S = 2e-3


def _ready(x):
    """A contiguous buffer MPI can read; device work queued on it finished first."""
    if type(x) is numpy.ndarray and x.flags.c_contiguous:  # the common case, first: no call at all
        return x
    if not isinstance(x, numpy.ndarray):
        import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

        buf = cupy.ascontiguousarray(x)  # a copy is queued on the stream too: wait after it, not before
        cupy.cuda.get_current_stream().synchronize()
        return buf
    return numpy.ascontiguousarray(x)


def _wire(buf):
    """What MPI is handed for ``buf``: bfloat16 (ml_dtypes) has no MPI datatype and no buffer format
    mpi4py reads, so its bits travel as uint16 (reductions go through float32 instead)."""
    return buf.view(numpy.uint16) if _bfloat16(buf) else buf


def _bfloat16(x) -> bool:
    # ``dtype.kind`` first: ml_dtypes' bfloat16 is kind 'V', and ``dtype.name`` is computed in Python
    # on every read (a 64 KiB all-reduce measured 13-20% slower with the name checked on each call).
    return x.dtype.kind == "V" and x.dtype.name == "bfloat16"


def _bits(buf):
    """``buf`` as unsigned integers of its width: flat gathers copy bits, so any dtype travels,
    float16 and bfloat16 included."""
    return buf.view(f"u{buf.itemsize}")


def _pieces(wire, counts) -> list:
    """The receive buffer of a flat gather: rank r's ``counts[r]`` elements at their offset."""
    return [wire, list(counts), piece_starts(counts), from_numpy_dtype(wire.dtype)]


def _empty_like(x, shape):
    if isinstance(x, numpy.ndarray):
        return numpy.empty(shape, dtype=x.dtype)
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    return cupy.empty(shape, dtype=x.dtype)


class _MPIRequest(Request):
    def __init__(self, req, result, owner, nbytes):
        self.req, self.result, self.owner, self.nbytes = req, result, owner, nbytes

    def wait(self):
        with self.owner.timed(self.nbytes):
            self.req.Wait()
        return self.result


class MPICommunicator(Communicator):
    def __init__(self, comm=None):
        super().__init__()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._datatypes = {}  # derived datatypes of all_gather along inner axes, by shape

    def all_reduce(self, x, op: str = "sum"):
        if self.size == 1:
            return x
        if type(x) is numpy.ndarray and x.flags.c_contiguous and x.dtype.kind != "V":
            # The common case, timed inline: every statement between the caller and MPI shows on a
            # 64 KiB all-reduce (bench comm); the general path below handles copies and bfloat16.
            start = perf_counter()
            self.comm.Allreduce(MPI.IN_PLACE, x, op=_OPS[op])
            self.seconds += perf_counter() - start
            self.bytes += x.nbytes
            return x
        if _bfloat16(x):  # summed in float32, rounded once
            x[...] = self.all_reduce(x.astype("float32"), op)
            return x
        buf = _ready(x)
        with self.timed(buf.nbytes):
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=_OPS[op])
        if buf is not x:
            x[...] = buf
        return x

    # Non-blocking collectives run inside ``wait``, as the blocking call. Open MPI's non-blocking ones
    # (libnbc) progress only inside MPI calls, so they ran in ``wait`` anyway, but 2.7x slower than
    # the blocking algorithm on a 25 MiB bucket (12.5 against 4.6 ms), with a bucket-sized temporary
    # of their own. Callers wait in the order they post, which keeps the ranks'
    # collectives in one order.
    def iall_reduce(self, x, op: str = "sum") -> Request:
        return Done(x, lambda: self.all_reduce(x, op))

    def ireduce_scatter_flat(self, x, counts) -> Request:
        if _bfloat16(x):  # no MPI sum of bfloat16: the generic form goes through float32 all-reduces
            return super().ireduce_scatter_flat(x, counts)
        return Done(x[: counts[self.rank]], lambda: self._reduce_scatter_flat(x, counts))

    def _reduce_scatter_flat(self, x, counts):
        if self.size == 1:
            return
        buf = _ready(x)
        with self.timed(buf.nbytes):
            self.comm.Reduce_scatter(MPI.IN_PLACE, buf, list(counts), op=MPI.SUM)
        if buf is not x:
            x[: counts[self.rank]] = buf[: counts[self.rank]]

    def iall_gather_flat(self, x, counts) -> Request:
        return Done(x, lambda: self._all_gather_flat(x, counts))

    def _all_gather_flat(self, x, counts):
        if self.size == 1:
            return
        buf = _ready(x)
        wire = _bits(buf)
        with self.timed(buf.nbytes):
            self.comm.Allgatherv(MPI.IN_PLACE, _pieces(wire, counts))
        if buf is not x:
            x[...] = buf

    def igather_flat(self, x, counts, root: int = 0) -> Request:
        return Done(x, lambda: self._gather_flat(x, counts, root))

    def _gather_flat(self, x, counts, root: int):
        if self.size == 1:
            return
        buf = _ready(x)
        wire = _bits(buf)
        with self.timed(buf.nbytes):
            if self.rank == root:
                self.comm.Gatherv(MPI.IN_PLACE, _pieces(wire, counts), root=root)
            else:
                self.comm.Gatherv(wire, None, root=root)
        if buf is not x and self.rank == root:
            x[...] = buf

    def all_gather(self, x, axis: int = 0):
        if self.size == 1:  # no MPI call: a device buffer never reaches an MPI that cannot read it
            return x.copy()
        buf, axis = _ready(x), axis % x.ndim
        if axis and not isinstance(buf, numpy.ndarray):
            # Device buffers gather rank-major and concatenate: CUDA-aware MPIs unpack a derived
            # datatype into GPU memory one block at a time (or not at all).
            import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

            return cupy.concatenate(list(self.all_gather(buf, axis=0).reshape((self.size,) + buf.shape)), axis=axis)
        out = _empty_like(buf, buf.shape[:axis] + (buf.shape[axis] * self.size,) + buf.shape[axis + 1 :])
        send, recv = _wire(buf), _wire(out)
        with self.timed(buf.nbytes * self.size):
            if axis == 0:
                self.comm.Allgather(send, recv)
            else:  # each shard lands in its interleaved place: no gathered copy to concatenate after
                self.comm.Allgather(
                    send, [recv, 1, self._interleaved(send.dtype, buf.size, math.prod(buf.shape[:axis]))]
                )
        return out

    def _interleaved(self, dtype, shard_size: int, outer: int) -> MPI.Datatype:
        """A rank's place in a gather along an inner axis: ``outer`` runs of ``shard_size / outer``
        elements, ``size`` runs apart, the next rank's place one run further (committed once per shape)."""
        key = (dtype, shard_size, outer)
        if key not in self._datatypes:
            run = shard_size // outer
            element = from_numpy_dtype(dtype)
            vector = element.Create_vector(outer, run, run * self.size)
            self._datatypes[key] = vector.Create_resized(0, run * dtype.itemsize).Commit()
            vector.Free()
        return self._datatypes[key]

    def reduce_scatter(self, x, axis: int = 0):
        if x.shape[axis] % self.size:
            raise ValueError(
                f"reduce_scatter: axis {axis} of length {x.shape[axis]} is not divisible by {self.size} ranks"
            )
        if self.size == 1:
            return x.copy()
        if _bfloat16(x):
            return self.reduce_scatter(x.astype("float32"), axis).astype(x.dtype)
        axis %= x.ndim
        outer = math.prod(x.shape[:axis])
        # Rank r's part, packed [ranks, outer, rest]: the result is contiguous in x's layout as it comes.
        send = _ready(x if outer == 1 else x.reshape(outer, self.size, -1).swapaxes(0, 1))
        out = _empty_like(send, x.shape[:axis] + (x.shape[axis] // self.size,) + x.shape[axis + 1 :])
        with self.timed(send.nbytes):
            self.comm.Reduce_scatter_block(send, out, op=MPI.SUM)
        return out

    def broadcast(self, x, root: int = 0):
        if self.size == 1:
            return x
        buf = _ready(x)
        with self.timed(buf.nbytes):
            self.comm.Bcast(_wire(buf), root=root)
        if buf is not x:
            x[...] = buf
        return x

    def all_to_all(self, x):
        if x.shape[0] % self.size:
            raise ValueError(f"all_to_all: axis 0 of length {x.shape[0]} is not divisible by {self.size} ranks")
        if self.size == 1:
            return x.copy()
        buf = _ready(x)
        out = _empty_like(buf, buf.shape)
        with self.timed(buf.nbytes):
            self.comm.Alltoall(_wire(buf), _wire(out))
        return out

    def isend(self, x, dest: int, tag: int = 0) -> Request:
        buf = _ready(x)
        return _MPIRequest(self.comm.Isend(_wire(buf), dest=dest, tag=tag), None, self, buf.nbytes)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        return _MPIRequest(self.comm.Irecv(_wire(buf), source=source, tag=tag), buf, self, buf.nbytes)

    def barrier(self):
        with self.timed():
            self.comm.Barrier()

    def split(self, color: int, key: int) -> MPICommunicator:
        return MPICommunicator(self.comm.Split(color, key))

    def split_node(self) -> MPICommunicator:
        return MPICommunicator(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))

    def bcast_object(self, obj, root: int = 0, idle: bool = False):
        if not idle or self.size == 1:
            return self.comm.bcast(obj, root=root)
        # MPI's blocking wait spins a core for as long as it waits. The size goes first, non-blocking,
        # tested between sleeps; the object follows at once, when every rank is there to take it.
        size = numpy.zeros(1, dtype=numpy.int64)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else None
        if data is not None:
            size[0] = len(data)
        _wait_sleeping(self.comm.Ibcast(size, root=root))
        buf = bytearray(data) if data is not None else bytearray(int(size[0]))
        self.comm.Bcast(buf, root=root)
        return obj if data is not None else pickle.loads(buf)

    def allgather_object(self, obj) -> list:
        return self.comm.allgather(obj)

    def send_object(self, obj, dest: int, tag: int = 0):
        self.comm.send(obj, dest=dest, tag=tag)

    def poll_object(self, tag: int = 0):
        status = MPI.Status()
        if not self.comm.iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            return None
        return status.Get_source(), self.comm.recv(source=status.Get_source(), tag=tag)

    def abort(self, code: int = 1):
        self.comm.Abort(code)


def _wait_sleeping(request):
    """Test, sleep, test again, the sleep doubling from 50 us to ``IDLE_POLL_MAX_S``: a rank that
    waits minutes costs next to no CPU and wakes within that much of the request's completion."""
    pause = 50e-6
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, IDLE_POLL_MAX_S)


def world() -> MPICommunicator:
    return MPICommunicator(MPI.COMM_WORLD)


def self_comm() -> MPICommunicator:
    """A group of one: the tp=1 reference that tests compare every layout against."""
    return MPICommunicator(MPI.COMM_SELF)
