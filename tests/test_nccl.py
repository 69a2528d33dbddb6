"""Device transports: the chooser, group set-up and NCCLCommunicator's order of calls (over a fake
NCCL) on the CPU with plain objects; NCCL itself where a GPU is."""

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from hpc_tp import backend
from hpc_tp.comm import use_device
from hpc_tp.comm.nccl import HostStagedCommunicator, choose_transport, cuda_aware_mpi, device_communicator


@pytest.mark.parametrize(
    "places, nccl, aware, p2p, expected",
    [
        ([("a", 0), ("a", 1)], True, False, False, "nccl"),  # one node, own devices
        ([("a", 0)], True, False, False, "mpi"),  # a group of one calls nothing
        ([("a", 0), ("a", 0)], True, True, False, "mpi-cuda-aware"),  # NCCL refuses one device twice
        ([("a", 0), ("a", 0)], True, False, False, "mpi-staged"),
        ([("a", 0), ("b", 0)], True, True, False, "mpi-cuda-aware"),  # across nodes: MPI
        ([("a", 0), ("b", 0)], True, False, False, "mpi-staged"),
        ([("a", 0), ("a", 1)], False, False, False, "mpi-staged"),  # cupy without NCCL
        ([("a", 0), ("a", 1)], True, True, True, "mpi-cuda-aware"),  # pipeline sends keep their MPI tags
    ],
)
def test_choose_transport(places, nccl, aware, p2p, expected):
    assert choose_transport(places, cuda=True, nccl=nccl, cuda_aware_mpi=aware, p2p=p2p) == expected


def test_no_device_arrays_means_plain_mpi():
    assert choose_transport([("a", -1), ("a", -1)], cuda=False, nccl=True, cuda_aware_mpi=True) == "mpi"


def test_cuda_aware_override(monkeypatch):
    monkeypatch.setenv("HPC_TP_CUDA_AWARE_MPI", "1")
    assert cuda_aware_mpi() is True
    monkeypatch.setenv("HPC_TP_CUDA_AWARE_MPI", "0")
    assert cuda_aware_mpi() is False


def test_launcher_local_rank():
    assert backend.launcher_local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}) == 3
    assert backend.launcher_local_rank({"SLURM_LOCALID": "1"}) == 1
    assert backend.launcher_local_rank({}) is None


def test_unknown_device_is_a_one_line_error():
    from hpc_tp.errors import ConfigError

    with pytest.raises(ConfigError, match="--device 'tpu'"):
        backend.use("tpu")


class _Group:
    """A stand-in group: what the chooser asks of a communicator, no MPI."""

    def __init__(self, size=2):
        self.rank, self.size = 0, size

    def allgather_object(self, obj):
        return [obj] * self.size

    def bcast_object(self, obj, root=0):
        return obj


def test_group_building_wraps_what_each_group_carries(monkeypatch):
    from hpc_tp.comm import nccl
    from hpc_tp.comm.watchdog import watched

    # A staged transport everywhere but pipeline p2p, as on a node whose MPI is not CUDA-aware.
    monkeypatch.setattr(nccl, "group_transport", lambda group, p2p=False: "mpi" if p2p else "mpi-staged")
    tp = watched(_Group())
    tp.label = "tp"
    grid = SimpleNamespace(tp=tp, dp=_Group(), ep=_Group(1), expert_dp=_Group(1), pp=_Group())
    pp = grid.pp
    chosen = nccl.use_device_communicators(grid)
    assert chosen == {
        "tp": "mpi-staged",
        "dp": "mpi-staged",
        "ep": "mpi-staged",
        "expert_dp": "mpi-staged",
        "pp": "mpi",
    }
    assert grid.tp is tp and tp.label == "tp" and isinstance(tp.inner, HostStagedCommunicator)  # still watched
    assert isinstance(grid.dp, HostStagedCommunicator) and grid.pp is pp


def test_group_transport_without_a_device_is_mpi():
    from hpc_tp.comm.nccl import group_transport

    assert group_transport(_Group()) == "mpi"


