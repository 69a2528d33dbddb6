"""Sequence parallelism (Korthikanti et al., 2022): the parts of a block that tensor parallelism
leaves replicated (norms, dropout, residual sums) run on a 1/tp slice of the sequence instead.

    shard [B, T/tp, H] --all-gather (f)--> column-parallel ... row-parallel --reduce-scatter (g)--> shard

The all-reduce after a row-parallel layer becomes a reduce-scatter along the sequence and the f
before a column-parallel layer becomes an all-gather: together the same bytes as the all-reduce
they replace, while every activation a block keeps is divided by tp. The plain column- and
row-parallel layers take these regions in place of f and g (``sequence_parallel=True``); the
column-parallel layer keeps only its input shard and gathers it again in backward, as Megatron-LM
does, so the full sequence is never held between forward and backward.

Parameters that see only a shard of the tokens (norm gains and biases) get partial gradients on
each rank; ``sum_grads_over`` adds them up across the tp group in one message.
"""

from __future__ import annotations

from contextlib import contextmanager

from .. import backend
from ..comm.base import Communicator
from ..errors import ConfigError
from .mappings import SEQUENCE_AXIS, CopyToTensorParallel, ScatterToTensorParallel


def check_sequence_divisible(length: int, tp: int):
    if length % tp:
        raise ConfigError(
            f"sequence length {length} is not divisible by tp={tp} with sequence parallelism; "
            f"use a multiple of {tp} or turn sequence_parallel off"
        )


def scatter_sequence(x, comm: Communicator):
    """This rank's slice of a replicated [B, T, ...] tensor along the sequence."""
    check_sequence_divisible(x.shape[SEQUENCE_AXIS], comm.size)
    return ScatterToTensorParallel(comm, SEQUENCE_AXIS).forward(x)


@contextmanager
def sum_grads_over(comm: Communicator, params):
    """Gradients that the enclosed backward adds to ``params`` are summed over ``comm`` (each rank
    saw only its sequence shard; frozen ones are left out). The gradients accumulated before stay as they were, so
    micro-batches accumulate as usual; one all-reduce carries every parameter's increment."""
    params = [p for p in params if p is not None and p.trainable]
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
    # A parameter applied to every rank's shard enters the shards through f: its gradient is f's backward.
    flat = CopyToTensorParallel(comm).backward(xp.concatenate([g.ravel() for g in increments]))
    start = 0
    for p, g in zip(params, increments):
        p.grad += flat[start : start + g.size].reshape(g.shape)
        start += g.size
