"""Workload B of ``serve_peers.py`` through the continuous batcher (no HTTP) in bfloat16, a model read
as its checkpoint stores it against one packed for ``vdpbf16ps`` as loading for inference packs it
(``tensor_parallel.packing.pack_for_inference``), alternating rounds in one process on one rank.

    OMP_NUM_THREADS=1 python benchmarks/packed_bf16.py --ckpt CKPT [--rounds 3]

CKPT: a converted chat model (``hpc-tp convert``; ``serve_peers.py`` writes one next to its GGUF).
First the process's resident memory with the stored model, after loading the second, and after
packing that one (one copy kept: no more than before). Then per round and way: wall and the main
thread's CPU seconds (on a shared machine the CPU time is the kernels' cost, the wall time also the
waits for a core), split into decode-only passes and passes with a prefill; and how many completions
both ways gave the same tokens (the float32 sums' order differs, so near-ties of greedy sampling may
fall the other way). A fresh batcher each round: no prefix cached from the one before.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from serve_peers import prompts

from hpc_tp.backend import resolve_dtype
from hpc_tp.checkpoint import load_checkpoint
from hpc_tp.pipeline.partition import build_stage
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.loading import open_checkpoint
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tensor_parallel.packing import pack_for_inference
from hpc_tp.tokenizer import load_tokenizer_dir


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


class TimedBatcher(ContinuousBatcher):
    """The batcher, adding each pass's wall and CPU seconds to ``times`` by kind."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.times = {"decode": [0.0, 0.0, 0], "prefill": [0.0, 0.0, 0]}

    def _pass(self, stepping, rows, stops, start):
        wall, cpu = time.perf_counter(), time.thread_time()
        out = super()._pass(stepping, rows, stops, start)
        kept = self.times["prefill" if len(rows) else "decode"]
        kept[0] += time.perf_counter() - wall
        kept[1] += time.thread_time() - cpu
        kept[2] += 1
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    grid, folder, cfg = open_checkpoint(SimpleNamespace(ckpt=args.ckpt, tp=None, pp=1, device="cpu"))
    tokenizer = load_tokenizer_dir(folder)
    models = {}
    for name in ("stored", "packed"):
        models[name] = build_stage(cfg, grid, resolve_dtype("bfloat16"))
        load_checkpoint(folder, models[name].state(), grid)
    loaded = resident_mib()
    pack_for_inference(models["packed"])
    weights = models["stored"].local_bytes() / 2**20
    print(f"weights {weights:.1f} MiB a model; RSS {loaded:.0f} MiB with both, {resident_mib():.0f} once one is packed")
    ids = [tokenizer.encode(p) for p in prompts(2, 32, 50, 200)]
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True)] * len(ids)
    tokens = {}
    for round_ in range(args.rounds):
        for name in list(models)[:: 1 if round_ % 2 == 0 else -1]:
            batcher = TimedBatcher(Engine(models[name], tokenizer), 8, max_len=2048)
            batcher.generate(ids[:2], [SamplingParams(max_new_tokens=2)] * 2)  # kernels compiled, pool touched
            batcher.times = {kind: [0.0, 0.0, 0] for kind in batcher.times}
            wall, cpu = time.perf_counter(), time.thread_time()
            out = batcher.generate(ids, params)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            tokens.setdefault(name, [c.ids for c, _ in out])
            parts = ", ".join(
                f"{kind} {n} passes {w / n * 1e3:.1f} ms ({c / n * 1e3:.1f} CPU)"
                for kind, (w, c, n) in batcher.times.items()
                if n
            )
            print(f"round {round_} {name}: wall {wall:.1f} s, CPU {cpu:.1f} s; {parts}", flush=True)
    same = sum(a == b for a, b in zip(tokens["stored"], tokens["packed"]))
    print(f"same tokens: {same} of {len(ids)} completions")


if __name__ == "__main__":
    main()
