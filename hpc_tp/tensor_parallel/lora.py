"""LoRA (Hu et al., 2021): a frozen linear's weight W plus a trained low-rank update s A B, with A
[in, r], B [r, out] and s = alpha / r. B starts at zero, so the adapted model starts as the base one.

Each adapter is cut the way its layer's W is, so every product stays on the rank that has its operands:

    column-parallel W [in, out/tp]   A [in, r] replicated        B [r, out/tp] split like W's columns
    row-parallel    W [in/tp, out]   A [in/tp, r] split like W   B [r, out] replicated

Column: y_local += s (x A) B_local. The adapter's part of dx, s (dy_local B_local^T) A^T, is partial
over tp like the base dx and joins it before f's all-reduce; dA = s x^T (dy_local B_local^T) is partial
too and is summed over tp; dB_local = s (x A)^T dy_local is local (a K/V segment held by several ranks
sums it over them, as its weight's gradient).
Row: each rank adds s (x_local A_local) B to its partial product before g sums them, which is exact:
sum_s (x_s A_s) B = (x A) B. dA_local and dx_local are local; dB = s (x A)^T dy with x A = sum_s x_s A_s,
so each rank's s (x_s A_s)^T dy is partial and is summed over tp.

What crosses the wire, backward only: one all-reduce over tp per adapted layer and micro-batch, of
dA [in, r] (column) or dB [r, out] (row); the data-parallel buckets carry the adapters' gradients only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.base import Communicator
from ..kernels import blas
from ..module import Parameter, frozen, grad_buffer, param_buffer, replicated, split
from .mappings import CopyToTensorParallel


@dataclass(frozen=True)
class LoRA:
    """The adapters' shape: rank r and scale s = alpha / r."""

    rank: int
    scale: float


def _flat(x):
    return x.reshape(-1, x.shape[-1])


class ColumnAdapter:
    """A [in, r] replicated and B [r, out_local] fused over the layer's segments (``columns``), each
    segment's block of B a Parameter cut like that segment's weight (``partitions``, W's with r rows)."""

    def __init__(self, lora: LoRA, in_features: int, partitions, columns, comm: Communicator, dtype):
        self.scale, self._sum = lora.scale, CopyToTensorParallel(comm)
        out_local = sum(c.stop - c.start for c in columns)
        with frozen(False):
            self.a = Parameter(
                param_buffer((in_features, lora.rank), dtype), replicated((in_features, lora.rank), comm.size)
            )
            self.b_fused = param_buffer((lora.rank, out_local), dtype)
            self.b_grad = grad_buffer(self.b_fused)
        self.params = [("lora_a", self.a)]
        for (name, partition), cols in zip(partitions, columns):
            shape = (lora.rank, partition.full_shape[1])
            b = Parameter(
                self.b_fused[:, cols],
                split(shape, 1, partition.parts, partition.index, partition.replicas),
                grad=self.b_grad[:, cols],
            )
            self.params.append((name + "lora_b", b))

    def forward(self, x, y):
        """``y += s (x A) B`` in place (x: the layer's input after f)."""
        y += blas.matmul(_flat(x) @ self.a.data * self.scale, self.b_fused).reshape(y.shape).astype(y.dtype, copy=False)

    def input_grad(self, x2, dy2):
        """The adapter's part of dx (partial over tp, as the base dx); dA's increment summed over tp."""
        g = blas.matmul(dy2, self.b_fused.T) * self.scale  # [N, r]
        self.a.grad += self._sum.backward(blas.matmul(x2.T, g)).astype(self.a.grad.dtype, copy=False)
        return blas.matmul(g, self.a.data.T)

    def add_b_grad(self, x2, dy2):
        """dB_local += s (x A)^T dy_local (the caller sums a replicated segment's increment)."""
        blas.matmul((x2 @ self.a.data * self.scale).T, dy2, out=self.b_grad, accumulate=True)

    def fold(self, weight):
        """``weight`` (this rank's W [in, out_local]) += s A B_local: the adapted weight, for inference."""
        weight += (self.a.data @ self.b_fused * self.scale).astype(weight.dtype)


class RowAdapter:
    """A [in/tp, r] split like W's rows, B [r, out] replicated."""

    def __init__(self, lora: LoRA, in_features: int, out_features: int, comm: Communicator, dtype):
        self.scale, self._sum = lora.scale, CopyToTensorParallel(comm)
        with frozen(False):
            self.a = Parameter(
                param_buffer((in_features // comm.size, lora.rank), dtype),
                split((in_features, lora.rank), 0, comm.size, comm.rank),
            )
            self.b = Parameter(
                param_buffer((lora.rank, out_features), dtype), replicated((lora.rank, out_features), comm.size)
            )
        self.params = [("lora_a", self.a), ("lora_b", self.b)]

    def forward(self, x, partial):
        """``partial += s (x_local A_local) B`` in place, before g sums the ranks' partial products."""
        update = blas.matmul(_flat(x) @ self.a.data * self.scale, self.b.data)
        partial += update.reshape(partial.shape).astype(partial.dtype, copy=False)

    def input_grad(self, x2, dy2):
        """dA_local's and dB's increments (dB's summed over tp); the adapter's part of dx_local."""
        g = blas.matmul(dy2, self.b.data.T) * self.scale  # [N, r], dy whole on every rank
        blas.matmul(x2.T, g, out=self.a.grad, accumulate=True)
        increment = blas.matmul((x2 @ self.a.data * self.scale).T, dy2)
        self.b.grad += self._sum.backward(increment).astype(self.b.grad.dtype, copy=False)
        return blas.matmul(g, self.a.data.T)

    def fold(self, weight):
        """``weight`` (this rank's W [in/tp, out]) += s A_local B: the adapted weight, for inference."""
        weight += (self.a.data @ self.b.data * self.scale).astype(weight.dtype)
