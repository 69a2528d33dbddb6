"""The communication regions of tensor parallelism, each a forward and its adjoint. Every
collective a tensor-parallel layer makes is one of these, held by the layer and called by name.

    f  = CopyToTensorParallel          forward: identity                 backward: all-reduce
    g  = ReduceFromTensorParallel      forward: all-reduce               backward: identity
    ScatterToTensorParallel            forward: keep my slice of axis    backward: all-gather it
    GatherFromTensorParallel           forward: all-gather along axis    backward: keep my slice
    GatherFromSequenceParallel         forward: all-gather the sequence  backward: reduce-scatter
    ReduceScatterToSequenceParallel    forward: reduce-scatter           backward: all-gather
    Identity                           no communication either way
    MaxFromTensorParallel              forward: all-reduce max (forward only: see the class)

Who holds which:

    ColumnParallelLinear   f: Copy, or GatherFromSequence with sequence parallelism; its output
                           region: GatherFromTensorParallel with ``gather_output``, else Identity;
                           a Copy over the replica group for K/V segments held by several ranks
    RowParallelLinear      g: Reduce, or ReduceScatterToSequence with sequence parallelism; its
                           input region: ScatterToTensorParallel unless the input is already split
    vocab embedding        g           LM head: f         cross entropy: g and MaxFromTensorParallel
    MoE layer, GPT model   GatherFromTensorParallel / ScatterToTensorParallel along the sequence
                           (sequence parallelism: in and out of the replicated parts)

f sits before a column-parallel block and g after a row-parallel one; with sequence parallelism
f becomes an all-gather and g a reduce-scatter (same bytes, activations / tp). ``forward`` and
``backward`` may work in place: an all-reduce overwrites its argument (a gradient flowing down
is never reused above, a partial product never after its sum). At tp = 1 every region moves
nothing and the gathers and reduce-scatters hand their argument back uncopied.
"""

from __future__ import annotations

from ..comm.base import Communicator, Done, Request

SEQUENCE_AXIS = 1  # hidden states are [batch, sequence, hidden]


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

    def backward_async(self, dy) -> Request:
        """``backward`` started; ``wait()`` returns its result. The caller computes in between (the
        column-parallel layer its weight gradient). f posts its all-reduce to the transport (NCCL
        runs it on its stream meanwhile; MPI runs it inside ``wait``, ``comm/mpi.py`` says why);
        the other regions complete before they return."""
        return Done(self.backward(dy))

    def _gather(self, x):
        return self.comm.all_gather(x, axis=self.axis % x.ndim) if self.comm.size > 1 else x

    def _reduce_scatter(self, x):
        return self.comm.reduce_scatter(x, axis=self.axis % x.ndim) if self.comm.size > 1 else x

    def _slice(self, x):
        # A contiguous copy: a view would keep the whole array alive in a layer's saved context, and
        # the GEMMs that read the slice next would copy it to flatten it anyway.
        return local_chunk(x, self.comm, self.axis).copy()


class Identity(Region):
    """The region of a layer whose input or output needs no communication."""

    def __init__(self):
        super().__init__(None)

    def forward(self, x):
        return x

    def backward(self, dy):
        return dy


class CopyToTensorParallel(Region):
    output_kind = "sharded"

    def forward(self, x):
        return x

    def backward(self, dy):
        return self.comm.all_reduce(dy)

    def backward_async(self, dy) -> Request:
        return self.comm.iall_reduce(dy) if self.comm.size > 1 else Done(dy)


class ReduceFromTensorParallel(Region):
    input_kind = "sharded"

    def forward(self, x):
        return self.comm.all_reduce(x)

    def backward(self, dy):
        return dy


class ScatterToTensorParallel(Region):
    output_kind = "sharded"

    def forward(self, x):
        return self._slice(x)

    def backward(self, dy):
        return self._gather(dy)


class GatherFromTensorParallel(Region):
    input_kind = "sharded"

    def forward(self, x):
        return self._gather(x)

    def backward(self, dy):
        return self._slice(dy)


class ReduceScatterToSequenceParallel(Region):
    input_kind = output_kind = "sharded"

    def forward(self, x):
        return self._reduce_scatter(x)

    def backward(self, dy):
        return self._gather(dy)


class GatherFromSequenceParallel(Region):
    input_kind = output_kind = "sharded"

    def forward(self, x):
        return self._gather(x)

    def backward(self, dy):
        return self._reduce_scatter(dy)


class MaxFromTensorParallel:
    """The element-wise max of every rank's ``x``, in place. Forward only, so not a Region: the
    cross entropy subtracts the row max from its logits as a shift the loss does not depend on,
    and no gradient flows through it."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def forward(self, x):
        return self.comm.all_reduce(x, op="max")


REGIONS = (
    CopyToTensorParallel,
    ReduceFromTensorParallel,
    ScatterToTensorParallel,
    GatherFromTensorParallel,
    ReduceScatterToSequenceParallel,
    GatherFromSequenceParallel,
)
