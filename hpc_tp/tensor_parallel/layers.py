"""Column- and row-parallel linear layers (weights stored [in, out] so ``y = x @ W`` needs no transpose).

ColumnParallelLinear: W split by output columns. Input enters through f (identity forward,
all-reduce of the input gradient backward); ``gather_output`` all-gathers the result.
RowParallelLinear: W split by input rows. Each rank computes a partial product; g (one
all-reduce) sums them and the bias is added once, after the reduction. ``input_is_parallel``
says the input already arrives split (the usual case: the output of a column-parallel layer).

A column-parallel layer may carry several output segments in one fused weight (Q, K, V or
gate, up): one GEMM, while each segment stays its own Parameter (a view into the buffer)
with its own Partition, so checkpoints and importers see plain logical tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..comm.base import Communicator
from ..errors import ConfigError
from ..module import Module, Parameter, grad_buffer, param_buffer, replicated, split
from ..kernels import blas
from .mappings import local_chunk


@dataclass(frozen=True)
class Segment:
    """One logical output block of a column-parallel weight.

    ``parts`` pieces of ``full // parts`` columns; this rank holds piece ``index``, shared with
    ``replicas`` tp ranks (grouped-query K/V heads when tp > kv heads). ``replica_comm`` groups
    the ranks holding the same piece: their gradients are summed across it.
    """

    name: str
    full: int
    parts: int
    index: int
    replicas: int = 1
    replica_comm: Communicator | None = None


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def product(a, b, keep_sums: bool = False):
    """``a @ b`` (``a`` [..., k], ``b`` [k, n]) in ``a``'s dtype, through ``kernels.blas``: a product of
    half-precision operands comes back as float32 sums, and activations keep the model's dtype
    (pipeline messages and buffers are allocated for it). ``keep_sums``: return those float32 sums
    as they are (partial products that are summed over tp before they are rounded)."""
    y = blas.matmul(_flat(a), b).reshape(a.shape[:-1] + (b.shape[1],))
    return y if y.dtype == a.dtype or keep_sums else y.astype(a.dtype)


def add_weight_grad(grad, x2, dy2):
    """``grad += x2.T @ dy2`` summed into the buffer (beta = 1), without a temporary product."""
    blas.matmul(x2.T, dy2, out=grad, accumulate=True)


class ColumnParallelLinear(Module):
    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 gather_output: bool = False, segments: list[Segment] | None = None, dtype="float64"):
        if segments is None:
            if out_features % comm.size:
                raise ConfigError(f"output size {out_features} is not divisible by tensor-parallel size {comm.size}")
            segments = [Segment("", out_features, comm.size, comm.rank)]
        if gather_output and (len(segments) > 1 or segments[0].parts != comm.size):
            raise ValueError("gather_output needs a single segment split over the whole tp group")
        self.comm, self.gather_output, self.segments = comm, gather_output, segments
        widths = [s.full // s.parts for s in segments]
        self.out_local = sum(widths)
        self._weight = param_buffer((in_features, self.out_local), dtype)
        self._weight_grad = grad_buffer(self._weight)
        self._bias = param_buffer(self.out_local, dtype) if bias else None
        self._bias_grad = grad_buffer(self._bias) if bias else None
        self.params: list[tuple[str, Parameter]] = []
        self.columns: list[slice] = []
        start = 0
        for seg, width in zip(segments, widths):
            cols = slice(start, start + width)
            start += width
            self.columns.append(cols)
            prefix = f"{seg.name}." if seg.name else ""
            self.params.append((prefix + "weight", Parameter(
                self._weight[:, cols], split((in_features, seg.full), 1, seg.parts, seg.index, seg.replicas),
                grad=self._weight_grad[:, cols])))
            if bias:
                self.params.append((prefix + "bias", Parameter(
                    self._bias[cols], split((seg.full,), 0, seg.parts, seg.index, seg.replicas),
                    grad=self._bias_grad[cols], decay=False)))

    def named_parameters(self, prefix: str = ""):
        for name, p in self.params:
            yield prefix + name, p

    def forward(self, x):
        y = product(x, self._weight)
        if self._bias is not None:
            y += self._bias
        if self.gather_output:
            y = self.comm.all_gather(y, axis=y.ndim - 1)
        return y, x

    def backward(self, dy, x):
        if self.gather_output:
            dy = local_chunk(dy, self.comm)
        dy2, x2 = _flat(dy), _flat(x)
        dx = product(dy2, self._weight.T)
        # f's backward all-reduce of the input gradient runs while the weight gradient is computed.
        pending = self.comm.iall_reduce(dx) if self.comm.size > 1 else None
        self._add_param_grads(x2, dy2)
        if pending is not None:
            dx = pending.wait()
        return dx.reshape(x.shape)

    def _add_param_grads(self, x2, dy2):
        """This micro-batch's weight and bias gradients, added into the buffers. A K/V segment
        held by several replicas (tp > kv heads) saw only its own query heads' share: its
        increment alone is summed over the replicas, then what earlier micro-batches left is
        added back (summing the accumulated gradient would count each earlier micro-batch again)."""
        replicated = [(seg.replica_comm, cols) for seg, cols in zip(self.segments, self.columns)
                      if seg.replica_comm is not None and seg.replica_comm.size > 1]
        buffers = [b for b in (self._weight_grad, self._bias_grad) if b is not None]
        earlier = [[b[..., cols].copy() for b in buffers] for _, cols in replicated]
        for _, cols in replicated:
            for b in buffers:
                b[..., cols] = 0
        add_weight_grad(self._weight_grad, x2, dy2)
        if self._bias_grad is not None:
            self._bias_grad += dy2.sum(axis=0, dtype=self._bias_grad.dtype)
        for (comm, cols), kept in zip(replicated, earlier):
            for b, before in zip(buffers, kept):
                b[..., cols] = comm.all_reduce(b[..., cols].copy()) + before


class RowParallelLinear(Module):
    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = True,
                 input_is_parallel: bool = True, dtype="float64"):
        if in_features % comm.size:
            raise ConfigError(f"input size {in_features} is not divisible by tensor-parallel size {comm.size}")
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.weight = Parameter(param_buffer((in_features // comm.size, out_features), dtype),
                                split((in_features, out_features), 0, comm.size, comm.rank))
        self.bias = (Parameter(param_buffer(out_features, dtype), replicated((out_features,), comm.size), decay=False)
                     if bias else None)

    def forward(self, x):
        if not self.input_is_parallel:
            x = local_chunk(x, self.comm)
        # g: sum the partial products; half ones in float32 and rounded once, as one process rounds them
        y = product(x, self.weight.data, keep_sums=self.comm.size > 1)
        self.comm.all_reduce(y)
        y = y.astype(x.dtype, copy=False)
        if self.bias is not None:
            y += self.bias.data
        return y, x

    def backward(self, dy, x):
        dy2, x2 = _flat(dy), _flat(x)
        if self.bias is not None:
            self.bias.grad += dy2.sum(axis=0, dtype=self.bias.grad.dtype)
        dx = product(dy2, self.weight.data.T).reshape(x.shape)
        add_weight_grad(self.weight.grad, x2, dy2)
        if not self.input_is_parallel:
            dx = self.comm.all_gather(dx, axis=dx.ndim - 1)
        return dx
