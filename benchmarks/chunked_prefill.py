"""How a long prompt's prefill stalls a request that is decoding, with and without chunked prefill
(``ContinuousBatcher``'s ``chunk_tokens``, ``hpc-tp serve --prefill-chunk``), alternating in one run
at tp = world.

    mpiexec -n 2 python benchmarks/chunked_prefill.py [--model w1] [--prompt 1000] [--chunks 100000,512,128]

A request D (16 random tokens) decodes ``--decode`` tokens greedily; after its ``--after``-th, a
request L with a ``--prompt``-token prompt arrives and asks for 2. Prefilled whole, L's prompt takes
one iteration in which D's next token waits for all of it; in chunks of C tokens, D decodes one token
between chunks. Per chunk size, rank 0 prints D's gaps between tokens (median and longest) and L's
time to first token, each the median over rounds (milliseconds); rounds alternate the order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy
from queued_ttft import PICK, Request, Source

from hpc_tp.comm.mpi import world
from hpc_tp.models import GPTModel
from hpc_tp.models.config import load_config
from hpc_tp.serve import generate
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.tokenizer import ByteTokenizer


class Clock:
    """The times D's tokens are chosen; L arrives with D's ``after``-th."""

    def __init__(self, decoding: Request, arriving: Request, after: int):
        self.decoding, self.arriving, self.after, self.times = decoding, arriving, after, []

    def __call__(self, logits, params, rng):
        token = PICK(logits, params, rng)
        if params.seed == self.decoding.params.seed:
            self.times.append(time.perf_counter())
            if len(self.times) == self.after:
                self.arriving.arrived = time.perf_counter()
        return token


def one_run(engine, args, chunk: int, round_: int):
    batcher = ContinuousBatcher(engine, 2, max_len=args.prompt + 16, chunk_tokens=chunk)
    rng = numpy.random.default_rng(round_)
    decoding = Request([int(i) for i in rng.integers(0, 256, 16)], args.decode, 2 * round_)
    arriving = Request([int(i) for i in rng.integers(0, 256, args.prompt)], 2, 2 * round_ + 1)
    decoding.arrived = time.perf_counter()
    generate.next_token = clock = Clock(decoding, arriving, args.after)
    batcher.run(Source(decoding, arriving) if engine.comm.rank == 0 else None)
    if engine.comm.rank != 0:
        return None
    gaps = numpy.diff(clock.times)
    done, queued, _ = arriving.done
    return {
        "gap_p50_ms": 1e3 * float(numpy.median(gaps)),
        "gap_max_ms": 1e3 * float(gaps.max()),
        "long_ttft_ms": 1e3 * (queued + done.ttft_s),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="w1")
    parser.add_argument("--prompt", type=int, default=1000, help="the arriving request's prompt tokens")
    parser.add_argument("--decode", type=int, default=48, help="the decoding request's new tokens")
    parser.add_argument("--after", type=int, default=8, help="the long prompt arrives after this many decoded")
    parser.add_argument("--chunks", default="100000,512,128", help="chunk sizes to compare (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    comm = world()
    cfg = load_config(args.model, vocab_size=ByteTokenizer().vocab_size, max_seq_len=args.prompt + 16)
    engine = Engine(GPTModel(cfg, comm, dtype="float32", seed=0), ByteTokenizer())
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = {c: [] for c in chunks}
    for round_ in range(args.rounds + 1):  # round 0 warms every path up and is not counted
        for chunk in chunks if round_ % 2 == 0 else chunks[::-1]:
            comm.barrier()
            result = one_run(engine, args, chunk, round_)
            if comm.rank == 0 and round_ > 0:
                rows[chunk].append(result)
                print(json.dumps({"round": round_, "chunk": chunk, **result}), flush=True)
    if comm.rank == 0:
        for chunk, results in rows.items():
            medians = {key: round(statistics.median(r[key] for r in results), 1) for key in results[0]}
            print(json.dumps({"tp": comm.size, "chunk": chunk, "prompt": args.prompt, "median": medians}), flush=True)


if __name__ == "__main__":
    main()
