"""Dropout randomness that does not depend on the layout.

A mask is drawn sample by sample, from generators keyed by *what* it covers (layer, site, global
head index) and *when*: the step, and the sample's index in the step's global batch. Never by the
tp rank, the dp rank or the micro-batch. So ranks that hold replicated activations draw identical
masks, ranks that hold different heads draw different ones, and every layout and every split of
the batch into micro-batches drops exactly the elements one process drops.
"""

from __future__ import annotations

import zlib

import numpy


class DropoutRNG:
    def __init__(self, seed: int):
        self.seed = seed
        self.step, self.first_sample = 0, 0
        self.training = True  # evaluation and serving turn dropout off

    def set_position(self, step: int, first_sample: int):
        """The step, and the global batch index of the first sample about to run."""
        self.step, self.first_sample = step, first_sample

    def generators(self, samples: int, *what) -> list[numpy.random.Generator]:
        """One generator for each of ``samples`` consecutive samples from the position on."""
        site = [k if isinstance(k, int) else zlib.crc32(str(k).encode()) for k in what]
        return [
            numpy.random.Generator(
                numpy.random.Philox(numpy.random.SeedSequence([self.seed, self.step, self.first_sample + i, *site]))
            )
            for i in range(samples)
        ]
