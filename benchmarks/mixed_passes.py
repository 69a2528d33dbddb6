"""Workload B of ``serve_peers.py`` through the continuous batcher (no HTTP), the decode step riding
along the first prefill pass of an iteration (``ContinuousBatcher._pass``, what serving runs) against
the two as separate passes, alternating rounds in one process on one rank.

    OMP_NUM_THREADS=1 python benchmarks/mixed_passes.py --ckpt CKPT [--dtype float32] [--rounds 2]

CKPT: a converted chat model (``hpc-tp convert``; ``serve_peers.py`` writes one next to its GGUF).
Prints each round's wall seconds and tokens/s per way, and whether both gave the same tokens.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy
from serve_peers import prompts

from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.loading import load_for_inference
from hpc_tp.serve.sampling import SamplingParams


class ApartBatcher(ContinuousBatcher):
    """The batcher with its decode step and prefill pass run one after the other."""

    def _pass(self, stepping, rows, stops, start):
        if not (len(stepping) and rows):
            return super()._pass(stepping, rows, stops, start)
        prefill = super()._pass(stepping[:0], rows, stops, start)
        return numpy.concatenate([prefill, super()._pass(stepping, [], [], 0)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    _, model, tokenizer = load_for_inference(
        SimpleNamespace(ckpt=args.ckpt, tp=None, pp=1, dtype=args.dtype, device="cpu")
    )
    engine = Engine(model, tokenizer)
    ids = [tokenizer.encode(p) for p in prompts(2, 32, 50, 200)]
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True)] * len(ids)
    ways = {"mixed": ContinuousBatcher, "apart": ApartBatcher}
    tokens = {}
    for round_ in range(args.rounds):
        for name in list(ways)[:: 1 if round_ % 2 == 0 else -1]:
            batcher = ways[name](engine, 8, max_len=2048)
            batcher.generate(ids[:2], [SamplingParams(max_new_tokens=2)] * 2)  # kernels compiled, pool touched
            start = time.perf_counter()
            out = batcher.generate(ids, params)
            wall = time.perf_counter() - start
            made = sum(len(c.ids) for c, _ in out)
            tokens.setdefault(name, [c.ids for c, _ in out])
            print(f"round {round_} {name}: {wall:.1f} s, {made / wall:.1f} tokens/s", flush=True)
    print("same tokens:", tokens["mixed"] == tokens["apart"])


if __name__ == "__main__":
    main()
