"""``hpc-tp bench decode``: time per generated token with the KV cache, split into compute and
communication, at tp = the world size.

A batch of random prompts is prefilled once, then ``--new-tokens`` decode steps run, each feeding
the greedy token of every row (the argmax of the gathered logits, the same on every rank). A step
is one ``GPTModel.infer`` call plus the argmax: per layer the two g all-reduces of a [batch, 1,
hidden] activation, then the all-gather of the logits. Communication is the Communicator's
``seconds`` counter over the step (time in or waiting on collectives), compute is the rest. Each
figure is the median over steps, of the slowest rank. Decoding moves every weight once per token
for very little arithmetic, so it is bound by memory bandwidth and, at small batch, by collective
latency: tp splits the first and adds the second.

Light imports at the top, so ``hpc-tp bench --help`` can import this module for its options.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median
from time import perf_counter

import numpy

from .. import backend
from ..errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--model", default="w1", help="preset name or JSON config (default %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences decoded together (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default %(default)s)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "bfloat16", "float16"),
        help="weights, activations and KV cache; the half types sum products in float32 (default %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="array backend: cuda puts each rank on its node-local GPU (default %(default)s)",
    )
    parser.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU at tp=1, replay each decode step as a captured CUDA graph (default on)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the record as JSON (rank 0)")


def benchmark_decode(
    comm,
    cfg,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    dtype: str = "float32",
    warmup: int = 3,
    seed: int = 0,
    graphs: bool = True,
    model=None,
) -> dict:
    """One record (the same on every rank) for ``cfg`` split over ``comm`` (tp = comm.size); ``graphs``:
    replay a captured CUDA graph per step where ``serve.decoding`` can (a GPU at tp = 1); ``model``: one
    of ``cfg`` in ``dtype`` built already (rounds of an A/B time the same models again)."""
    # loaded when the command runs, not by hpc-tp --help
    from ..backend import resolve_dtype
    from ..grid import warn_if_tp_spans_nodes
    from ..models.gpt import GPTModel
    from ..serve.decoding import decode_stepper
    from ..serve.kv_cache import KVCache

    xp = backend.xp
    warn_if_tp_spans_nodes(comm)
    if model is None:
        model = GPTModel(cfg, comm, dtype=resolve_dtype(dtype), seed=seed)
    total = prompt_len + warmup + new_tokens
    cache = KVCache.for_model(model, batch, total)
    key_mask = numpy.zeros((batch, total), dtype=bool)
    key_mask[:, :prompt_len] = True
    prompt_mask = xp.asarray(key_mask[:, :prompt_len])
    ids = xp.asarray(numpy.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, prompt_len)))
    positions = xp.broadcast_to(xp.arange(prompt_len), ids.shape)
    # An untimed prefill into a scratch cache first: the first call loads the kernels and maps memory
    # (W1, batch 1: ~500 ms against ~65 ms after), which is start-up, not prefill.
    model.infer(ids, positions, prompt_mask, KVCache.for_model(model, batch, prompt_len))
    backend.synchronize()  # a device's queue drained: each figure is work done, not work launched
    comm.barrier()
    start = perf_counter()
    logits = model.infer(ids, positions, prompt_mask, cache)
    backend.synchronize()
    prefill = perf_counter() - start
    stepper = decode_stepper(model, cache, key_mask, numpy.full(batch, prompt_len), graphs)
    steps, comms = [], []
    for _ in range(warmup + new_tokens):
        start, comm_start = perf_counter(), comm.seconds
        logits = stepper.step(logits.argmax(axis=-1))
        backend.synchronize()
        steps.append(perf_counter() - start)
        comms.append(comm.seconds - comm_start)
    stepper.close()
    # The first step of a graph is an eager one plus the capture: what a batch pays once for it.
    per_rank = comm.allgather_object((median(steps[warmup:]), median(comms[warmup:]), prefill, cache.nbytes, steps[0]))
    step_s, comm_s, prefill_s, kv_bytes, _ = max(per_rank, key=lambda r: r[0])
    return {
        "tp": comm.size,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "dtype": dtype,
        "prefill_s": max(r[2] for r in per_rank),
        "first_step_s": max(r[4] for r in per_rank),
        "token_s": step_s,
        "compute_s": step_s - comm_s,
        "comm_s": comm_s,
        "tokens_per_s": batch / step_s,
        "kv_cache_bytes_per_rank": [r[3] for r in per_rank],
        "cuda_graph": stepper.uses_graph,
        "weight_bytes_per_rank": model.local_bytes(),
    }


def format_record(r: dict) -> str:
    ms = 1e3
    return (
        f"tp={r['tp']} batch={r['batch']} prompt={r['prompt_len']} {r['dtype']}: "
        f"{r['token_s'] * ms:.2f} ms/token step (compute {r['compute_s'] * ms:.2f}, comm {r['comm_s'] * ms:.2f}), "
        f"{r['tokens_per_s']:.1f} tokens/s, prefill {r['prefill_s'] * ms:.1f} ms, "
        f"first decode step {r['first_step_s'] * ms:.1f} ms, "
        f"KV cache {r['kv_cache_bytes_per_rank'][0] / 2**20:.2f} MiB/rank, "
        f"weights {r['weight_bytes_per_rank'] / 2**20:.1f} MiB/rank" + (", CUDA graph" if r.get("cuda_graph") else "")
    )


def run(args) -> int:
    """``hpc-tp bench decode`` (tp = world size)."""
    # loaded when the command runs, not by hpc-tp --help
    from ..launch import check_launch

    for name in ("batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive whole number")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup}: expected 0 or more")
    check_launch()
    # loaded when the command runs, not by hpc-tp --help
    from ..comm import select_device
    from ..comm.mpi import world
    from ..comm.nccl import device_communicator
    from ..models.config import load_config
    from ..nn.attention import check_heads

    cfg = load_config(args.model)
    check_heads(cfg.n_heads, cfg.n_kv_heads, world().size)
    if cfg.position == "learned" and args.prompt_len + args.warmup + args.new_tokens > cfg.max_seq_len:
        raise ConfigError(
            f"--prompt-len {args.prompt_len} + --warmup {args.warmup} + --new-tokens {args.new_tokens} "
            f"exceeds the model's max_seq_len {cfg.max_seq_len}"
        )
    select_device(args.device, world())
    comm = device_communicator(world())  # on GPUs: NCCL between a node's cards, as serve's tp group
    record = benchmark_decode(
        comm, cfg, args.batch, args.prompt_len, args.new_tokens, args.dtype, args.warmup, graphs=args.cuda_graph
    )
    if comm.rank == 0:
        print("hpc-tp bench decode: " + format_record(record), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0
