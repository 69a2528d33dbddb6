"""Initialisation that does not depend on the layout: each logical tensor is drawn from a
generator keyed by (seed, parameter name) and every rank keeps its slice. tp=1 and tp=N start
from the very same weights (GPT-2 scheme: N(0, std), residual projections std/sqrt(2 L))."""

from __future__ import annotations

import math
import zlib

import numpy

from ..module import Module


def initial_value(name: str, shape, std: float, n_layers: int, seed: int):
    last = name.rsplit(".", 1)[-1]
    if last == "bias":
        return numpy.zeros(shape)
    if ("norm" in name) and last == "weight":
        return numpy.ones(shape)
    if last == "lora_b":  # zero: the adapted model starts as the base model
        return numpy.zeros(shape)
    if name.endswith(("attn.out.weight", "mlp.fc2.weight")):
        std = std / math.sqrt(2 * n_layers)
    rng = numpy.random.default_rng([seed, zlib.crc32(name.encode())])
    if last == "lora_a":  # Kaiming-uniform-like, as LoRA's reference code: U(-1/sqrt(in), 1/sqrt(in))
        bound = 1.0 / math.sqrt(shape[0])
        return rng.uniform(-bound, bound, size=shape)
    return rng.normal(0.0, std, size=shape)


def initialize(model: Module, std: float, n_layers: int, seed: int):
    for name, p in model.named_parameters():
        p.load_full(initial_value(name, p.partition.full_shape, std, n_layers, seed))
