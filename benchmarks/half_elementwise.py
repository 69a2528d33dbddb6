"""A block's elementwise work on bfloat16 (or float16) activations, the fused numba kernels
(``kernels.cpu_kernels``) against the composed numpy code they replace, alternating in one run:
rmsnorm, the residual sum and the norm after it, SwiGLU's gate and up, and RoPE on the query heads,
at the 135M llama model's shapes (hidden 576, FFN 1536, 9 query heads of 64 beside 3 K/V heads), for a
decode step's rows and a prefill pass's.

    OMP_NUM_THREADS=1 python benchmarks/half_elementwise.py [--dtype bfloat16] [--rows 8,1024] [--rounds 5]

Each line: the op, the rows, and per way the median and range over the rounds of a call's CPU time
(the best of ``--repeats`` passes of ``--calls`` calls each; CPU time, so that a descheduled thread on a
shared machine is not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def cases(dtype, rows: int):
    """{op: a call} on random activations of ``rows`` tokens, as one layer of the model makes them."""
    from hpc_tp.kernels import functional as F

    rng = numpy.random.default_rng(0)

    def activations(*shape):
        return rng.standard_normal(shape).astype(dtype)

    x, residual, gain = activations(rows, HIDDEN), activations(rows, HIDDEN), activations(HIDDEN)
    h = activations(rows, 2 * FFN)
    qkv = activations(1, rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[..., : HEADS * HEAD_DIM].reshape(1, rows, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    cos, sin = F.rope_tables(numpy.arange(rows), 1.0 / 10000 ** (numpy.arange(0, HEAD_DIM, 2) / HEAD_DIM), dtype)
    return {
        "rmsnorm": lambda: F.rmsnorm_forward(x, gain, 1e-5),
        "residual + rmsnorm": lambda: F.add_norm_forward(x.copy(), residual, gain, None, 1e-5, False),
        "swiglu": lambda: F.gated_forward(h, FFN, F.silu_forward),
        "rope (queries)": lambda: F.rope_apply(q, cos, sin),
    }


def call_seconds(call, calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - start) / calls)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--rows", default="8,1024", help="comma-separated token counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=0, help="calls a pass (default: ~20 ms of work)")
    args = p.parse_args()
    from hpc_tp.backend import resolve_dtype
    from hpc_tp.kernels import cpu_kernels

    dtype = resolve_dtype(args.dtype)
    for rows in (int(r) for r in args.rows.split(",")):
        for op, call in cases(dtype, rows).items():
            call()  # compile (or load from numba's cache)
            calls = args.calls or max(1, 20_000 // rows)
            times = {"fused": [], "composed": []}
            for _ in range(args.rounds):
                for way in times:
                    cpu_kernels.ENABLED = way == "fused"
                    times[way].append(call_seconds(call, calls, args.repeats) * 1e3)
            cpu_kernels.ENABLED = True
            line = "  ".join(
                f"{way} {statistics.median(t):.4f} ms [{min(t):.4f}, {max(t):.4f}]" for way, t in times.items()
            )
            print(f"{op:20s} rows {rows:5d}  {line}", flush=True)


if __name__ == "__main__":
    main()
