"""The communication regions of tensor parallelism, each a forward and its adjoint.

    f  = CopyToTensorParallel     forward: identity           backward: all-reduce
    g  = ReduceFromTensorParallel forward: all-reduce         backward: identity
    ScatterToTensorParallel       forward: keep my last-dim slice   backward: all-gather it
    GatherFromTensorParallel      forward: all-gather last dim      backward: keep my slice
    ReduceScatterToSequenceParallel  forward: reduce-scatter along the sequence  backward: all-gather
    GatherFromSequenceParallel       forward: all-gather the sequence            backward: reduce-scatter

f sits before a column-parallel block and g after a row-parallel one; with sequence
parallelism f becomes an all-gather and g a reduce-scatter (same bytes, activations / tp).
``backward`` may overwrite its argument: the gradient flowing down is never reused above.
"""
from __future__ import annotations

from ..comm.base import Communicator


def local_chunk(x, comm: Communicator, axis: int = -1):
    n = x.shape[axis]
    if n % comm.size:
        raise ValueError(f"axis {axis} of length {n} is not divisible by tensor-parallel size {comm.size}")
    step = n // comm.size
    index = [slice(None)] * x.ndim
    index[axis] = slice(comm.rank * step, (comm.rank + 1) * step)
    return x[tuple(index)]


class Region:
    # What the input and output are across the group: "replicated" (one logical value held by every
    # rank) or "sharded" (every rank holds its own piece or partial sum). The adjoint tests use it.
    input_kind = output_kind = "replicated"

    def __init__(self, comm: Communicator, axis: int = -1):
        self.comm, self.axis = comm, axis

    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError


class CopyToTensorParallel(Region):
    output_kind = "sharded"

    def forward(self, x):
        return x

    def backward(self, dy):
        return self.comm.all_reduce(dy)


class ReduceFromTensorParallel(Region):
    input_kind = "sharded"

    def forward(self, x):
        return self.comm.all_reduce(x)

    def backward(self, dy):
        return dy


class ScatterToTensorParallel(Region):
    output_kind = "sharded"

    def forward(self, x):
        return local_chunk(x, self.comm, self.axis).copy()

    def backward(self, dy):
        return self.comm.all_gather(dy, axis=self.axis % dy.ndim)


class GatherFromTensorParallel(Region):
    input_kind = "sharded"

    def forward(self, x):
        return self.comm.all_gather(x, axis=self.axis % x.ndim)

    def backward(self, dy):
        return local_chunk(dy, self.comm, self.axis).copy()


class ReduceScatterToSequenceParallel(Region):
    input_kind = output_kind = "sharded"

    def forward(self, x):
        return self.comm.reduce_scatter(x, axis=self.axis % x.ndim)

    def backward(self, dy):
        return self.comm.all_gather(dy, axis=self.axis % dy.ndim)


class GatherFromSequenceParallel(Region):
    input_kind = output_kind = "sharded"

    def forward(self, x):
        return self.comm.all_gather(x, axis=self.axis % x.ndim)

    def backward(self, dy):
        return self.comm.reduce_scatter(dy, axis=self.axis % dy.ndim)


REGIONS = (CopyToTensorParallel, ReduceFromTensorParallel, ScatterToTensorParallel,
           GatherFromTensorParallel, ReduceScatterToSequenceParallel, GatherFromSequenceParallel)