@pytest.mark.mpi(min_size=2)
def test_cpu_groups_keep_their_communicators(comm_world):
    from hpc_tp.grid import ProcessGrid

    grid = ProcessGrid(tp=comm_world.size, world=comm_world)
    before = {axis: getattr(grid, axis) for axis in ("tp", "dp", "pp")}
    assert use_device("cpu", grid) == {}
    assert all(getattr(grid, axis) is comm for axis, comm in before.items())
    assert device_communicator(grid.tp) is grid.tp  # no device: the transport is the group itself


@pytest.mark.mpi(min_size=2)
def test_host_staged_passes_host_arrays_through(comm_world):
    staged = HostStagedCommunicator(comm_world)
    x = np.full(4, float(comm_world.rank + 1))
    assert staged.all_reduce(x) is x
    np.testing.assert_array_equal(x, np.full(4, comm_world.size * (comm_world.size + 1) / 2))
    gathered = staged.all_gather(np.array([comm_world.rank]))
    np.testing.assert_array_equal(gathered, np.arange(comm_world.size))


# -- NCCLCommunicator's order of calls, with a fake cupy.cuda.nccl ---------------------------------------
class _DeviceArray:
    """What NCCLCommunicator reads of a cupy array (not a numpy one, which would go over MPI)."""

    def __init__(self, n=4):
        self.size, self.dtype, self.nbytes = n, np.dtype("float32"), 4 * n
        self.data, self.flags = SimpleNamespace(ptr=id(self)), SimpleNamespace(c_contiguous=True)

    def __getitem__(self, window: slice):
        return _DeviceArray(len(range(self.size)[window]))


class _Host:
    """The NCCL communicator's MPI side (rank 0 of 2): its calls go to the shared log."""

    def __init__(self, log):
        self.log, self.rank, self.size, self.seconds, self.bytes = log, 0, 2, 0.0, 0

    def __getattr__(self, name):
        def call(*args):
            self.log.append(f"host {name}")
            return self if name.startswith("split") else args[0] if args else None  # a split keeps both ranks

        return call


@pytest.fixture
def nccl_fake(monkeypatch):
    """An NCCLCommunicator (rank 0 of 2) over a fake NCCL whose calls, and its host's, go to one
    log in the order they are made: the order in which this rank issues work its peers wait on;
    its stream's ``capturing`` says whether a CUDA graph capture is under way, and ``waits`` counts
    the host's waits on it."""
    from hpc_tp.comm.nccl import NCCLCommunicator

    log = []

    class Comm:
        def __init__(self, size, unique_id, rank):
            pass

        def __getattr__(self, name):  # send, recv, allReduce, ...: (pointers, count, type, peer or op, stream)
            return lambda *args: log.append(f"{name} {args[3]}" if name in ("send", "recv") else name)

    constants = (
        "INT8",
        "UINT8",
        "INT32",
        "UINT32",
        "INT64",
        "UINT64",
        "FLOAT16",
        "FLOAT32",
        "FLOAT64",
        "SUM",
        "MAX",
        "MIN",
    )
    nccl = SimpleNamespace(
        available=True,
        get_unique_id=lambda: 0,
        NcclCommunicator=Comm,
        get_version=lambda: 22000,
        groupStart=lambda: log.append("groupStart"),
        groupEnd=lambda: log.append("groupEnd"),
        **{f"NCCL_{name}": i for i, name in enumerate(constants)},
    )
    stream = SimpleNamespace(ptr=0, capturing=False, waits=0)
    stream.is_capturing = lambda: stream.capturing
    stream.synchronize = lambda: setattr(stream, "waits", stream.waits + 1)
    cuda = SimpleNamespace(nccl=nccl, get_current_stream=lambda: stream)
    cupy = SimpleNamespace(cuda=cuda, ascontiguousarray=lambda x: x)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    comm = NCCLCommunicator(_Host(log))
    log.clear()  # the unique id's broadcast
    return SimpleNamespace(comm=comm, log=log, stream=stream)


