"""Dropout randomness that does not depend on the layout.

A mask is drawn from a generator keyed by *what* it covers (layer, site, global head index)
and *when* (step, micro-batch, data-parallel rank), never by the tp rank. So ranks that hold
replicated activations draw identical masks, ranks that hold different heads draw different
ones, and tp=N drops exactly the elements tp=1 drops.
"""
from __future__ import annotations

import zlib

import numpy


class DropoutRNG:
    def __init__(self, seed: int):
        self.seed = seed
        self.when = (0, 0, 0)
        self.training = True  # evaluation and serving turn dropout off

    def set_position(self, step: int, micro_batch: int, dp_rank: int):
        self.when = (step, micro_batch, dp_rank)

    def generator(self, *what) -> numpy.random.Generator:
        keys = [self.seed, *self.when] + [k if isinstance(k, int) else zlib.crc32(str(k).encode()) for k in what]
        return numpy.random.Generator(numpy.random.Philox(numpy.random.SeedSequence(keys)))
