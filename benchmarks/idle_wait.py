"""What a rank waiting for rank 0 costs: CPU time over the wait and how late it wakes, for MPI's blocking
broadcast (spins) and the idle broadcast (``bcast_object(idle=True)``: sleeps between tests).

    mpiexec -n 2 python benchmarks/idle_wait.py [--rounds 5] [--wait 0.5]

Rounds alternate the two waits; rank 0 sleeps ``--wait`` seconds, then sends its clock.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hpc_tp.comm.mpi import world


def one_wait(comm, wait: float, idle: bool) -> tuple[float, float]:
    """(CPU seconds a waiting rank used per wall second, its wake-up delay in ms)."""
    comm.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    if comm.rank == 0:
        time.sleep(wait)
    sent = comm.bcast_object(time.perf_counter() if comm.rank == 0 else None, idle=idle)
    late = (time.perf_counter() - sent) * 1e3
    return (time.process_time() - cpu) / (time.perf_counter() - wall), late


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wait", type=float, default=0.5)
    args = parser.parse_args()
    comm = world()
    results = {False: [], True: []}
    for _ in range(args.rounds):
        for idle in (False, True):
            results[idle].append(one_wait(comm, args.wait, idle))
    rows = comm.allgather_object(results)
    if comm.rank == 0:
        for idle in (False, True):
            cpu = [c for r in rows[1:] for c, _ in r[idle]]
            late = [w for r in rows[1:] for _, w in r[idle]]
            print(
                f"{'idle broadcast ' if idle else 'MPI blocking   '}: waiting ranks' CPU {100 * statistics.median(cpu):5.1f}% "
                f"(max {100 * max(cpu):.1f}%), woke {statistics.median(late):.3f} ms after the send "
                f"(max {max(late):.3f})"
            )


if __name__ == "__main__":
    main()
