"""Device-array communicators and the rule that picks one per group.

- ``NCCLCommunicator``: cupy.cuda.nccl for cupy arrays, one NCCL communicator per group (its
  unique id broadcast over the group's MPI communicator), every call queued on the current
  stream. Host (numpy) arrays, objects and barriers go over that MPI communicator, so the
  trainer's scalar reductions keep working unchanged.
- ``HostStagedCommunicator``: any communicator, device arrays copied to the host and back:
  MPI without CUDA support.
- ``choose_transport``: NCCL inside a node (every rank on its own device), MPI across nodes
  (CUDA-aware where the library says so, else host staging). NCCL refuses a communicator with
  two ranks on one device, so ranks sharing a GPU get MPI.

``blocking`` (the default) synchronizes the stream around each call, so ``seconds`` is the
communication time (the compute/communication split of a step) and the watchdog sees a
collective that hangs; ``blocking=False`` leaves every call stream-ordered (no host waits).
"""

from __future__ import annotations

import ctypes
import os
import socket
import warnings
from contextlib import contextmanager

import numpy

from .. import backend
from .base import Communicator, Done, Request

TRANSPORTS = ("nccl", "mpi-cuda-aware", "mpi-staged", "mpi")


class HostCallInCapture(RuntimeError):
    """A host (MPI) call made while a CUDA graph is being captured (``NCCLCommunicator``)."""


def _cupy():
    import cupy  # optional (hpc_tp[gpu]), and only the GPU path gets here

    return cupy


