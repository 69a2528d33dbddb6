"""Sequence parallelism (Korthikanti et al., 2022): the parts of a block that tensor parallelism
leaves replicated (norms, dropout, residual sums) run on a 1/tp slice of the sequence instead.

    shard [B, T/tp, H] --all-gather (f)--> column-parallel ... row-parallel --reduce-scatter (g)--> shard

The all-reduce after a row-parallel layer becomes a reduce-scatter along the sequence and the f
before a column-parallel layer becomes an all-gather: together the same bytes as the all-reduce
they replace, while every activation a block keeps is divided by tp. The column-parallel layer
keeps only its input shard and gathers it again in backward, as Megatron-LM does, so the full
sequence is never held between forward and backward.

Parameters that see only a shard of the tokens (norm gains and biases) get partial gradients on
each rank; ``sum_grads_over`` adds them up across the tp group in one message.
"""
from __future__ import annotations

from contextlib import contextmanager

from .. import backend
from ..comm.base import Communicator
from ..errors import ConfigError
from .layers import ColumnParallelLinear, RowParallelLinear, _flat, product
from .mappings import local_chunk

SEQUENCE_AXIS = 1  # hidden states are [batch, sequence, hidden]


def check_sequence_divisible(length: int, tp: int):
    if length % tp:
        raise ConfigError(f"sequence length {length} is not divisible by tp={tp} with sequence parallelism; "
                          f"use a multiple of {tp} or turn sequence_parallel off")


def scatter_sequence(x, comm: Communicator):
    """This rank's slice of a replicated [B, T, ...] tensor along the sequence (adjoint: ``gather_sequence``)."""
    check_sequence_divisible(x.shape[SEQUENCE_AXIS], comm.size)
    return local_chunk(x, comm, SEQUENCE_AXIS).copy()


def gather_sequence(x, comm: Communicator):
    return comm.all_gather(x, axis=SEQUENCE_AXIS) if comm.size > 1 else x


def reduce_scatter_sequence(x, comm: Communicator):
    return comm.reduce_scatter(x, axis=SEQUENCE_AXIS) if comm.size > 1 else x


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """Column-parallel linear whose input arrives as a sequence shard: all-gather forward,
    reduce-scatter of the input gradient backward."""

    def forward(self, x_shard):
        y, _ = super().forward(gather_sequence(x_shard, self.comm))
        return y, x_shard

    def backward(self, dy, x_shard):
        x = gather_sequence(x_shard, self.comm)  # gathered again rather than kept: activations / tp
        dy2, x2 = _flat(dy), _flat(x)
        dx = product(dy2, self._weight.T).reshape(x.shape)
        self._add_param_grads(x2, dy2)
        return reduce_scatter_sequence(dx, self.comm)


class SequenceParallelRowLinear(RowParallelLinear):
    """Row-parallel linear whose partial products are reduce-scattered along the sequence; the
    bias is added on the shard. Backward gathers the output gradient, after which the plain
    row-parallel backward applies (its bias gradient then covers the whole sequence)."""

    def forward(self, x):
        y = product(x, self.weight.data)
        y = reduce_scatter_sequence(y, self.comm)
        if self.bias is not None:
            y += self.bias.data
        return y, x

    def backward(self, dy_shard, x):
        return super().backward(gather_sequence(dy_shard, self.comm), x)


def linear_classes(sequence_parallel: bool):
    """(column, row) linear classes for a block with or without sequence parallelism."""
    if sequence_parallel:
        return SequenceParallelColumnLinear, SequenceParallelRowLinear
    return ColumnParallelLinear, RowParallelLinear


@contextmanager
def sum_grads_over(comm: Communicator, params):
    """Gradients that the enclosed backward adds to ``params`` are summed over ``comm`` (each rank
    saw only its sequence shard). The gradients accumulated before stay as they were, so
    micro-batches accumulate as usual; one all-reduce carries every parameter's increment."""
    params = [p for p in params if p is not None]
    if comm.size == 1 or not params:
        yield
        return
    xp = backend.xp
    kept = [p.grad for p in params]
    for p in params:
        p.grad = xp.zeros_like(p.grad)
    try:
        yield
        increments = [p.grad for p in params]
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    flat = comm.all_reduce(xp.concatenate([g.ravel() for g in increments]))
    start = 0
    for p, g in zip(params, increments):
        p.grad += flat[start:start + g.size].reshape(g.shape)
        start += g.size
