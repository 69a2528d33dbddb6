"""Single-stream decode with the linear layers' weights in float32, bfloat16, int8 and int4, alternating in
one run: ``hpc-tp bench decode``'s measurement (median time of a KV-cached decode step after warm-up
steps) on one process, each variant's model built once and timed again in every round.

    OMP_NUM_THREADS=1 python benchmarks/quantized_decode.py --model CONFIG.json [--rounds 5]

``--model``: a preset or a JSON model config (the config of a converted checkpoint, e.g. SmolLM2-135M's
from ``hpc-tp inspect``); weights are random (the time of a product does not depend on the values).
Variants: NAME=QUANTIZE:DTYPE[:float], where QUANTIZE is none, int8 or int4 (the linear layers' weights)
and DTYPE the precision of everything else (the embedding, the activations; a quantized model's head is
int8 unless DTYPE is float64); ``:float`` runs that variant's few-row products by the float kernel, as
without VNNI (``kernels/int8_dot.py``), for an A/B in one run. Each line gives the tokens/s range over
the rounds and the median; no time is asserted anywhere. ``--half-scales``: the scales and minimums of a GGUF's
weights are float16 numbers, which the integer kernel streams at half width; random weights' are not
until rounded (the int8 head's copy keeps float32 ones here).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy

DEFAULT_VARIANTS = (
    "float32=none:float32",
    "bfloat16=none:bfloat16",
    "int8=int8:float32",
    "int4=int4:float32",
    "int4+bf16=int4:bfloat16",
)


def main():
    from hpc_tp.backend import resolve_dtype
    from hpc_tp.bench.decode import benchmark_decode
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.kernels import int8_dot
    from hpc_tp.models.config import load_config
    from hpc_tp.models.gpt import GPTModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny", help="preset or JSON config (default %(default)s)")
    parser.add_argument(
        "--variant", action="append", help=f"NAME=QUANTIZE:DTYPE[:float] (default {' '.join(DEFAULT_VARIANTS)})"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed a round (default %(default)s)")
    parser.add_argument(
        "--half-scales",
        action="store_true",
        help="linear layers' scales and minimums rounded to float16, as a GGUF's are (packed at half width)",
    )
    args = parser.parse_args()
    cfg = load_config(args.model)
    models = {}
    for spec in args.variant or DEFAULT_VARIANTS:
        name, _, rest = spec.partition("=")
        quantize, dtype, *products = rest.split(":")
        variant = dataclasses.replace(cfg, quantize=None if quantize == "none" else quantize)
        model = GPTModel(variant, self_comm(), dtype=resolve_dtype(dtype))
        if args.half_scales:
            round_scales_to_half(model)
        models[name] = (model, dtype, products != ["float"])
    rates = {name: [] for name in models}
    host_integer = int8_dot.AVAILABLE  # restored for every variant without ``:float``
    for _ in range(args.rounds):
        for name, (model, dtype, integer) in models.items():
            int8_dot.AVAILABLE = host_integer and integer
            record = benchmark_decode(
                self_comm(), model.cfg, 1, args.prompt_len, args.new_tokens, dtype, warmup=3, model=model
            )
            rates[name].append(record["tokens_per_s"])
    for name, (model, *_) in models.items():
        r = rates[name]
        print(
            f"{name}: {min(r):.1f}-{max(r):.1f} tokens/s (median {statistics.median(r):.1f}), "
            f"weights {model.local_bytes() / 2**20:.0f} MiB",
            flush=True,
        )


def round_scales_to_half(model):
    """Every linear layer's scales and minimums rounded to float16 in place (the Parameters view them)."""
    from hpc_tp.kernels.quantized import QuantizedMatrix

    for module in model.modules():
        for matrix in vars(module).values():
            if isinstance(matrix, QuantizedMatrix):
                for values in (matrix.scale, matrix.low):
                    if values is not None:
                        values[...] = values.astype(numpy.float16)


if __name__ == "__main__":
    main()
