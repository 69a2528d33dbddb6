"""What a sliding window saves in training attention: one attention layer's forward and backward
(float32, one process) at sequence length ``--seq`` with each ``--windows`` entry (0: full causal
attention), alternating in rounds so the machine's drift hits every variant alike.

    python benchmarks/sliding_window.py [--seq 2048] [--windows 0,512,128] [--rounds 7]

The fused CPU core reads, per block of 64 queries, only the keys from its first query's window on
(``nn.attention.query_blocks``), so the scores it makes fall from about T^2 / 2 to T x (W + 64);
the projections are the same for every window. Prints, per window, the median and range of the
rounds (milliseconds) and the softmax elements the layer keeps per head.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy

from hpc_tp.comm.mpi import self_comm
from hpc_tp.nn.attention import ParallelAttention, saved_score_elements


def step_ms(layer, x, dy) -> float:
    start = time.perf_counter()
    _, ctx = layer.forward(x)
    layer.backward(dy, ctx)
    return 1e3 * (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--windows", default="0,512,128")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    rng = numpy.random.default_rng(0)
    layers = {
        w: ParallelAttention(
            args.hidden, args.heads, args.heads, self_comm(), rope_theta=10000.0, window=w, dtype="float32"
        )
        for w in windows
    }
    for layer in layers.values():
        for _, p in layer.named_parameters():
            p.data[...] = rng.standard_normal(p.data.shape).astype("float32") * 0.05
    x = rng.standard_normal((1, args.seq, args.hidden)).astype("float32")
    dy = rng.standard_normal((1, args.seq, args.hidden)).astype("float32")
    times = {w: [] for w in windows}
    for layer in layers.values():  # compile and warm up
        step_ms(layer, x, dy)
    for r in range(args.rounds):
        for w in windows if r % 2 == 0 else reversed(windows):
            times[w].append(step_ms(layers[w], x, dy))
    for w in windows:
        t = times[w]
        kept = saved_score_elements(args.seq, args.seq, True, window=w)
        print(
            f"window {w or 'none':>5}: median {statistics.median(t):8.1f} ms  range {min(t):8.1f} .. {max(t):8.1f} ms"
            f"  softmax kept per head {kept}"
        )


if __name__ == "__main__":
    main()
