"""AdamW with states sharded like their parameters, and the exact global gradient norm.

Every state has the local shape of its parameter and the update is purely elementwise, so a
tensor-parallel layout computes, element for element, the very numbers of one process; padding
(zero value, zero gradient) stays exactly zero. The gradient norm is the one place the layout
shows: each rank sums squares of what it holds, divided by how many ranks hold the same piece.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .. import backend
from ..errors import ConfigError
from ..module import Parameter, Partition
from . import cpu_optim


class StateTensor(NamedTuple):
    """An optimizer state as checkpoints see it: this rank's array and its parameter's partition."""

    data: object
    partition: Partition


class AdamW:
    """Adam with decoupled weight decay (applied only where ``p.decay``), updating ``p.data`` in place."""

    def __init__(self, named_params: dict[str, Parameter], lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        if not lr >= 0:
            raise ConfigError(f"AdamW learning rate {lr!r} must be >= 0")
        if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
            raise ConfigError(f"AdamW betas {betas!r} must be two numbers in [0, 1)")
        if not eps > 0:
            raise ConfigError(f"AdamW eps {eps!r} must be > 0")
        if not weight_decay >= 0:
            raise ConfigError(f"AdamW weight decay {weight_decay!r} must be >= 0")
        self.params = dict(named_params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.exp_avg = {name: backend.xp_of(p.data).zeros_like(p.data) for name, p in self.params.items()}
        self.exp_avg_sq = {name: backend.xp_of(p.data).zeros_like(p.data) for name, p in self.params.items()}
        self.step_count = 0

    def step(self, lr: float | None = None):
        """One update with ``lr`` (default: the constructor's), e.g. from ``schedule.lr_at``."""
        lr = self.lr if lr is None else lr
        beta1, beta2 = self.betas
        self.step_count += 1
        step_size = lr / (1 - beta1 ** self.step_count)
        root_correction2 = math.sqrt(1 - beta2 ** self.step_count)
        for name, p in self.params.items():
            xp, g, m, v = backend.xp_of(p.data), p.grad, self.exp_avg[name], self.exp_avg_sq[name]
            decay = 1 - lr * self.weight_decay if p.decay and self.weight_decay else 1.0
            if cpu_optim.fused(p.data, g, m, v):
                cpu_optim.adamw(p.data, g, m, v, decay, beta1, beta2, root_correction2, self.eps, step_size)
                continue
            if decay != 1.0:
                p.data *= decay
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            update = xp.sqrt(v)
            update /= root_correction2
            update += self.eps
            xp.divide(m, update, out=update)
            update *= step_size
            p.data -= update

    def state_tensors(self) -> dict[str, StateTensor]:
        """``optim.exp_avg.<name>`` and ``optim.exp_avg_sq.<name>`` for checkpoints; loading writes
        into them in place. ``step_count`` travels in the checkpoint's metadata."""
        states = {}
        for kind, arrays in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for name, array in arrays.items():
                states[f"optim.{kind}.{name}"] = StateTensor(array, self.params[name].partition)
        return states


def global_grad_norm(named_params: dict[str, Parameter], grid, skip=frozenset()) -> float:
    """L2 norm of the whole model's gradient, the same on every rank of every layout.

    A piece held by ``replicas`` ranks of the tp group counts ``1/replicas`` on each, so it
    counts once; the sum is then all-reduced over tp and over pp. Not over dp: after the dp
    all-reduce every dp rank holds the same gradients, save MoE experts, which differ across the
    ep group: their squares are summed over it, the rest counted on its first rank only.
    ``skip``: names whose gradient this rank must not count because another pipeline stage
    counts it, e.g. the last stage's copy of embeddings tied to the first stage's.
    """
    import numpy

    from ..nn.moe import is_expert_parameter

    dense = experts = 0.0
    for name, p in named_params.items():
        if name in skip:
            continue
        if cpu_optim.fused(p.grad):
            square = cpu_optim.sum_of_squares(p.grad) / p.partition.replicas
        else:
            g = p.grad.astype("float64", copy=False)
            # Summed on the gradient's device; the one transfer to the host happens below.
            square = (g * g).sum() / p.partition.replicas
        if is_expert_parameter(name):
            experts = experts + square
        else:
            dense = dense + square
    buffer = numpy.array([float(dense), float(experts)])
    grid.tp.all_reduce(buffer)
    grid.pp.all_reduce(buffer)
    if grid.ep_size > 1:
        buffer[0] *= grid.coords.ep == 0
        grid.ep.all_reduce(buffer)
    return math.sqrt(buffer[0] + buffer[1])


def clip_grads(named_params: dict[str, Parameter], max_norm: float, grid, skip=frozenset()) -> float:
    """Scale every gradient in place so the global norm is at most ``max_norm`` (<= 0: never).
    Returns the norm before clipping; ``skip`` as in ``global_grad_norm`` (skipped gradients are
    still scaled, so the copies of a tied parameter stay equal)."""
    norm = global_grad_norm(named_params, grid, skip)
    if 0 < max_norm < norm:
        scale = max_norm / (norm + 1e-6)
        for p in named_params.values():
            p.grad *= scale
    return norm


def grads_finite(named_params: dict[str, Parameter], grid) -> bool:
    """True when no gradient on any rank holds an inf or NaN; every rank gets the same answer."""
    finite = all(cpu_optim.all_finite(p.grad) if cpu_optim.fused(p.grad)
                 else bool(backend.xp_of(p.grad).isfinite(p.grad).all()) for p in named_params.values())
    return grid.world.all_reduce_scalar(1.0 if finite else 0.0, op="min") == 1.0