@pytest.fixture
def nccl_log(nccl_fake):
    return nccl_fake.comm, nccl_fake.log


# Each call that may block on the peer, and the first thing it issues.
NEXT_CALLS = {
    "device all_reduce": (lambda comm: comm.all_reduce(_DeviceArray()), "allReduce"),
    "device broadcast": (lambda comm: comm.broadcast(_DeviceArray()), "broadcast"),
    "host all_reduce": (lambda comm: comm.all_reduce(np.ones(1)), "host all_reduce"),
    "bcast_object": (lambda comm: comm.bcast_object(1), "host bcast_object"),
    "barrier": (lambda comm: comm.barrier(), "host barrier"),
    "split": (lambda comm: comm.split(0, 0), "host split"),
    "split_node": (lambda comm: comm.split_node(), "host split_node"),
}


@pytest.mark.parametrize("call", sorted(NEXT_CALLS))
def test_posted_send_goes_out_before_the_next_call(nccl_log, call):
    """The peer may be blocked in the receive of a send this rank posted: the send must be issued
    before this rank blocks in anything else on the group, or the two wait for each other."""
    comm, log = nccl_log
    comm.isend(_DeviceArray(), 1)
    assert log == []  # posted: sends and receives between two calls go out as one group
    run, first = NEXT_CALLS[call]
    run(comm)
    assert log[:4] == ["groupStart", "send 1", "groupEnd", first], log


def test_a_wait_sends_everything_posted_as_one_group(nccl_log):
    comm, log = nccl_log
    comm.isend(_DeviceArray(), 1)
    received = comm.irecv(_DeviceArray(), 1)
    received.wait()
    assert log == ["groupStart", "send 1", "recv 1", "groupEnd"]


def test_a_gather_to_one_rank_moves_device_pieces_point_to_point(nccl_log):
    """NCCL has no gather: the generic form's receives (as root) and send (elsewhere) go out as
    groups, in the order the ranks post them."""
    comm, log = nccl_log
    comm.igather_flat(_DeviceArray(6), [4, 2], root=0).wait()
    comm.igather_flat(_DeviceArray(4), [4, 2], root=1).wait()
    assert log == ["groupStart", "recv 1", "groupEnd", "groupStart", "send 1", "groupEnd"]


def test_a_capture_records_device_collectives_with_no_host_wait(nccl_fake):
    """Inside a CUDA graph capture the collectives are queued for the replays: no stream wait (illegal
    while capturing) and nothing counted, though the communicator is a blocking one."""
    comm, log, stream = nccl_fake.comm, nccl_fake.log, nccl_fake.stream
    comm.all_reduce(_DeviceArray())
    assert (log, stream.waits, comm.bytes) == (["allReduce"], 2, 16)  # outside: waits around the call
    log.clear()
    stream.capturing, stream.waits = True, 0
    comm.all_reduce(_DeviceArray())
    comm.iall_reduce(_DeviceArray()).wait()
    comm.broadcast(_DeviceArray())
    assert (log, stream.waits, comm.bytes) == (["allReduce", "allReduce", "broadcast"], 0, 16)


@pytest.mark.parametrize("call", ["host all_reduce", "bcast_object", "barrier", "split"])
def test_a_host_call_inside_a_capture_is_refused(nccl_fake, call):
    """MPI would run it once, at the capture, and never at a replay: it must fail the capture (which
    ``cuda_graph.Replayed`` turns into eager steps and a warning)."""
    from hpc_tp.comm.nccl import HostCallInCapture

    nccl_fake.stream.capturing = True
    with pytest.raises(HostCallInCapture, match=r"on the host inside a CUDA graph capture: it would run once"):
        NEXT_CALLS[call][0](nccl_fake.comm)
    assert nccl_fake.log == []


