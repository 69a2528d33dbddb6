"""Dropout whose masks come from ``DropoutRNG`` keyed by site and sample, so they depend on
neither tp nor how the batch is cut into micro-batches and over dp ranks."""

from __future__ import annotations

import numpy

from .. import backend
from ..tensor_parallel.random import DropoutRNG


def keep_mask(rng: DropoutRNG, what: tuple, shape, p: float, dtype):
    """Scaled keep mask of a [samples, ...] activation: 1/(1-p) where kept, 0 where dropped. Each
    sample's part is drawn from its own generator (keyed by ``what`` and the sample), on the host,
    then put where the activations are."""
    mask = numpy.empty(shape, dtype)
    for part, generator in zip(mask, rng.generators(shape[0], *what)):
        part[...] = generator.random(shape[1:]) >= p  # one sample's draws at a time: no [B, ...] float64 array
    mask /= 1.0 - p
    return backend.xp.asarray(mask)


class Dropout:
    """Dropout on a replicated activation: every tp rank draws the same mask (same key)."""

    def __init__(self, p: float, rng: DropoutRNG | None, site):
        self.p, self.rng, self.site = p, rng, site

    @property
    def active(self) -> bool:
        return self.p > 0 and self.rng is not None and self.rng.training

    def forward(self, x):
        if not self.active:
            return x, None
        mask = keep_mask(self.rng, self.site, x.shape, self.p, x.dtype)
        return x * mask, mask

    def backward(self, dy, mask):
        return dy if mask is None else dy * mask