def _capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph."""
    return _cupy().cuda.get_current_stream().is_capturing()


def _on_host(x) -> bool:
    return x is None or isinstance(x, (numpy.ndarray, numpy.generic))


class NCCLCommunicator(Communicator):
    """NCCL over ``host``'s ranks (an MPI communicator of the same group, any Communicator works).
    Messages between two ranks match in the order they were posted: NCCL has no tags.

    While the current stream is being captured into a CUDA graph, device collectives are recorded
    with no host wait and no count (the graph's replays move the bytes, not the capture), and any
    call that needs the host (MPI: host arrays, objects, barriers) raises ``HostCallInCapture``: it
    would run once, at the capture, not at each replay."""

    stream_ordered = True

    def __init__(self, host: Communicator, blocking: bool = True):
        super().__init__()
        from cupy.cuda import nccl  # optional (hpc_tp[gpu]), and only the GPU path gets here

        if not nccl.available:
            raise RuntimeError("cupy was built without NCCL (or libnccl is not found)")
        self.host, self.blocking, self._nccl = host, blocking, nccl
        self.rank, self.size = host.rank, host.size
        unique_id = host.bcast_object(nccl.get_unique_id() if host.rank == 0 else None)
        self.comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self._pending: list[tuple[str, object, int]] = []  # p2p posted, sent as one group call
        self._dtypes = {
            numpy.dtype(k): getattr(nccl, v)
            for k, v in (
                ("int8", "NCCL_INT8"),
                ("uint8", "NCCL_UINT8"),
                ("int32", "NCCL_INT32"),
                ("uint32", "NCCL_UINT32"),
                ("int64", "NCCL_INT64"),
                ("uint64", "NCCL_UINT64"),
                ("float16", "NCCL_FLOAT16"),
                ("float32", "NCCL_FLOAT32"),
                ("float64", "NCCL_FLOAT64"),
            )
        }
        bf16 = _bfloat16_dtype()
        if bf16 is not None and nccl.get_version() >= 21000:  # ncclBfloat16 = 9 since NCCL 2.10; cupy may not name it
            self._dtypes[bf16] = getattr(nccl, "NCCL_BFLOAT16", 9)
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    # -- plumbing -----------------------------------------------------------------------------------
    def _type(self, x):
        try:
            return self._dtypes[numpy.dtype(x.dtype)]
        except KeyError:
            raise TypeError(f"NCCL has no type for {x.dtype}") from None

    @contextmanager
    def _launch(self, nbytes: int):
        """The stream to queue on; pending p2p goes first, so calls run in the order they were made."""
        stream = _cupy().cuda.get_current_stream()
        if stream.is_capturing():  # recorded for the replays: nothing to wait for or count now
            self._flush()
            yield stream.ptr
            return
        if self.blocking:
            stream.synchronize()  # the compute queued before is not communication time
        with self.timed(nbytes):
            self._flush()
            yield stream.ptr
            if self.blocking:
                stream.synchronize()

    def _refuse_in_capture(self, name: str):
        if _capturing():
            raise HostCallInCapture(
                f"{name} on the host inside a CUDA graph capture: it would run once, at the capture, not at each replay"
            )

    def _host_call(self, name: str, *args):
        """A call over MPI (host arrays, objects, splits), its time and bytes counted here too. Posted
        p2p goes out first: a peer may be waiting on it while this rank blocks in MPI."""
        self._refuse_in_capture(name)
        self._flush()
        seconds, nbytes = self.host.seconds, self.host.bytes
        result = getattr(self.host, name)(*args)
        self.seconds += self.host.seconds - seconds
        self.bytes += self.host.bytes - nbytes
        return result

    def _flush(self):
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        stream = _cupy().cuda.get_current_stream().ptr
        self._nccl.groupStart()
        try:
            for kind, array, peer in pending:
                getattr(self.comm, kind)(array.data.ptr, array.size, self._type(array), peer, stream)
        finally:
            self._nccl.groupEnd()

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x, op: str = "sum"):
        if _on_host(x):
            return self._host_call("all_reduce", x, op)
        if self.size == 1:
            return x
        buf = _cupy().ascontiguousarray(x)
        with self._launch(buf.nbytes) as stream:
            self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), self._ops[op], stream)
        if buf is not x:
            x[...] = buf
        return x

    def iall_reduce(self, x, op: str = "sum") -> Request:
        if _on_host(x):
            return self._host_call("iall_reduce", x, op)
        blocking, self.blocking = self.blocking, False  # queued now; wait() is where the host blocks
        try:
            self.all_reduce(x, op)
        finally:
            self.blocking = blocking
        return Done(x, self._wait_stream)

    def _wait_stream(self):
        if self.blocking and not _capturing():
            with self.timed():
                _cupy().cuda.get_current_stream().synchronize()

    def all_gather(self, x, axis: int = 0):
        if _on_host(x):
            return self._host_call("all_gather", x, axis)
        cupy = _cupy()
        buf = cupy.ascontiguousarray(x)
        out = cupy.empty((self.size,) + buf.shape, dtype=buf.dtype)
        with self._launch(buf.nbytes * self.size) as stream:
            self.comm.allGather(buf.data.ptr, out.data.ptr, buf.size, self._type(buf), stream)
        return cupy.concatenate(list(out), axis=axis) if axis != 0 else out.reshape((-1,) + buf.shape[1:])

    def reduce_scatter(self, x, axis: int = 0):
        if _on_host(x):
            return self._host_call("reduce_scatter", x, axis)
        if x.shape[axis] % self.size:
            raise ValueError(
                f"reduce_scatter: axis {axis} of length {x.shape[axis]} is not divisible by {self.size} ranks"
            )
        cupy = _cupy()
        send = cupy.ascontiguousarray(cupy.moveaxis(x, axis, 0))
        out = cupy.empty((send.shape[0] // self.size,) + send.shape[1:], dtype=send.dtype)
        with self._launch(send.nbytes) as stream:
            self.comm.reduceScatter(send.data.ptr, out.data.ptr, out.size, self._type(send), self._ops["sum"], stream)
        return cupy.ascontiguousarray(cupy.moveaxis(out, 0, axis)) if axis != 0 else out

    def broadcast(self, x, root: int = 0):
        if _on_host(x):
            return self._host_call("broadcast", x, root)
        if self.size == 1:
            return x
        buf = _cupy().ascontiguousarray(x)
        with self._launch(buf.nbytes) as stream:
            self.comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), root, stream)
        if buf is not x:
            x[...] = buf
        return x

    def all_to_all(self, x):
        if _on_host(x):
            return self._host_call("all_to_all", x)
        if x.shape[0] % self.size:
            raise ValueError(f"all_to_all: axis 0 of length {x.shape[0]} is not divisible by {self.size} ranks")
        cupy = _cupy()
        send = cupy.ascontiguousarray(x).reshape((self.size, -1) + x.shape[1:])
        out = cupy.empty_like(send)
        out[self.rank] = send[self.rank]
        self._pending.extend(
            item
            for peer in range(self.size)
            if peer != self.rank
            for item in (("send", send[peer], peer), ("recv", out[peer], peer))
        )
        with self._launch(send.nbytes):
            pass  # the exchange is the pending group, sent on entry
        return out.reshape(x.shape)

    # -- point to point: posted, then issued together (one NCCL group) at the next wait or call ---------
    # Grouped, two ranks exchanging cannot deadlock (issued one by one, each rank's send would wait on
    # its stream for the peer's receive, queued behind the peer's own send). Every call that may block
    # on a peer issues what is posted first; blocking on another communicator in between is the
    # caller's to avoid. The pipeline never gets here: its group uses MPI (``choose_transport``, p2p).
    def isend(self, x, dest: int, tag: int = 0) -> Request:
        if _on_host(x):
            return self._host_call("isend", x, dest, tag)
        buf = _cupy().ascontiguousarray(x)
        self._pending.append(("send", buf, dest))
        return Done(None, lambda: self._p2p_wait(buf.nbytes))

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        if _on_host(buf):
            return self._host_call("irecv", buf, source, tag)
        if not buf.flags.c_contiguous:
            raise ValueError("irecv: the receive buffer must be C-contiguous (NCCL writes it in place)")
        self._pending.append(("recv", buf, source))
        return Done(buf, lambda: self._p2p_wait(buf.nbytes))

    def _p2p_wait(self, nbytes: int):
        with self._launch(nbytes):
            pass  # sends what is still pending, then (blocking) waits for the stream

    # -- control: over MPI ---------------------------------------------------------------------------
    def barrier(self):
        self._refuse_in_capture("barrier")
        self._flush()
        _cupy().cuda.get_current_stream().synchronize()
        self._host_call("barrier")

    def split(self, color: int, key: int) -> NCCLCommunicator:
        return NCCLCommunicator(self._host_call("split", color, key), self.blocking)

    def split_node(self) -> NCCLCommunicator:
        return NCCLCommunicator(self._host_call("split_node"), self.blocking)

    def bcast_object(self, obj, root: int = 0, idle: bool = False):
        return self._host_call("bcast_object", obj, root, idle)

    def allgather_object(self, obj) -> list:
        return self._host_call("allgather_object", obj)

    # Straight to MPI, not through _host_call: messages may come from another thread than the collectives.
    def send_object(self, obj, dest: int, tag: int = 0):
        self.host.send_object(obj, dest, tag)

    def poll_object(self, tag: int = 0):
        return self.host.poll_object(tag)

    def abort(self, code: int = 1):
        self.comm.abort()
        self.host.abort(code)


class HostStagedCommunicator(Communicator):
    """``inner`` (e.g. MPI without CUDA support) for device arrays: each is copied to the host,
    communicated there and copied back. ``seconds`` includes the copies: they are the price of
    this transport."""

    def __init__(self, inner: Communicator):
        super().__init__()
        self.inner, self.rank, self.size = inner, inner.rank, inner.size

    def _staged(self, name: str, x, *args, in_place: bool = False):
        if _on_host(x):
            return getattr(self.inner, name)(x, *args)
        cupy = _cupy()
        with self.timed(x.nbytes):
            result = getattr(self.inner, name)(x.get(), *args)
            if in_place:
                x[...] = cupy.asarray(result)
                return x
            return cupy.asarray(result)

    def all_reduce(self, x, op: str = "sum"):
        return self._staged("all_reduce", x, op, in_place=True)

    def iall_reduce(self, x, op: str = "sum") -> Request:
        return Done(self.all_reduce(x, op))

    def all_gather(self, x, axis: int = 0):
        return self._staged("all_gather", x, axis)

    def reduce_scatter(self, x, axis: int = 0):
        return self._staged("reduce_scatter", x, axis)

    def broadcast(self, x, root: int = 0):
        return self._staged("broadcast", x, root, in_place=True)

    def all_to_all(self, x):
        return self._staged("all_to_all", x)

    def isend(self, x, dest: int, tag: int = 0) -> Request:
        return self.inner.isend(x if _on_host(x) else x.get(), dest, tag)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        if _on_host(buf):
            return self.inner.irecv(buf, source, tag)
        staging = numpy.empty(buf.shape, dtype=buf.dtype)
        request = self.inner.irecv(staging, source, tag)

        def finish():
            request.wait()
            buf.set(staging)

        return Done(buf, finish)

    def barrier(self):
        self.inner.barrier()

    def split(self, color: int, key: int) -> HostStagedCommunicator:
        return HostStagedCommunicator(self.inner.split(color, key))

    def split_node(self) -> HostStagedCommunicator:
        return HostStagedCommunicator(self.inner.split_node())

    def bcast_object(self, obj, root: int = 0, idle: bool = False):
        return self.inner.bcast_object(obj, root, idle)

    def allgather_object(self, obj) -> list:
        return self.inner.allgather_object(obj)

    def send_object(self, obj, dest: int, tag: int = 0):
        self.inner.send_object(obj, dest, tag)

    def poll_object(self, tag: int = 0):
        return self.inner.poll_object(tag)

    def abort(self, code: int = 1):
        self.inner.abort(code)


# -- the chooser ----------------------------------------------------------------------------------------
def choose_transport(
    places: list[tuple[str, int]], cuda: bool, nccl: bool, cuda_aware_mpi: bool, p2p: bool = False
) -> str:
    """How a group whose ranks sit at ``places`` ((host, device) per rank) moves device arrays.

    NCCL only where every rank is on one node, each on its own device (NCCL refuses one device
    twice in a communicator) and the group is not a point-to-point one (p2p=True: pipeline
    sends, whose MPI tags NCCL cannot keep apart). Otherwise MPI, given device pointers where
    it is CUDA-aware and host copies where not. 'mpi' when there are no device arrays at all, and
    for a group of one rank: its collectives return without a call, so it needs no communicator
    (a trainer's dp, ep and expert-dp groups are often one rank: no NCCL set-up for them).
    """
    if not cuda or len(places) == 1:
        return "mpi"
    one_node = len({host for host, _ in places}) == 1
    own_devices = len(set(places)) == len(places)
    if nccl and one_node and own_devices and not p2p:
        return "nccl"
    return "mpi-cuda-aware" if cuda_aware_mpi else "mpi-staged"


def cuda_aware_mpi() -> bool:
    """Whether the MPI library takes device pointers: ``HPC_TP_CUDA_AWARE_MPI=0/1`` decides if set,
    else Open MPI's ``MPIX_Query_cuda_support`` (False where the library has no such call)."""
    forced = os.environ.get("HPC_TP_CUDA_AWARE_MPI")
    if forced in ("0", "1"):
        return forced == "1"
    from mpi4py import MPI  # starts MPI on import: importing this module must not (hpc-tp --help)

    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


def nccl_available() -> bool:
    with warnings.catch_warnings():  # cupy warns at import when libnccl is missing; the answer says so
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl  # optional (hpc_tp[gpu]), and only the GPU path gets here
        except ImportError:
            return False
    return bool(nccl.available)


def group_transport(group: Communicator, p2p: bool = False) -> str:
    """``choose_transport`` for ``group`` as it is placed (collective over the group)."""
    cuda = backend.device == "cuda"
    device = backend.xp.cuda.Device().id if cuda else -1
    places = [tuple(p) for p in group.allgather_object((socket.gethostname(), device))]
    # Every rank must reach the same answer: the library facts are rank 0's.
    facts = group.bcast_object((nccl_available(), cuda_aware_mpi()) if group.rank == 0 else None)
    return choose_transport(places, cuda, *facts, p2p=p2p)


def device_communicator(group: Communicator, p2p: bool = False, transport: str | None = None) -> Communicator:
    """``group`` as it should carry this rank's device arrays (collective over the group).
    ``transport`` forces one of TRANSPORTS (tests, gpu-check); None: ``group_transport``."""
    transport = transport or group_transport(group, p2p)
    if transport == "nccl":
        return NCCLCommunicator(group)
    if transport == "mpi-staged":
        return HostStagedCommunicator(group)
    if transport in ("mpi", "mpi-cuda-aware"):
        return group
    raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")


def use_device_communicators(grid) -> dict[str, str]:
    """Give each of ``grid``'s groups its transport (``choose_transport``); returns {axis: transport}.
    A watched group keeps its watchdog: the transport replaces what it wraps."""
    chosen = {}
    for axis in ("tp", "dp", "ep", "expert_dp", "pp"):
        group = getattr(grid, axis)
        inner = getattr(group, "inner", group)
        chosen[axis] = group_transport(inner, p2p=axis == "pp")
        new = device_communicator(inner, transport=chosen[axis])
        if new is inner:
            continue
        if inner is not group:
            group.inner = new
        else:
            setattr(grid, axis, new)
    return chosen


def _bfloat16_dtype():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return numpy.dtype(ml_dtypes.bfloat16)
