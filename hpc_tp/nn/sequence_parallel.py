"""The nn side of sequence parallelism: dropout on a sequence shard, and a measure of the
activation memory a forward pass keeps for its backward.

Dropout on a shard draws the mask of the whole [B, T, H] activation, with the same key as the
replicated ``Dropout``, and keeps this rank's rows: every layout drops exactly the elements
tp=1 drops. Drawing the whole mask costs random numbers, never memory: only the shard is kept.
"""

from __future__ import annotations

from ..comm.base import Communicator
from ..tensor_parallel.mappings import SEQUENCE_AXIS, local_chunk
from .dropout import Dropout, keep_mask


class SequenceShardDropout(Dropout):
    def __init__(self, p: float, rng, site, comm: Communicator):
        super().__init__(p, rng, site)
        self.comm = comm

    def forward(self, x):
        if not self.active:
            return x, None
        shape = list(x.shape)
        shape[SEQUENCE_AXIS] *= self.comm.size
        mask = local_chunk(
            keep_mask(self.rng, self.site, tuple(shape), self.p, x.dtype), self.comm, SEQUENCE_AXIS
        ).copy()
        return x * mask, mask


def held_bytes(ctx) -> int:
    """Bytes of the distinct buffers an activation context keeps alive (views count once, by
    their base array): what a micro-batch in flight costs between its forward and backward."""
    seen = {}

    def visit(obj):
        if isinstance(obj, (tuple, list)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):
            base = obj
            while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
                base = base.base
            seen[id(base)] = base.nbytes

    visit(ctx)
    return sum(seen.values())
