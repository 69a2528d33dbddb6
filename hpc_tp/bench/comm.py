"""Latency and bandwidth of the collectives and of point-to-point, through the project's
``MPICommunicator`` and through raw mpi4py buffer calls, on the same buffers in the same run.

The two are interleaved iteration by iteration, alternating which goes first, so machine noise
hits both alike and their time ratio is the communicator's own overhead. Each call is timed
between barriers; an iteration takes the slowest rank's time (a collective is as slow as its
slowest member) and a size reports the median over iterations after warm-up.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md there): algbw = bytes / time, with bytes the
full buffer (the gathered or reduced whole for all-gather and reduce-scatter); busbw scales algbw
by the share of the data each link carries, so it compares with the link's speed at any rank count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

import numpy
from mpi4py import MPI

from ..comm.mpi import MPICommunicator
from ..grid import node_of_ranks

DTYPE = numpy.dtype("float32")


@dataclass(frozen=True)
class Op:
    name: str
    setup: Callable  # (comm, count) -> (project_call, raw_call): closures over buffers allocated once
    bus_factor: Callable[[int], float]  # busbw / algbw at n ranks
    split: bool = False  # the buffer is cut into one piece per rank, so its length is a multiple of n
    transfers: int = 1  # one-way transfers per call: a ping-pong makes two
    min_ranks: int = 1
    peer: Callable | None = None  # ping-pongs: (each rank's node) -> rank 0's partner, None if there is none


# Zeros: repeated in-place sums stay zero, never reaching inf or the slow denormal paths.


def _all_reduce(comm, count):
    x = numpy.zeros(count, DTYPE)
    return (lambda: comm.all_reduce(x)), (lambda: comm.comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM))


def _all_gather(comm, count):
    piece, gathered = numpy.zeros(count // comm.size, DTYPE), numpy.empty(count, DTYPE)
    return (lambda: comm.all_gather(piece)), (lambda: comm.comm.Allgather(piece, gathered))


def _reduce_scatter(comm, count):
    x, piece = numpy.zeros(count, DTYPE), numpy.empty(count // comm.size, DTYPE)
    return (lambda: comm.reduce_scatter(x)), (lambda: comm.comm.Reduce_scatter_block(x, piece, op=MPI.SUM))


def _ping_pong_with(peer_of):
    """A ping-pong between rank 0 and ``peer_of(nodes)`` (``nodes``: each rank's node); the other ranks
    only join the barriers."""

    def setup(comm, count, nodes):
        x, raw, peer = numpy.zeros(count, DTYPE), comm.comm, peer_of(nodes)
        if comm.rank == 0:
            return (lambda: (comm.send(x, peer), comm.recv(x, peer))), (lambda: (raw.Send(x, peer), raw.Recv(x, peer)))
        if comm.rank == peer:
            return (lambda: (comm.recv(x, 0), comm.send(x, 0))), (lambda: (raw.Recv(x, 0), raw.Send(x, 0)))
        return (lambda: None), (lambda: None)

    return setup


def _last_rank(nodes):
    return len(nodes) - 1


def _same_node_rank(nodes):
    """The first rank other than 0 on rank 0's node: the intra-node link; None if rank 0 is alone."""
    return next((r for r in range(1, len(nodes)) if nodes[r] == nodes[0]), None)


def _other_node_rank(nodes):
    """The first rank on another node than rank 0's: the inter-node link; None on one node."""
    return next((r for r in range(1, len(nodes)) if nodes[r] != nodes[0]), None)


def _collective(setup):
    return lambda comm, count, nodes: setup(comm, count)


OPS = {
    op.name: op
    for op in (
        Op("all_reduce", _collective(_all_reduce), lambda n: 2 * (n - 1) / n),
        Op("all_gather", _collective(_all_gather), lambda n: (n - 1) / n, split=True),
        Op("reduce_scatter", _collective(_reduce_scatter), lambda n: (n - 1) / n, split=True),
        Op("p2p", _ping_pong_with(_last_rank), lambda n: 1.0, transfers=2, min_ranks=2, peer=_last_rank),
        Op(
            "p2p_intra", _ping_pong_with(_same_node_rank), lambda n: 1.0, transfers=2, min_ranks=2, peer=_same_node_rank
        ),
        Op(
            "p2p_inter",
            _ping_pong_with(_other_node_rank),
            lambda n: 1.0,
            transfers=2,
            min_ranks=2,
            peer=_other_node_rank,
        ),
    )
}
# What runs when no --ops is given; p2p_intra and p2p_inter measure the two link kinds of a multi-node run.
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def runs_here(op: Op, nodes: list) -> bool:
    """Whether ``op`` can run on ranks placed on ``nodes``: enough ranks, and a partner of the kind it needs."""
    return len(nodes) >= op.min_ranks and (op.peer is None or op.peer(nodes) is not None)


def link_of(op: Op, nodes: list) -> str:
    """ "inter" when the measured ranks sit on more than one node, else "intra"."""
    ranks = [0, op.peer(nodes)] if op.peer is not None else range(len(nodes))
    return "inter" if len({nodes[r] for r in ranks}) > 1 else "intra"


def element_count(op: Op, nbytes: int, ranks: int) -> int:
    """Elements for a message of about ``nbytes``: at least one per rank's piece, whole pieces only."""
    granule = ranks if op.split else 1
    return max(granule, nbytes // DTYPE.itemsize // granule * granule)


def benchmark_comm(comm: MPICommunicator, sizes, ops=DEFAULT_OPS, iters: int = 20, warmup: int = 5) -> list[dict]:
    """One record per (op, size) in bytes, saying which link it crossed ("intra" or "inter" node); ops
    that cannot run here (too few ranks, no partner on the link they measure) are left out.
    Collective over ``comm``; every rank returns the same records."""
    nodes = node_of_ranks(comm)
    return [
        _measure(comm, OPS[name], element_count(OPS[name], nbytes, comm.size), iters, warmup, nodes)
        for name in ops
        if runs_here(OPS[name], nodes)
        for nbytes in sizes
    ]


def _measure(comm, op: Op, count: int, iters: int, warmup: int, nodes: list) -> dict:
    calls = op.setup(comm, count, nodes)
    for _ in range(warmup):
        for call in calls:
            call()
    seconds = numpy.empty((len(calls), iters))
    for i in range(iters):
        # Alternate the order so neither always runs in the other's wake (warm caches, queued progress).
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            comm.comm.Barrier()
            start = perf_counter()
            calls[which]()
            seconds[which, i] = perf_counter() - start
    comm.comm.Allreduce(MPI.IN_PLACE, seconds, op=MPI.MAX)
    project_s, raw_s = numpy.median(seconds, axis=1) / op.transfers
    nbytes = count * DTYPE.itemsize
    return {
        "op": op.name,
        "ranks": comm.size,
        "link": link_of(op, nodes),
        "bytes": nbytes,
        "dtype": DTYPE.name,
        "iters": iters,
        **_rates("project", project_s, nbytes, op.bus_factor(comm.size)),
        **_rates("raw", raw_s, nbytes, op.bus_factor(comm.size)),
        "project_over_raw": float(project_s / raw_s),
    }


def _rates(prefix: str, seconds: float, nbytes: int, bus_factor: float) -> dict:
    algbw = nbytes / seconds / 1e9
    return {
        f"{prefix}_time_s": float(seconds),
        f"{prefix}_algbw_GBps": algbw,
        f"{prefix}_busbw_GBps": algbw * bus_factor,
    }


def format_size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024 or unit == "MiB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024


def format_table(records: list[dict]) -> str:
    """A fixed-width table: times in microseconds, bandwidths in GB/s (1e9 bytes/s)."""
    header = (
        "op",
        "link",
        "size",
        "proj us",
        "raw us",
        "proj algbw",
        "proj busbw",
        "raw algbw",
        "raw busbw",
        "proj/raw",
    )
    rows = [
        (
            r["op"],
            r["link"],
            format_size(r["bytes"]),
            f"{r['project_time_s'] * 1e6:.1f}",
            f"{r['raw_time_s'] * 1e6:.1f}",
            f"{r['project_algbw_GBps']:.3f}",
            f"{r['project_busbw_GBps']:.3f}",
            f"{r['raw_algbw_GBps']:.3f}",
            f"{r['raw_busbw_GBps']:.3f}",
            f"{r['project_over_raw']:.2f}",
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in [header] + rows
    )
