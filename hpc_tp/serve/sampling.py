"""Choosing the next token from full-vocabulary logits: greedy, or sampled with temperature, min-p,
top-k, top-p; penalties on tokens already seen; log-probabilities to report.

Sampling runs on tp rank 0 only and the engine broadcasts the chosen ids, so every rank feeds
the same token even where the ranks' logits could differ in the last bit (GPU reductions).
Each request has its own seeded generator: its tokens do not depend on what it was batched with.

A row's logits go through its logits processors first (``process_logits``), in a fixed order: the
repetition penalty, the frequency and presence penalties, then ``SamplingParams.processors`` (the
hook for constraints such as a grammar's token mask: each is ``f(logits, prompt_ids, output_ids) ->
logits`` on a float64 host array [V], and may set tokens to -inf). ``next_token`` then scales by the
temperature and cuts by min-p, top-k and top-p (vLLM's order). Reported log-probabilities
(``token_logprobs``) are the model's own, before any processor, as vLLM's default and OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy

from ..errors import ConfigError

if TYPE_CHECKING:
    from .structured import Grammar

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the alternatives reported per token


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None  # None: a fresh generator seeded from the OS
    stop: list[str] = field(default_factory=list)
    grammar: Grammar | None = None  # structured output: each row's tokens held to it (serve.structured)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0: off)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from every token the output holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the output holds a token
    repetition_penalty: float = 1.0  # CTRL's (Hugging Face, vLLM): a token of the prompt or output has
    #                                  its logit divided by it where positive, multiplied where negative
    ignore_eos: bool = False  # end-of-sequence does not end the row: only max tokens and stop strings do
    logprobs: int | None = None  # report each chosen token's log-probability and this many alternatives
    processors: list = field(default_factory=list)  # further logits processors, applied after the penalties

    def validate(self, names: dict[str, str] | None = None) -> SamplingParams:
        """Raise ConfigError naming the first bad field (by its name in ``names``, e.g. an API's)."""
        checks = (
            ("max_new_tokens", _integer(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", _number(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", _integer(self.top_k) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or (_integer(self.seed) and self.seed >= 0), "an integer >= 0"),
            (
                "stop",
                isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
                "a non-empty string or a list of them",
            ),
            ("min_p", _number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            (
                "presence_penalty",
                _number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "a number in [-2, 2]",
            ),
            (
                "frequency_penalty",
                _number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "a number in [-2, 2]",
            ),
            ("repetition_penalty", _number(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            (
                "logprobs",
                self.logprobs is None or (_integer(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                f"an integer in [0, {MAX_TOP_LOGPROBS}]",
            ),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"{(names or {}).get(name, name)}={getattr(self, name)!r}: expected {expected}")
        return self

    def transforms_logits(self) -> bool:
        """Whether ``process_logits`` changes anything: without, the model's logits are sampled as they are."""
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
            or bool(self.processors)
        )


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and numpy.isfinite(value)


def repetition_penalty(logits, penalty: float, seen):
    """CTRL's penalty (Keskar et al. 2019, as Hugging Face and vLLM apply it) on the tokens ``seen``."""
    seen = numpy.unique(numpy.asarray(seen, dtype=numpy.int64))
    picked = logits[seen]
    logits[seen] = numpy.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def frequency_presence_penalty(logits, frequency: float, presence: float, output_ids):
    """OpenAI's penalties: each token's count in the output times ``frequency``, plus ``presence`` if
    it is there at all, taken off its logit."""
    counts = numpy.bincount(numpy.asarray(output_ids, dtype=numpy.int64), minlength=logits.size)[: logits.size]
    return logits - frequency * counts - presence * (counts > 0)


def process_logits(logits, params: SamplingParams, prompt_ids, output_ids):
    """The row's logits [V] (float64, a copy) after its processors, in order: the repetition penalty
    (prompt and output), the frequency and presence penalties (output), then ``params.processors``."""
    z = numpy.array(logits, dtype=numpy.float64)
    if params.repetition_penalty != 1 and (len(prompt_ids) or len(output_ids)):
        z = repetition_penalty(z, params.repetition_penalty, list(prompt_ids) + list(output_ids))
    if (params.frequency_penalty or params.presence_penalty) and len(output_ids):
        z = frequency_presence_penalty(z, params.frequency_penalty, params.presence_penalty, output_ids)
    for processor in params.processors:
        z = processor(z, prompt_ids, output_ids)
    return z


def next_token(logits, params: SamplingParams, rng: numpy.random.Generator) -> int:
    """One token id from one row of logits [V] (a host float array)."""
    if params.temperature == 0:
        return int(numpy.argmax(logits))
    z = numpy.asarray(logits, dtype=numpy.float64)
    with numpy.errstate(over="ignore"):  # the largest is 0: a tiny temperature gives -inf, never inf - inf
        z = (z - z.max()) / params.temperature
    if params.min_p > 0:  # the most likely token has z = 0, probability ratio exp(z)
        z = numpy.where(z >= numpy.log(params.min_p), z, -numpy.inf)
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


def token_logprobs(logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the logits [V] and the ``top`` most likely tokens' (id,
    log-probability), most likely first (ties: the lower id first)."""
    z = numpy.asarray(logits, dtype=numpy.float64)
    peak = z.max()
    norm = peak + numpy.log(numpy.exp(z - peak).sum())  # log-sum-exp: z - norm is the log-softmax
    best, rest = [], z.copy()
    for _ in range(min(top, z.size)):  # top is at most 20: a few argmax passes beat a partition of the vocabulary
        best.append(int(rest.argmax()))  # the first of equals: the lower id
        rest[best[-1]] = -numpy.inf
    return float(z[token] - norm), [(i, float(z[i] - norm)) for i in best]
