"""Time to first token of a short request that arrives while a long one decodes, static batching
(``Engine.generate``, what ``hpc-tp serve`` ran before continuous batching) against continuous
batching (``ContinuousBatcher``, what it runs now), alternating in one run at tp = world.

    mpiexec -n 2 python benchmarks/queued_ttft.py [--model tiny] [--long 48] [--short 8] [--after 4] [--rounds 7]

Both prompts are 16 random tokens, decoded greedily in float32. The short request "arrives" the
moment the long one's ``--after``-th token is chosen. Static: it waits for the long request's batch
to end, then runs as a batch of its own (its time to first token counts from its arrival to the
start of that batch, plus the batch's own time to first token). Continuous: the batcher admits it
into its free row at the end of that iteration. Each round also runs the long request alone both
ways, which separates what the continuous step costs from what sharing steps with the short request
costs. Rank 0 prints one JSON line a round and then the medians (milliseconds): the short request's
time to first token and the long request's time to its last token, each way, and the long one's alone.
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
from hpc_tp.tokenizer import ByteTokenizer


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
    def __init__(self, *requests: Request):
        self.pending = list(requests)

    def take(self, limit, idle):
        ready = [r for r in self.pending[:limit] if r.arrived is not None]
        self.pending = [r for r in self.pending if r not in ready]
        return None if idle and not self.pending and not ready else ready


def pair(args, round_: int, alone: bool):
    """The long request, arrived now, and the short one, which arrives later (never, ``alone``)."""
    rng = numpy.random.default_rng(round_)
    long = Request([int(i) for i in rng.integers(0, 256, 16)], args.long, 2 * round_)
    short = Request([int(i) for i in rng.integers(0, 256, 16)], args.short, 2 * round_ + 1)
    long.arrived = time.perf_counter()
    generate.next_token = Arrival(long, short, 0 if alone else args.after)
    return long, short


def static(engine, args, round_: int, alone: bool):
    long, short = pair(args, round_, alone)
    rank0 = engine.comm.rank == 0
    out = engine.generate([long.ids] if rank0 else None, [long.params] if rank0 else None)
    long_end = time.perf_counter()
    if alone:
        return (long_end - long.arrived,) if rank0 else None
    start = time.perf_counter()
    out_short = engine.generate([short.ids] if rank0 else None, [short.params] if rank0 else None)
    if not rank0:
        return None
    assert len(out[0][0].ids) == args.long and len(out_short[0][0].ids) == args.short
    return long_end - long.arrived, start - short.arrived + out_short[0][0].ttft_s


def continuous(engine, args, round_: int, alone: bool):
    batcher = ContinuousBatcher(engine, 2)  # its cache allocated before the clock starts
    long, short = pair(args, round_, alone)
    rank0 = engine.comm.rank == 0
    batcher.run((Source(long) if alone else Source(long, short)) if rank0 else None)
    if not rank0:
        return None
    done_long, _, long_end = long.done
    assert len(done_long.ids) == args.long
    if alone:
        return (long_end - long.arrived,)
    done_short, queued, _ = short.done
    assert len(done_short.ids) == args.short
    return long_end - long.arrived, queued + done_short.ttft_s


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
    runs = {
        f"{name}{'_alone' if alone else ''}": (run, alone)
        for alone in (False, True)
        for name, run in (("static", static), ("continuous", continuous))
    }
    rows = {key: [] for key in runs}
    for round_ in range(args.rounds + 1):  # round 0 warms every path up and is not counted
        for key, (run, alone) in runs.items():
            comm.barrier()
            result = run(engine, args, round_, alone)
            if comm.rank == 0 and round_ > 0:
                rows[key].append(result)
        if comm.rank == 0 and round_ > 0:
            print(json.dumps({"round": round_, **_named({key: r[-1] for key, r in rows.items()})}), flush=True)
    if comm.rank == 0:
        medians = {key: tuple(statistics.median(x[i] for x in r) for i in range(len(r[0]))) for key, r in rows.items()}
        print(json.dumps({"tp": comm.size, **vars(args), "median": _named(medians)}), flush=True)


def _named(results: dict) -> dict:
    """{"static_long_ms": ..., "static_short_ttft_ms": ..., ...} from {key: (long s, short ttft s)}."""
    return {
        f"{key}_{what}_ms": round(1e3 * value, 2)
        for key, values in results.items()
        for what, value in zip(("long", "short_ttft"), values)
    }


if __name__ == "__main__":
    main()
