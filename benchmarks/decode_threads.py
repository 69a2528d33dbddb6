"""Workload B of ``serve_peers.py`` through the continuous batcher (no HTTP) with each pass run at the
next of several thread counts in turn (``kernels.threads.use``), so every count sees the same mix of
passes and the same drift of a shared machine's load: the decode step's time and the prefill pass's
per thread count, in one process on one rank.

    python benchmarks/decode_threads.py --ckpt CKPT [--dtype bfloat16] [--threads 1,2] [--rounds 2]

CKPT: a converted chat model (``hpc-tp convert``; ``serve_peers.py`` writes one next to its GGUF).
Leave ``OMP_NUM_THREADS`` unset (or set it to the largest count): numba's pool holds no more threads
than it starts with. Prints, per thread count, the decode-only passes' and the prefill passes' minimum,
first quartile and median in ms; the ratio of each count's medians to the first count's. OpenMP's
spin after a region (``kernels/threads.py``) is read once a process: compare it across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

from serve_peers import prompts

from hpc_tp.kernels import threads
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.loading import load_for_inference
from hpc_tp.serve.sampling import SamplingParams


class TurnBatcher(ContinuousBatcher):
    """The batcher with each pass at the next thread count of ``counts``, its time kept by kind."""

    def __init__(self, engine, counts, times):
        super().__init__(engine, 8, max_len=2048)
        self.counts, self.times, self.turn = counts, times, 0

    def _pass(self, stepping, rows, stops, start):
        count = self.counts[self.turn % len(self.counts)]
        self.turn += 1
        threads.use(count)
        begin = time.perf_counter()
        out = super()._pass(stepping, rows, stops, start)
        self.times.setdefault((count, "prefill" if rows else "decode"), []).append(time.perf_counter() - begin)
        return out


def summary(values):
    ordered = sorted(values)
    return ordered[0], ordered[len(ordered) // 4], statistics.median(ordered)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated, taken in turn")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    counts = [int(c) for c in args.threads.split(",")]
    _, model, tokenizer = load_for_inference(
        SimpleNamespace(ckpt=args.ckpt, tp=None, pp=1, dtype=args.dtype, device="cpu")
    )
    engine = Engine(model, tokenizer)
    ids = [tokenizer.encode(p) for p in prompts(2, 32, 50, 200)]
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True)] * len(ids)
    times = {}
    for count in counts:  # every count's kernels compiled or loaded before any is timed
        threads.use(count)
        ContinuousBatcher(engine, 8, max_len=2048).generate(ids[:2], [SamplingParams(max_new_tokens=2)] * 2)
    for round_ in range(args.rounds):
        # each round starts at the next count, so no count always takes the first pass of a kind
        turned = counts[round_ % len(counts) :] + counts[: round_ % len(counts)]
        start = time.perf_counter()
        TurnBatcher(engine, turned, times).generate(ids, params)
        print(f"round {round_}: {time.perf_counter() - start:.1f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    for kind in ("decode", "prefill"):
        base = statistics.median(times[(counts[0], kind)])
        for count in counts:
            low, quarter, median = (1e3 * v for v in summary(times[(count, kind)]))
            print(
                f"{kind:8s} {count} threads: min {low:7.1f} q25 {quarter:7.1f} median {median:7.1f} ms "
                f"({len(times[(count, kind)])} passes, median {median / 1e3 / base:.2f}x {counts[0]} thread)"
            )


if __name__ == "__main__":
    main()
