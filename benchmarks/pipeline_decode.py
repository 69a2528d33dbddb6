"""A decode step at pp = 2 (``serve.stages``) against pp = 1 on the same model, alternating in one run of
two ranks: pp = 1 is the whole model on rank 0 (rank 1 sleeping in an idle broadcast meanwhile),
pp = 2 the two stages of the training partition, one a rank. Each round prefills a fresh KV cache and
times ``--new-tokens`` decode steps after ``--warmup`` untimed ones, every step as a served one is: the
fed ids broadcast over the group from its rank 0, then the model's ``infer`` through every stage, the
logits reaching rank 0.

    mpiexec -n 2 python benchmarks/pipeline_decode.py [--model w1] [--batch 8] [--rounds 5]

Per variant: the wall time of a step on rank 0 (which waits for the logits: the whole pipeline), the
CPU time of a step summed over the ranks that run it (a stage waiting for its neighbour spins in MPI's
wait, which counts), and of it the CPU time in receives from a neighbouring stage
(``PipelineStages.wait_cpu_seconds``; the broadcast of the fed ids and the sends spin too, uncounted
there). Ranges over the rounds of each round's median step, and the median of the rounds; no time is
asserted anywhere. Weights are random: a product's time does not depend on the values.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy


def _steps(model, comm, args, rng):
    """(wall, CPU, CPU in receives from a neighbouring stage) seconds of each timed decode step on this rank."""
    from hpc_tp.serve.decoding import decode_stepper
    from hpc_tp.serve.kv_cache import KVCache

    total = args.prompt_len + args.warmup + args.new_tokens
    cache = KVCache.for_model(model, args.batch, total)
    key_mask = numpy.zeros((args.batch, total), dtype=bool)
    key_mask[:, : args.prompt_len] = True
    ids = rng.integers(0, model.cfg.vocab_size, (args.batch, args.prompt_len))
    positions = numpy.broadcast_to(numpy.arange(args.prompt_len), ids.shape)
    model.infer(ids, positions, key_mask[:, : args.prompt_len], cache)
    stepper = decode_stepper(model, cache, key_mask, numpy.full(args.batch, args.prompt_len), graphs=False)
    timed = []
    for step in range(args.warmup + args.new_tokens):
        wall, cpu, spun = time.perf_counter(), time.process_time(), getattr(model, "wait_cpu_seconds", 0.0)
        fed = rng.integers(0, model.cfg.vocab_size, args.batch) if comm.rank == 0 else numpy.empty(args.batch, int)
        stepper.step(comm.broadcast(fed))
        if step >= args.warmup:
            cpu = time.process_time() - cpu
            timed.append((time.perf_counter() - wall, cpu, getattr(model, "wait_cpu_seconds", 0.0) - spun))
    return timed


def main():
    from hpc_tp.backend import resolve_dtype
    from hpc_tp.comm.mpi import self_comm, world
    from hpc_tp.grid import ProcessGrid
    from hpc_tp.models.config import load_config
    from hpc_tp.models.gpt import GPTModel
    from hpc_tp.pipeline import build_stage
    from hpc_tp.serve.stages import PipelineStages

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="w1", help="preset or JSON config (default %(default)s)")
    parser.add_argument("--dtype", default="float32", help="default %(default)s")
    parser.add_argument("--batch", type=int, default=8, help="rows decoded together (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens a row (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=24, help="decode steps timed a round (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default %(default)s)")
    args = parser.parse_args()
    comm = world()
    if comm.size != 2:
        raise SystemExit(f"run under mpiexec -n 2 (pp = 2 needs two ranks), not {comm.size}")
    cfg, dtype = load_config(args.model), resolve_dtype(args.dtype)
    grid = ProcessGrid(tp=1, pp=2)
    variants = {
        "pp=1": GPTModel(cfg, self_comm(), dtype=dtype) if comm.rank == 0 else None,
        "pp=2": PipelineStages(build_stage(cfg, grid, dtype), grid),
    }
    found = {name: [] for name in variants}  # a round each: medians of (wall, CPU, CPU in receives) a step
    for round_ in range(args.rounds):
        for name, model in variants.items():
            rng = numpy.random.default_rng(round_)  # the same tokens on every rank
            timed = _steps(model, model.comm, args, rng) if model is not None else None
            comm.bcast_object(None, idle=True)  # a rank outside the variant sleeps here until it is done
            every = comm.allgather_object([(0.0, 0.0, 0.0)] * args.new_tokens if timed is None else timed)
            steps = [numpy.sum(ranks, axis=0) for ranks in zip(*every)]  # each step's CPU times over the ranks
            found[name].append(
                (
                    statistics.median(wall for wall, _, _ in every[0]),
                    statistics.median(s[1] for s in steps),
                    statistics.median(s[2] for s in steps),
                )
            )
    if comm.rank == 0:
        print(f"{args.model} {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, {args.rounds} rounds:")
        for name, rounds in found.items():
            wall, cpu, spun = ([r[i] * 1e3 for r in rounds] for i in range(3))
            print(
                f"  {name}: step {_range(wall)} ms wall; CPU over its ranks {_range(cpu)} ms, "
                f"of which in receives from a neighbouring stage {_range(spun)} ms",
                flush=True,
            )


def _range(values) -> str:
    return f"{min(values):.1f}-{max(values):.1f} (median {statistics.median(values):.1f})"


if __name__ == "__main__":
    main()