def test_capturable_groups(nccl_fake, monkeypatch):
    """A graph may hold a group's collectives where they are NCCL's or the group is one rank, on a GPU."""
    from hpc_tp import cuda_graph
    from hpc_tp.comm.watchdog import WatchedCommunicator

    nccl, mpi, alone = nccl_fake.comm, _Group(2), _Group(1)
    watched = WatchedCommunicator(nccl, watchdog=None, members=[0, 1], label="tp")
    assert not cuda_graph.capturable(nccl)  # on the CPU nothing is captured
    monkeypatch.setattr(backend, "device", "cuda")
    assert cuda_graph.capturable(nccl) and cuda_graph.capturable(watched, alone)
    assert not cuda_graph.capturable(nccl, mpi) and not cuda_graph.capturable(HostStagedCommunicator(mpi))


class _Staged:
    """A device array as HostStagedCommunicator sees one (not numpy: ``get`` and ``set`` copy)."""

    def __init__(self, array):
        self.array, self.shape, self.dtype, self.nbytes = array, array.shape, array.dtype, array.nbytes

    def __getitem__(self, window: slice):
        return _Staged(self.array[window])

    def get(self):
        return self.array.copy()

    def set(self, host):
        self.array[...] = host


@pytest.mark.mpi(min_size=2)
def test_host_staged_gathers_device_pieces_to_one_rank(comm_world):
    n, r = comm_world.size, comm_world.rank
    counts = [rank % 3 for rank in range(n)]  # 0, 1, 2, 0: some empty
    whole = np.arange(float(sum(counts)))
    start = sum(counts[:r])
    mine = whole[start : start + counts[r]]
    x = _Staged(
        np.concatenate([np.full(start, np.nan), mine, np.full(whole.size - start - mine.size, np.nan)])
        if r == n - 1
        else mine.copy()
    )
    assert HostStagedCommunicator(comm_world).igather_flat(x, counts, root=n - 1).wait() is x
    if r == n - 1:
        np.testing.assert_array_equal(x.array, whole)


# -- with a GPU -------------------------------------------------------------------------------------------
@pytest.fixture
def cuda():
    if not backend.cuda_available():
        pytest.skip("no CUDA device (cupy missing or no GPU visible)")
    import cupy

    backend.use("cuda")
    yield cupy
    backend.use("cpu")


def test_one_rank_nccl_communicator(cuda, comm_self):
    from hpc_tp.comm.nccl import NCCLCommunicator, nccl_available

    if not nccl_available():
        pytest.skip("cupy has no NCCL here")
    comm = NCCLCommunicator(comm_self)
    x = cuda.arange(6, dtype=cuda.float64).reshape(2, 3)
    assert comm.all_reduce(x) is x
    cuda.testing.assert_array_equal(comm.all_gather(x, axis=1), x)
    cuda.testing.assert_array_equal(comm.reduce_scatter(x, axis=0), x)
    cuda.testing.assert_array_equal(comm.all_to_all(x), x)
    assert comm.broadcast(x) is x
    assert comm.all_reduce_scalar(2.5) == 2.5  # host values go over MPI
    assert comm.seconds >= 0


@pytest.mark.mpi(min_size=2)
def test_staged_and_cuda_aware_mpi_match_on_device(cuda, comm_world):
    """Ranks sharing one GPU: MPI carries device arrays (staged here, so any MPI works)."""
    comm = device_communicator(comm_world, transport="mpi-staged")
    x = cuda.full((2, 3), float(comm_world.rank + 1))
    comm.all_reduce(x)
    cuda.testing.assert_array_equal(x, cuda.full((2, 3), comm_world.size * (comm_world.size + 1) / 2))
    pieces = comm.all_gather(cuda.asarray([comm_world.rank], dtype=cuda.float64))
    cuda.testing.assert_array_equal(pieces, cuda.arange(comm_world.size, dtype=cuda.float64))
    if comm_world.rank < 2:
        peer = 1 - comm_world.rank
        out = cuda.empty(3)
        request = comm.irecv(out, peer, tag=7)
        comm.isend(cuda.full(3, float(comm_world.rank)), peer, tag=7).wait()
        cuda.testing.assert_array_equal(request.wait(), cuda.full(3, float(peer)))
