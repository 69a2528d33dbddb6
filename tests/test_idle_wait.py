"""An idle broadcast: ranks that wait long for rank 0 (a server between requests) sleep instead of
spinning in MPI's progress loop, and still receive exactly what rank 0 sends."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.mpi(min_size=2)


def test_an_idle_broadcast_delivers_every_object(comm_world):
    for obj in (None, 7, [(3, [1, 2, 3], 0, 3)], {"text": "ünï" * 1000}, ("x", None)):
        got = comm_world.bcast_object(obj if comm_world.rank == 0 else "not this", idle=True)
        assert got == obj


def test_ranks_waiting_on_an_idle_broadcast_use_little_cpu(comm_world):
    """Rank 0 sends after a second; the others' CPU time over that second stays far below the second a
    spinning wait burns (generous bound: the machine may be loaded)."""
    comm_world.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    if comm_world.rank == 0:
        time.sleep(1.0)
    sent_at = comm_world.bcast_object(time.perf_counter() if comm_world.rank == 0 else None, idle=True)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    woke_after = time.perf_counter() - sent_at
    if comm_world.rank != 0:
        assert wall >= 0.9 and cpu < 0.25 * wall, f"waited {wall:.2f} s using {cpu:.2f} s of CPU"
        assert woke_after < 1.0  # an upper bound a loaded machine keeps; benchmarks/idle_wait.py measures it
