"""A decode step's glue between its kernels, the way it was against the way it is, alternating rounds in one
process: each piece's CPU time a call, the best of 5 x 20 calls (the loaded machine's swings only ever slow one),
at the shapes of one layer of SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads, FFN 1536, vocabulary
49152) and a decode step of ``--rows`` rows.

    OMP_NUM_THREADS=1 python benchmarks/decode_glue.py [--rows 8] [--dtype bfloat16] [--rounds 5]

Pieces, microseconds a step of 30 layers:
  casts      the products' float32 sums to the activations' dtype (QKV, attention out, gate|up, down):
             ``astype`` (a float32 model: none) against ``functional.cast``;
  rope       the rotary tables, both rotations and the query scale: tables made a layer, two rotations
             and ``q *= scale``, against tables made once a step and the scale inside the query's rotation;
  head cast  the LM head's float32 sums [rows, 49152] to the dtype;
  residual   the block's last residual sum ``m += x1``: numpy's against ``functional.add_into``;
  sampling   every row's greedy argmax over its logits: each row of the dtype's array, against the array
             widened to float32 once (``continuous._host_logits``).
Prints each round and the median [range] of the rounds.
"""

from __future__ import annotations

import argparse
import statistics

import numpy
from half_elementwise import call_seconds

from hpc_tp.backend import resolve_dtype
from hpc_tp.kernels import functional as F
from hpc_tp.nn.attention import rope_inv_freq
from hpc_tp.serve.continuous import _host_logits

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD, FFN, VOCAB = 30, 576, 9, 3, 64, 1536, 49152


def pieces(rows: int, dtype):
    """{piece: (old call, new call)} over arrays of one decode step."""
    rng = numpy.random.default_rng(0)
    sums = [rng.standard_normal((rows, n)).astype(numpy.float32) for n in (960, HIDDEN, 2 * FFN, HIDDEN)]
    qkv = rng.standard_normal((rows, 1, (HEADS + 2 * KV_HEADS) * HEAD)).astype(dtype)
    q = qkv[..., : HEADS * HEAD].reshape(rows, 1, KV_HEADS, HEADS // KV_HEADS, HEAD).transpose(0, 2, 3, 1, 4)
    k = qkv[..., HEADS * HEAD : (HEADS + KV_HEADS) * HEAD].reshape(rows, 1, KV_HEADS, HEAD).transpose(0, 2, 1, 3)
    positions, inv_freq, scale = rng.integers(50, 260, (rows, 1)), rope_inv_freq(HEAD, 10000.0), HEAD**-0.5

    def per_row(t, ndim):
        return tuple(a.reshape(a.shape[0], *(1,) * (ndim - 3), *a.shape[1:]) for a in t)

    def rope_old():
        for _ in range(LAYERS):
            made = F.rope_tables(positions, inv_freq, dtype)
            rotated = F.rope_apply(q, *per_row(made, q.ndim))
            F.rope_apply(k, *per_row(made, k.ndim))
            rotated *= scale

    def rope_new():
        made = F.rope_tables(positions, inv_freq, dtype)
        for _ in range(LAYERS):
            F.rope_apply(q, *per_row(made, q.ndim), scale=scale)
            F.rope_apply(k, *per_row(made, k.ndim))

    m, x1 = (rng.standard_normal((rows, 1, HIDDEN)).astype(dtype) for _ in range(2))
    head = rng.standard_normal((rows, VOCAB)).astype(numpy.float32)
    logits = head.astype(dtype)
    return {
        "casts": (
            lambda: [s.astype(dtype, copy=False) for _ in range(LAYERS) for s in sums],
            lambda: [F.cast(s, dtype) for _ in range(LAYERS) for s in sums],
        ),
        "rope": (rope_old, rope_new),
        "residual": (
            lambda: [m.__iadd__(x1) for _ in range(LAYERS)],
            lambda: [F.add_into(m, x1) for _ in range(LAYERS)],
        ),
        "head cast": (lambda: head.astype(dtype, copy=False), lambda: F.cast(head, dtype)),
        "sampling": (
            lambda: [int(numpy.argmax(row)) for row in logits],
            lambda: [int(numpy.argmax(row)) for row in _host_logits(logits)],
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    calls = pieces(args.rows, resolve_dtype(args.dtype))
    times = {name: ([], []) for name in calls}
    for r in range(args.rounds):
        for name, (old, new) in calls.items():
            ways = ((0, old), (1, new)) if r % 2 == 0 else ((1, new), (0, old))
            for way, call in ways:
                times[name][way].append(call_seconds(call, 20, 5) * 1e6)
        print(f"round {r}: " + ", ".join(f"{n} {times[n][0][-1]:.1f} -> {times[n][1][-1]:.1f}" for n in calls))
    for name, (old, new) in times.items():
        old_med, new_med = statistics.median(old), statistics.median(new)
        print(
            f"{name:10s} before {old_med:8.1f} [{min(old):.1f}, {max(old):.1f}] us"
            f"   after {new_med:8.1f} [{min(new):.1f}, {max(new):.1f}] us"
        )


if __name__ == "__main__":
    main()
