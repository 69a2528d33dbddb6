"""AdamW with states sharded like their parameters, and the exact global gradient norm.

Every state has the local shape of its parameter and the update is purely elementwise, so a
tensor-parallel layout computes, element for element, the very numbers of one process; padding
(zero value, zero gradient) stays exactly zero. The gradient norm is the one place the layout
shows: each rank sums squares of what it holds, divided by how many ranks hold the same piece.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy

from .. import backend
from ..errors import ConfigError
from ..module import Parameter, Partition
from ..nn.moe import is_expert_parameter
from . import cpu_optim


class StateTensor(NamedTuple):
    """An optimizer state as checkpoints see it: this rank's array and its parameter's partition."""

    data: object
    partition: Partition


class AdamScalars(NamedTuple):
    """The constants of one AdamW update of an array: Python floats (``AdamW.step``) or 0-d arrays of
    the array's dtype (``AdamW.device_step``)."""

    decay: object  # 1 - lr * weight decay
    beta1: object
    one_minus_beta1: object
    beta2: object
    one_minus_beta2: object
    root_correction2: object  # sqrt(1 - beta2 ** t)
    eps: object
    step_size: object  # lr / (1 - beta1 ** t)


def composed_adamw(data, g, m, v, k: AdamScalars, decays: bool):
    """AdamW's update of ``data`` and its moments in place from the gradient ``g`` (already scaled) in
    array operations, in ``cpu_optim.adamw``'s order, so the same bits."""
    xp = backend.xp_of(data)
    if decays:
        data *= k.decay
    m *= k.beta1
    m += k.one_minus_beta1 * g
    v *= k.beta2
    v += k.one_minus_beta2 * g * g
    update = xp.sqrt(v)
    update /= k.root_correction2
    update += k.eps
    xp.divide(m, update, out=update)
    update *= k.step_size
    data -= update


class AdamW:
    """Adam with decoupled weight decay (applied only where ``p.decay``), updating ``p.data`` in place."""

    def __init__(
        self,
        named_params: dict[str, Parameter],
        lr: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
    ):
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
        self.step_count = 0
        self._make_states()

    def _make_states(self):
        self.exp_avg, self.exp_avg_sq = zero_states(self.params), zero_states(self.params)

    def step(self, lr: float | None = None, grad_scale: float = 1.0):
        """One update with ``lr`` (default: the constructor's), e.g. from ``schedule.lr_at``, of the
        gradients times ``grad_scale`` (``clip_coefficient``, and 1/S for a loss scaled by S: both
        inside the update's one pass rather than passes of their own)."""
        self._advance(lr)
        for name, p in self.params.items():
            self._update(p.data, p.grad, self.exp_avg[name], self.exp_avg_sq[name], p.decay, grad_scale)

    def _advance(self, lr: float | None):
        """Start a step (``_update`` reads its constants); ``lr`` None: the constructor's."""
        lr = self.lr if lr is None else lr
        beta1, beta2 = self.betas
        self.step_count += 1
        self._constants = (lr, lr / (1 - beta1**self.step_count), math.sqrt(1 - beta2**self.step_count))

    def _update(self, data, g, m, v, decays: bool, grad_scale: float):
        """AdamW on one array (a parameter, or a piece of flat storage) and its states, in place."""
        lr, step_size, root_correction2 = self._constants
        beta1, beta2 = self.betas
        decay = 1 - lr * self.weight_decay if decays and self.weight_decay else 1.0
        if cpu_optim.fused(data, g, m, v):
            cpu_optim.adamw(data, g, m, v, grad_scale, decay, beta1, beta2, root_correction2, self.eps, step_size)
            return
        if grad_scale != 1.0:
            g = g * grad_scale
        scalars = AdamScalars(decay, beta1, 1 - beta1, beta2, 1 - beta2, root_correction2, self.eps, step_size)
        composed_adamw(data, g, m, v, scalars, decay != 1.0)

    def device_step(self, lr, grad_scale, finite, step_count):
        """``step`` with every value that varies a 0-d array on the parameters' device, read by no
        host code (the captured training step, ``train.captured_step``): ``step_count`` is the Adam
        step this update would be (the device's count of finite steps, plus one), and where ``finite``
        is False every weight and moment keeps its value, as a skipped step leaves them, without a
        host branch (PyTorch's capturable optimizers take ``found_inf`` so). Each scalar is cast to
        the array's dtype once, as a Python float is by ``step`` (NEP 50: a float64 0-d array would
        make float32 arithmetic float64). Composed array operations only: ``cpu_optim``'s kernels take
        host floats."""
        xp = backend.xp_of(finite)
        beta1, beta2 = self.betas
        step_size = xp.where(finite, lr / (1 - beta1**step_count), 0.0)  # 0: the update adds nothing
        root_correction2 = xp.sqrt(1 - beta2**step_count)
        decay = xp.where(finite, 1 - lr * self.weight_decay, 1.0)
        kept = (xp.where(finite, beta1, 1.0), xp.where(finite, 1 - beta1, 0.0))  # moments: m * 1 + 0
        kept += (xp.where(finite, beta2, 1.0), xp.where(finite, 1 - beta2, 0.0))
        by_dtype = {}
        for name, p in self.params.items():
            dtype = p.data.dtype
            if dtype not in by_dtype:
                cast = [a.astype(dtype) for a in (grad_scale, decay, *kept, root_correction2, step_size)]
                by_dtype[dtype] = cast[0], AdamScalars(cast[1], *cast[2:6], cast[6], dtype.type(self.eps), cast[7])
            scale, scalars = by_dtype[dtype]
            # A skipped step's gradient may hold inf or NaN, which times the masked constants would still
            # be NaN: zeros instead.
            g = xp.where(finite, p.grad * scale, 0)
            composed_adamw(p.data, g, self.exp_avg[name], self.exp_avg_sq[name], scalars, p.decay and self.weight_decay)

    def state_bytes(self) -> int:
        """What the optimizer holds beyond the parameters: the moments (and, sharded, master pieces)."""
        return sum(a.nbytes for states in (self.exp_avg, self.exp_avg_sq) for a in states.values())

    def grad_norm(self, grid, skip=frozenset(), scale: float = 1.0) -> float:
        """``global_grad_norm`` of the gradients times ``scale`` (1/S for a loss scaled by S)."""
        return global_grad_norm(self.params, grid, skip) * scale

    def masters(self, params: dict[str, Parameter]) -> dict[str, Parameter]:
        """The parameters as checkpoints hold them (``ShardedAdamW`` streams its pieces): ``params``."""
        return params

    def state_tensors(self) -> dict[str, StateTensor]:
        """``optim.exp_avg.<name>`` and ``optim.exp_avg_sq.<name>`` for checkpoints; loading writes
        into them in place. ``step_count`` travels in the checkpoint's metadata."""
        states = {}
        for kind, arrays in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for name, array in arrays.items():
                states[f"optim.{kind}.{name}"] = StateTensor(array, self.params[name].partition)
        return states


