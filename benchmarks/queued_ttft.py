"""Time to first token of a short request that arrives while a long one decodes, static batching
(``Engine.generate``, what ``hpc-tp serve`` ran before continuous batching) against continuous
batching (``ContinuousBatcher``, what it runs now), alternating in one run at tp = world.

    mpiexec -n 2 python benchmarks/queued_ttft.py [--model tiny] [--long 48] [--short 8] [--after 4] [--rounds 7]

Both prompts are 16 random tokens, decoded greedily in float32. The short request "arrives" the
moment the long one's ``--after``-th token is chosen. Static: it waits for the long request's batch
to end, then runs as a batch of its own (its time to first token counts from its arrival to the
start of that batch, plus the batch's own time to first token). Continuous: the batcher admits it
into its free row at the end of that iteration. Rank 0 prints one JSON line a round and then the
medians (milliseconds): the short request's time to first token and the long request's time to its
last token, each way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy

from hpc_tp.comm.mpi import world
from hpc_tp.models import GPTModel
from hpc_tp.models.config import load_config
from hpc_tp.serve import generate
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.train.tokenizer import ByteTokenizer


class Request:
    def __init__(self, ids, new_tokens: int, seed: int):
        self.ids, self.params = ids, SamplingParams(max_new_tokens=new_tokens, seed=seed)
        self.arrived, self.cancelled, self.done = None, False, None
        self.tokens = 0

    def text(self, piece):
        pass

    def finish(self, completion, metrics, queued_s):
        self.done = completion, queued_s, time.perf_counter()


PICK = generate.next_token


class Arrival:
    """Counts the long request's tokens as they are chosen; the short one arrives after the ``after``-th."""

    def __init__(self, long: Request, short: Request, after: int):
        self.long, self.short, self.after = long, short, after

    def __call__(self, logits, params, rng):
        token = PICK(logits, params, rng)
        if params.seed == self.long.params.seed:
            self.long.tokens += 1
            if self.long.tokens == self.after:
                self.short.arrived = time.perf_counter()
        return token


class Source:
    def __init__(self, long: Request, short: Request):
        self.pending = [long, short]

    def take(self, limit, idle):
        ready = [r for r in self.pending[:limit] if r.arrived is not None]
        self.pending = [r for r in self.pending if r not in ready]
        return None if idle and not self.pending and not ready else ready


def pair(args, round_: int):
    rng = numpy.random.default_rng(round_)
    long = Request([int(i) for i in rng.integers(0, 256, 16)], args.long, 2 * round_)
    short = Request([int(i) for i in rng.integers(0, 256, 16)], args.short, 2 * round_ + 1)
    long.arrived = time.perf_counter()
    generate.next_token = Arrival(long, short, args.after)
    return long, short


def static(engine, args, round_: int):
    long, short = pair(args, round_)
    rank0 = engine.comm.rank == 0
    out = engine.generate([long.ids] if rank0 else None, [long.params] if rank0 else None)
    long_end = time.perf_counter()
    start = time.perf_counter()
    out_short = engine.generate([short.ids] if rank0 else None, [short.params] if rank0 else None)
    if not rank0:
        return None
    assert len(out[0][0].ids) == args.long and len(out_short[0][0].ids) == args.short
    return start - short.arrived + out_short[0][0].ttft_s, long_end - long.arrived


def continuous(engine, args, round_: int):
    batcher = ContinuousBatcher(engine, 2)  # its cache allocated before the clock starts
    long, short = pair(args, round_)
    rank0 = engine.comm.rank == 0
    batcher.run(Source(long, short) if rank0 else None)
    if not rank0:
        return None
    (done_short, queued, _), (done_long, _, long_end) = short.done, long.done
    assert len(done_long.ids) == args.long and len(done_short.ids) == args.short
    return queued + done_short.ttft_s, long_end - long.arrived


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--long", type=int, default=48, help="the long request's new tokens")
    parser.add_argument("--short", type=int, default=8, help="the short request's new tokens")
    parser.add_argument("--after", type=int, default=4, help="the short one arrives after this many long tokens")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    comm = world()
    cfg = load_config(args.model, vocab_size=ByteTokenizer().vocab_size)
    engine = Engine(GPTModel(cfg, comm, dtype="float32", seed=0), ByteTokenizer())
    rows = {"static": [], "continuous": []}
    for round_ in range(args.rounds + 1):  # round 0 warms both paths up and is not counted
        for name, run in (("static", static), ("continuous", continuous)):
            comm.barrier()
            result = run(engine, args, round_)
            if comm.rank == 0 and round_ > 0:
                rows[name].append(result)
        if comm.rank == 0 and round_ > 0:
            print(json.dumps({"round": round_, **{f"{name}_{what}_ms": round(1e3 * r[-1][i], 2)
                                                  for name, r in rows.items()
                                                  for i, what in enumerate(("short_ttft", "long_total"))}}),
                  flush=True)
    if comm.rank == 0:
        print(json.dumps({"tp": comm.size, **vars(args), "median": {
            f"{name}_{what}_ms": round(1e3 * statistics.median(r[i] for r in results), 2)
            for name, results in rows.items() for i, what in enumerate(("short_ttft", "long_total"))}}), flush=True)


if __name__ == "__main__":
    main()
