"""Dropout whose masks come from ``DropoutRNG`` keyed by site, so they do not depend on tp."""
from __future__ import annotations

from .. import backend
from ..tensor_parallel.random import DropoutRNG


def keep_mask(generator, shape, p: float, dtype):
    """Scaled keep mask: 1/(1-p) where kept, 0 where dropped. Drawn on the host (the generator is
    keyed by site, the same on any device), then put where the activations are."""
    return backend.xp.asarray((generator.random(shape) >= p).astype(dtype) / (1.0 - p))


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
        mask = keep_mask(self.rng.generator(*self.site), x.shape, self.p, x.dtype)
        return x * mask, mask

    def backward(self, dy, mask):
        return dy if mask is None else dy * mask