def zero_states(params: dict[str, Parameter]) -> dict:
    """A zeroed moment per parameter, in its shape and dtype."""
    return {name: backend.xp_of(p.data).zeros_like(p.data) for name, p in params.items()}


def global_grad_norm(named_params: dict[str, Parameter], grid, skip=frozenset()) -> float:
    """L2 norm of the whole model's gradient, the same on every rank of every layout.

    A piece held by ``replicas`` ranks of the tp group counts ``1/replicas`` on each, so it
    counts once; the sum is then all-reduced over tp and over pp. Not over dp: after the dp
    all-reduce every dp rank holds the same gradients, save MoE experts, which differ across the
    ep group: their squares are summed over it, the rest counted on its first rank only.
    ``skip``: names whose gradient this rank must not count because another pipeline stage
    counts it, e.g. the last stage's copy of embeddings tied to the first stage's.
    """
    return reduce_squares(*local_squares(named_params, skip), grid)


def local_squares(named_params: dict[str, Parameter], skip=frozenset()) -> tuple:
    """This rank's sums of squared gradients, each divided by its replicas: (dense, MoE experts)."""
    dense = experts = 0.0
    for name, p in named_params.items():
        if name in skip:
            continue
        square = sum_of_squares(p.grad) / p.partition.replicas
        if is_expert_parameter(name):
            experts = experts + square
        else:
            dense = dense + square
    return dense, experts


def sum_of_squares(g):
    """sum(g**2) in float64; on the gradient's device (a cupy scalar: the one transfer to the host
    is ``reduce_squares``'s)."""
    if cpu_optim.fused(g):
        return cpu_optim.sum_of_squares(g)
    g = g.astype("float64", copy=False)
    return (g * g).sum()


def weighted_sum_of_squares(g, replicas):
    """sum(g**2 / replicas) in float64 (``replicas``: one count per element)."""
    if cpu_optim.fused(g) and isinstance(replicas, type(g)):
        return cpu_optim.weighted_sum_of_squares(g, replicas)
    g = g.astype("float64", copy=False)
    return (g * g / replicas).sum()


def reduce_squares(dense, experts, grid) -> float:
    """The global norm from this rank's weighted sums of squares (dense, MoE experts): summed over tp
    and pp, the experts also over ep (where the dense sum is the same on every ep rank: counted once)."""
    buffer = _summed_over_grid(numpy.array([float(dense), float(experts)]), grid)
    return math.sqrt(buffer[0] + buffer[1])


def device_grad_norm(named_params: dict[str, Parameter], grid, skip=frozenset()):
    """``global_grad_norm`` as a 0-d array on the gradients' device, never read by the host (the
    captured step): the sums of squares stay on the device through the all-reduces."""
    dense, experts = local_squares(named_params, skip)
    xp = backend.xp_of(next(iter(named_params.values())).grad)
    buffer = xp.zeros(2, dtype="float64")
    buffer[0] += dense  # in place: no host-to-device copy of a host value, which a capture cannot hold
    buffer[1] += experts
    buffer = _summed_over_grid(buffer, grid)
    return xp.sqrt(buffer[0] + buffer[1])


def _summed_over_grid(buffer, grid):
    """[dense, experts] summed over tp and pp, the experts also over ep, in place."""
    grid.tp.all_reduce(buffer)
    grid.pp.all_reduce(buffer)
    if grid.ep_size > 1:
        buffer[0] *= grid.coords.ep == 0
        grid.ep.all_reduce(buffer)
    return buffer


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings gradients of global norm ``norm`` down to ``max_norm`` (<= 0: never),
    for ``AdamW.step(grad_scale=...)``; 1 when they are within it."""
    return max_norm / (norm + 1e-6) if 0 < max_norm < norm else 1.0


def agree_finite(grid, *values: float) -> bool:
    """True on every rank when every rank's ``values`` are finite. With the global gradient norm
    among them this is the step's fault check: the norm is inf or NaN exactly when some counted
    gradient is (a float64 sum of float32 squares cannot overflow; float64 gradients would need
    elements past 1e150)."""
    finite = all(math.isfinite(v) for v in values)
    return grid.world.all_reduce_scalar(1.0 if finite else 0.0, op="min") == 1.0
