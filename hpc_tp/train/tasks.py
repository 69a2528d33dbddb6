"""The embedded demo task: multi-digit addition, generated from a seed and checkable exactly.

A problem is the line ``"37+58=95\\n"``: the prompt ``"37+58="`` (operands without leading
zeros) and the answer ``"95"``. With ``reverse_answer=True`` the answer is written least
significant digit first (``"37+58=59"``): then each answer digit depends only on digits already
seen plus a carry, which small models learn much faster for many digits. The default keeps the
natural order, which two-digit addition does not need help with.

The train/held-out split is a property of the problem itself (a fixed hash of the pair and the
seed), so it never depends on how many examples are drawn: a held-out problem can never reach
training, whatever ``max_examples`` is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

IGNORE = -100  # target id the loss skips

MAX_DIGITS = 9  # keeps a problem's index a*10**d + b inside int64
_ENUMERATE_LIMIT = 1 << 22  # problem spaces up to this size (digits <= 3) are listed in full
_PROMPT = re.compile(r"(\d+)\+(\d+)=")


@dataclass(frozen=True)
class ArithmeticTask:
    digits: int = 2
    seed: int = 0
    heldout_fraction: float = 0.1
    max_examples: int = 100_000  # per split
    reverse_answer: bool = False

    def __post_init__(self):
        if not 1 <= self.digits <= MAX_DIGITS:
            raise ConfigError(f"digits={self.digits}: expected 1..{MAX_DIGITS}")
        if not 0.05 <= self.heldout_fraction <= 0.5:
            raise ConfigError(f"heldout_fraction={self.heldout_fraction}: expected 0.05..0.5")
        if not 1 <= self.max_examples <= 1_000_000:
            raise ConfigError(f"max_examples={self.max_examples}: expected 1..1000000")

    # ---- problems as strings ----

    def answer(self, a: int, b: int) -> str:
        total = str(a + b)
        return total[::-1] if self.reverse_answer else total

    def train_examples(self) -> list[tuple[str, str]]:
        return self._examples(heldout=False)

    def heldout_examples(self) -> list[tuple[str, str]]:
        return self._examples(heldout=True)

    def check(self, prompt: str, completion: str) -> bool:
        """True when the completion, up to its first newline (eos is dropped by decoding), is the exact answer."""
        match = _PROMPT.fullmatch(prompt)
        if match is None:
            raise ConfigError(f"{prompt!r} is not an addition prompt like '37+58='")
        return completion.split("\n", 1)[0].strip() == self.answer(int(match[1]), int(match[2]))

    # ---- problems as token rows ----

    def render(self, tokenizer, seq_len: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """One problem per row, padded: ``(ids, targets)`` int64 ``[n, seq_len]``.

        The row is prompt + answer + newline (+ eos when the tokenizer has one); targets are the
        next token on the answer, newline and eos, and IGNORE elsewhere, so the loss measures the
        answer only. Prompt and answer are encoded apart so a prompt tokenizes exactly as it will
        when the model is asked it.
        """
        examples = {"train": self.train_examples, "heldout": self.heldout_examples}[split]()
        # The widest problem rides along (row 0) so seq_len is checked against the whole space, not one split.
        largest = 10**self.digits - 1
        widest = (f"{largest}+{largest}=", self.answer(largest, largest))
        prompts = tokenizer.encode_batch([p for p, _ in [widest, *examples]])
        answers = tokenizer.encode_batch([a + "\n" for _, a in [widest, *examples]])
        end = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        needed = (
            max(len(p) + len(a) for p, a in zip(prompts, answers)) + len(end) - 1
        )  # the last token is only a target
        if seq_len < needed:
            raise ConfigError(
                f"seq_len={seq_len} is too short for {self.digits}-digit addition: "
                f"a problem like {widest[0]!r} needs seq_len >= {needed} with this tokenizer"
            )

        # Padding is never a target, so any id serves when the tokenizer has no pad token.
        filler = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)
        tokens = np.full((len(examples), seq_len + 1), filler, dtype=np.int64)
        targets = np.full((len(examples), seq_len), IGNORE, dtype=np.int64)
        for row, (prompt, answer) in enumerate(zip(prompts[1:], answers[1:])):
            line = prompt + answer + end
            tokens[row, : len(line)] = line
            # targets[t] predicts tokens[t + 1], and the answer starts at token len(prompt)
            targets[row, len(prompt) - 1 : len(line) - 1] = line[len(prompt) :]
        return tokens[:, :-1].copy(), targets

    # ---- the split ----

    def _examples(self, heldout: bool) -> list[tuple[str, str]]:
        base = 10**self.digits
        return [(f"{a}+{b}=", self.answer(a, b)) for a, b in (divmod(int(i), base) for i in self._indices(heldout))]

    def _is_heldout(self, index: np.ndarray) -> np.ndarray:
        threshold = np.uint64(int(self.heldout_fraction * 2.0**64))
        return _mix64(index.astype(np.uint64) ^ _mix64(np.array([self.seed], dtype=np.uint64))) < threshold

    def _indices(self, heldout: bool) -> np.ndarray:
        """Problem indices a*10**digits + b of one split, in a seeded random order."""
        space = 10 ** (2 * self.digits)
        rng = np.random.default_rng([self.seed, int(heldout)])
        if space <= _ENUMERATE_LIMIT:
            candidates = rng.permutation(space)
            return candidates[self._is_heldout(candidates) == heldout][: self.max_examples]
        # Too many to list: draw until enough distinct ones (a split holds >= 5x max_examples problems).
        found = np.empty(0, dtype=np.int64)
        while len(found) < self.max_examples:
            draw = rng.integers(0, space, size=2 * self.max_examples, dtype=np.int64)
            found = _unique_in_order(np.concatenate([found, draw[self._is_heldout(draw) == heldout]]))
        return found[: self.max_examples]


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed, well-spread hash, so the split never depends on numpy's RNG."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _unique_in_order(values: np.ndarray) -> np.ndarray:
    _, first = np.unique(values, return_index=True)
    return values[np.sort(first)]
