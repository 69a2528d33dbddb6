"""One request decoded alone through the continuous batcher in process (workload A's single stream, no
HTTP): the time of a fresh process's first request (two tokens: kernels loaded from numba's cache or
compiled), then ``--rounds`` rounds of one request of ``--new-tokens`` tokens, its tokens/s each (its
short prompt's prefill included).

    OMP_NUM_THREADS=1 python benchmarks/single_stream.py --ckpt CKPT [--new-tokens 600] [--rounds 2]

CKPT: a converted chat model (``hpc-tp convert``, e.g. the int4 checkpoint of SmolLM2-135M-Instruct's
Q4_1 GGUF). The tree measured is the one on ``PYTHONPATH``; for an A/B run this script alternately
with two trees (or with ``HPC_TP_ONE_ROW=0`` against the compiled one-row step), each in its own
process. Prints a digest of the tokens, so that two trees' runs can be seen to give the same ones.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from types import SimpleNamespace

from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.loading import load_for_inference
from hpc_tp.serve.sampling import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--new-tokens", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    _, model, tokenizer = load_for_inference(
        SimpleNamespace(ckpt=args.ckpt, tp=None, pp=1, dtype="float32", device="cpu")
    )
    batcher = ContinuousBatcher(Engine(model, tokenizer), 8, max_len=2048)
    ids = [tokenizer.encode(PROMPT)]
    start = time.perf_counter()
    batcher.generate(ids, [SamplingParams(max_new_tokens=2, ignore_eos=True)])
    print(f"first request (2 tokens) {time.perf_counter() - start:.2f} s", flush=True)
    for r in range(args.rounds):
        start = time.perf_counter()
        completion = batcher.generate(ids, [SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)])[0][0]
        wall = time.perf_counter() - start
        digest = hashlib.sha256(str(completion.ids).encode()).hexdigest()[:12]
        print(
            f"round {r}: {len(completion.ids)} tokens in {wall:.2f} s, {len(completion.ids) / wall:.1f} tokens/s, tokens {digest}",
            flush=True,
        )


if __name__ == "__main__":
    main()
