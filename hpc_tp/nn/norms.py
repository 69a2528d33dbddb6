"""LayerNorm and RMSNorm over the hidden axis. Their inputs are replicated across the tp group,
so their gains are replicated too and their gradients come out identical on every tp rank."""

from __future__ import annotations

from ..kernels import functional as F
from ..module import Module, Parameter, param_buffer, replicated


class LayerNorm(Module):
    def __init__(self, hidden: int, replicas: int, eps: float = 1e-5, bias: bool = True, dtype="float64"):
        self.eps = eps
        self.weight = Parameter(param_buffer(hidden, dtype, 1.0), replicated((hidden,), replicas), decay=False)
        self.bias = (
            Parameter(param_buffer(hidden, dtype), replicated((hidden,), replicas), decay=False) if bias else None
        )

    def forward(self, x):
        return F.layernorm_forward(x, self.weight.data, None if self.bias is None else self.bias.data, self.eps)

    def add_forward(self, x, residual):
        """``x += residual`` (x: the caller's own array) and the norm of the sum: (sum, y, saved)."""
        bias = None if self.bias is None else self.bias.data
        return F.add_norm_forward(x, residual, self.weight.data, bias, self.eps, center=True)

    def backward(self, dy, saved):
        dx, dgain, dbias = F.layernorm_backward(dy, self.weight.data, saved)
        if self.weight.trainable:  # frozen (LoRA): the gains' sums are dropped
            self.weight.grad += dgain
        if self.bias is not None and self.bias.trainable:
            self.bias.grad += dbias
        return dx


class RMSNorm(Module):
    def __init__(self, hidden: int, replicas: int, eps: float = 1e-6, dtype="float64"):
        self.eps = eps
        self.weight = Parameter(param_buffer(hidden, dtype, 1.0), replicated((hidden,), replicas), decay=False)

    def forward(self, x):
        return F.rmsnorm_forward(x, self.weight.data, self.eps)

    def add_forward(self, x, residual):
        """``x += residual`` (x: the caller's own array) and the norm of the sum: (sum, y, saved)."""
        return F.add_norm_forward(x, residual, self.weight.data, None, self.eps, center=False)

    def backward(self, dy, saved):
        dx, dgain = F.rmsnorm_backward(dy, self.weight.data, saved)
        if self.weight.trainable:  # frozen (LoRA): the gain's sum is dropped
            self.weight.grad += dgain
        return dx


def make_norm(kind: str, hidden: int, replicas: int, eps: float, bias: bool, dtype):
    if kind == "layernorm":
        return LayerNorm(hidden, replicas, eps, bias, dtype)
    return RMSNorm(hidden, replicas, eps, dtype)
