"""Learning rate schedule: linear warmup to ``base_lr``, then cosine decay to ``min_lr_ratio * base_lr``.

``step`` is the 0-based index of the optimizer step about to be taken. Warmup ends at step
``warmup_steps - 1`` with the full rate (no step is wasted at lr 0), and the last step of the
run, ``total_steps - 1``, takes the minimum rate; later steps stay there.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from ..errors import ConfigError


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    _check(step, base_lr, warmup_steps, total_steps, min_lr_ratio)
    taken = step + 1
    if taken <= warmup_steps:
        return base_lr * taken / warmup_steps
    min_lr = base_lr * min_lr_ratio
    progress = min(1.0, (taken - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def _check(step, base_lr, warmup_steps, total_steps, min_lr_ratio):
    for name, value in (("step", step), ("warmup steps", warmup_steps), ("total steps", total_steps)):
        if not isinstance(value, Integral) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} {value!r} must be an integer >= 0")
    if total_steps < 1:
        raise ConfigError(f"total steps {total_steps} must be at least 1")
    if warmup_steps > total_steps:
        raise ConfigError(f"warmup steps {warmup_steps} must not exceed total steps {total_steps}")
    if not isinstance(base_lr, Real) or not base_lr > 0:
        raise ConfigError(f"learning rate {base_lr!r} must be a number > 0")
    if not isinstance(min_lr_ratio, Real) or not 0 <= min_lr_ratio <= 1:
        raise ConfigError(f"min lr ratio {min_lr_ratio!r} must be a number in [0, 1]")
