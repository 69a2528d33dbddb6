"""Choosing the next token from full-vocabulary logits: greedy, or sampled with temperature, top-k, top-p.

Sampling runs on tp rank 0 only and the engine broadcasts the chosen ids, so every rank feeds
the same token even where the ranks' logits could differ in the last bit (GPU reductions).
Each request has its own seeded generator: its tokens do not depend on what it was batched with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy

from ..errors import ConfigError

if TYPE_CHECKING:
    from .structured import Grammar


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0    # 0: greedy (argmax)
    top_k: int = 0              # 0: no limit
    top_p: float = 1.0          # 1: no nucleus cut
    seed: int | None = None     # None: a fresh generator seeded from the OS
    stop: list[str] = field(default_factory=list)
    grammar: Grammar | None = None  # structured output: each row's tokens held to it (serve.structured)

    def validate(self, names: dict[str, str] | None = None) -> "SamplingParams":
        """Raise ConfigError naming the first bad field (by its name in ``names``, e.g. an API's)."""
        checks = (("max_new_tokens", isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
                   and self.max_new_tokens >= 1, "an integer >= 1"),
                  ("temperature", _number(self.temperature) and self.temperature >= 0, "a number >= 0"),
                  ("top_k", isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
                   "an integer >= 0"),
                  ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
                  ("seed", self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                                 and self.seed >= 0), "an integer >= 0"),
                  ("stop", isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
                   "a non-empty string or a list of them"))
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"{(names or {}).get(name, name)}={getattr(self, name)!r}: expected {expected}")
        return self


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and numpy.isfinite(value)


def next_token(logits, params: SamplingParams, rng: numpy.random.Generator) -> int:
    """One token id from one row of logits [V] (a host float array)."""
    if params.temperature == 0:
        return int(numpy.argmax(logits))
    z = numpy.asarray(logits, dtype=numpy.float64)
    with numpy.errstate(over="ignore"):  # the largest is 0: a tiny temperature gives -inf, never inf - inf
        z = (z - z.max()) / params.temperature
    if 0 < params.top_k < z.size:
        kth = numpy.partition(z, -params.top_k)[-params.top_k]
        z = numpy.where(z >= kth, z, -numpy.inf)
    probs = numpy.exp(z - z.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = numpy.argsort(-probs, kind="stable")
        before = numpy.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above each one
        probs[order[before >= params.top_p]] = 0.0  # the most likely token always stays (before = 0)
        probs /= probs.sum()
    cdf = numpy.cumsum(probs)
    return int(min(numpy.searchsorted(cdf, rng.random() * cdf[-1], side="right"), z.size - 1))
