"""Vocab-parallel embedding, LM head and cross entropy.

The vocabulary is cut into tp contiguous row blocks of ``ceil(V / tp)``; the last block may
run past V (padding rows that hold zeros). The embedding looks up the ids that fall in this
rank's block and g sums the blocks. The cross entropy never gathers the logits: it reduces
the row max, then (in one all-reduce) the sum of exponentials and the target logit. Padding
columns are set to -inf, so they can never win the max or take probability mass. Each class
holds its communication regions (``mappings.py``) and says in its docstring what they send.
"""

from __future__ import annotations

import numpy

from .. import backend
from ..comm.base import Communicator
from ..kernels import bf16_dot, bf16_panels, quantized
from ..kernels.functional import scatter_add_rows
from ..module import Module, Parameter, param_buffer, split
from .layers import add_weight_grad, product
from .mappings import CopyToTensorParallel, MaxFromTensorParallel, ReduceFromTensorParallel

IGNORE_INDEX = -100


class VocabParallelEmbedding(Module):
    """The rows of ids [B, T] in the embedding matrix W [V, hidden], split by vocabulary rows: each
    rank looks up the ids in its block (zeros for the others).

    What crosses the wire: g forward, an all-reduce of the looked-up rows [B, T, hidden] in
    place; nothing backward (g's backward is the identity: each rank adds the gradient rows of
    its own ids).
    """

    def __init__(self, vocab_size: int, hidden: int, comm: Communicator, dtype="float64"):
        self.vocab_size = vocab_size
        self.g = ReduceFromTensorParallel(comm)
        self.weight = Parameter(
            param_buffer((-(-vocab_size // comm.size), hidden), dtype),
            split((vocab_size, hidden), 0, comm.size, comm.rank),
        )
        self.vocab_start, stop = self.weight.partition.local_range()
        self.vocab_local = stop - self.vocab_start

    def _local_ids(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        return backend.xp_of(ids).where(outside, 0, local), outside

    def forward(self, ids):
        local, outside = self._local_ids(ids)
        # Not ``y[outside] = 0``: cupy counts a boolean mask's hits on the host, which a captured
        # decode step cannot do (serve.decoding).
        y = backend.xp_of(ids).where(outside[..., None], 0, self.weight.data[local])
        return self.g.forward(y), (local, outside)

    def backward(self, dy, ctx):
        local, outside = ctx
        if not self.weight.trainable:  # frozen (LoRA): nothing below the embedding takes a gradient
            return None
        dy = self.g.backward(dy)
        if isinstance(dy, numpy.ndarray):  # the rows this rank holds, compacted
            keep = ~outside
            scatter_add_rows(self.weight.grad, local[keep], dy[keep])
        else:  # a boolean mask's hit count is a host read (a capture cannot hold one): others add 0 to row 0
            scatter_add_rows(self.weight.grad, local, backend.xp_of(dy).where(outside[..., None], 0, dy))
        return None


class VocabParallelLMHead(Module):
    """logits_local = h @ W_local.T with W [V, hidden] split by vocab rows (tied: the embedding's W):
    each rank's logits [B, T, V / tp] for its block of the vocabulary, never gathered.

    What crosses the wire: f before the head, so nothing forward (every rank holds h [B, T, hidden]);
    backward an all-reduce of the hidden-state gradient [B, T, hidden], running while the weight
    gradient is computed.

    ``quantize`` (a model whose linear layers are kept quantized, inference only): a float32 or half
    head on the CPU multiplies an int8 copy of W (``kernels.quantized``, Q8_0's groups of 32 along
    hidden), as llama.cpp keeps its output layer 8-bit: a quarter of a float32 head's bytes a decode
    step. The copy is made after the weights are loaded (``pack_for_inference``, at load; else at the first
    forward). A float64 model keeps the float head: its numbers are the quantized layers' exactly.

    A bfloat16 head loaded for inference keeps W.T in panels (``kernels.bf16_panels``) instead of W, one
    copy: the tied embedding looks its rows up from them (``PanelValues``).
    """

    def __init__(self, weight: Parameter, comm: Communicator, owns_weight: bool, quantize: str | None = None):
        self.f = CopyToTensorParallel(comm)
        # Tied: the embedding owns and names the weight; the underscore keeps Module from listing it twice.
        self.weight = weight if owns_weight else None
        self._w = weight
        self.quantize = quantize
        self._int8 = None

    def _product_weight(self):
        """W.T as the forward multiplies it: the int8 copy where ``quantize`` takes it, else the float view."""
        data = self._w.data
        if isinstance(data, bf16_panels.PanelValues):
            return data.matrix
        if self.quantize is None or not isinstance(data, numpy.ndarray) or data.dtype == numpy.float64:
            return data.T
        if self._int8 is None:
            self._int8 = quantized.quantize(data.T, 8)
        return self._int8

    def pack_for_inference(self):
        """The int8 copy made now, in the layout its products read (``QuantizedMatrix.pack``); or a
        bfloat16 W.T's panels made, kept in W's place."""
        weight = self._product_weight()
        if isinstance(weight, quantized.QuantizedMatrix):
            weight.pack()
        elif bf16_dot.packs(weight):
            self._w.data = bf16_panels.PanelValues(bf16_panels.PanelMatrix(weight), transposed=True)

    def forward(self, h):
        return product(self.f.forward(h), self._product_weight()), h

    def backward(self, dlogits, h):
        h2, d2 = h.reshape(-1, h.shape[-1]), dlogits.reshape(-1, dlogits.shape[-1])
        pending = self.f.backward_async(product(dlogits, self._w.data))  # overlaps the weight gradient
        if self._w.trainable:  # frozen (LoRA): the input gradient alone
            add_weight_grad(self._w.grad, d2, h2)
        return pending.wait()


class VocabParallelCrossEntropy:
    """Sum of token losses over targets != IGNORE_INDEX; the caller divides by the global token count.

    What crosses the wire, forward only, for N = B * T tokens: the row max [N] (an all-reduce max,
    ``MaxFromTensorParallel``), then the sum of exponentials and the target logit [2, N] in one
    message through g. Backward sends nothing: g's backward is the identity, so each rank's logit
    gradient follows from the summed statistics and its own logits.
    """

    def __init__(self, vocab_size: int, comm: Communicator):
        self.vocab_size = vocab_size
        self.g, self.row_max = ReduceFromTensorParallel(comm), MaxFromTensorParallel(comm)
        local = -(-vocab_size // comm.size)
        self.vocab_start = min(comm.rank * local, vocab_size)
        self.vocab_valid = min(local, vocab_size - self.vocab_start)

    def forward(self, logits_local, targets, overwrite: bool = False, on_device: bool = False):
        """``overwrite``: the logits are this call's to reuse (the LM head's fresh product), so the
        softmax numerators are made in their buffer instead of a copy (half-precision or strided
        logits are still copied: widened, or made contiguous). ``on_device``: the loss sum (float64)
        and the token count come back as 0-d arrays on the logits' device, not read by the host (a
        step captured as a CUDA graph)."""
        xp = backend.xp_of(logits_local)
        # Half-precision logits are widened: a float16 sum of exponentials or of the batch's token
        # losses passes 65504 (e.g. 8192 tokens at loss 10) and the step would be lost as inf.
        work = logits_local.dtype if logits_local.dtype.itemsize >= 4 else "float32"
        logits = logits_local.reshape(-1, logits_local.shape[-1])
        logits = logits if overwrite and logits.dtype == work and logits.flags.c_contiguous else logits.astype(work)
        targets = targets.reshape(-1)
        logits[:, self.vocab_valid :] = -xp.inf
        row_max = self.row_max.forward(logits.max(axis=1))
        local_t = targets - self.vocab_start
        mine = (local_t >= 0) & (local_t < self.vocab_valid)
        picked = xp.where(mine, local_t, 0)
        sums = xp.zeros((2, targets.shape[0]), dtype=logits.dtype)
        for rows in _row_blocks(logits):  # numpy's operations, a block of rows at a time while it is in cache
            block = logits[rows]
            block -= row_max[rows, None]
            sums[1, rows] = xp.where(mine[rows], block[xp.arange(block.shape[0]), picked[rows]], 0.0)
            xp.exp(block, out=block)  # block now holds exp(z - max): the softmax numerators
            sums[0, rows] = block.sum(axis=1)
        self.g.forward(sums)  # sum of exponentials and target logit, in one message, in place
        valid = targets != IGNORE_INDEX
        token_loss = xp.where(valid, xp.log(sums[0]) - sums[1], 0.0)
        ctx = (logits, sums[0], local_t, mine & valid, valid, logits_local.shape, logits_local.dtype)
        if on_device:
            return token_loss.sum().astype("float64"), valid.sum(), ctx
        return float(token_loss.sum()), int(valid.sum()), ctx

    def backward(self, ctx, scale: float):
        """Gradient of ``scale * sum(token losses)`` with respect to the local logits, in the
        numerators' buffer."""
        probs, sum_exp, local_t, target_here, valid, shape, dtype = ctx
        xp = backend.xp_of(probs)
        row_scale = xp.where(valid, scale, 0.0)
        # Every row subtracts its target's indicator at its target, or 0 at column 0 where the target
        # is elsewhere (x - 0 is x): no count of the hits, which a device would read back to the host.
        picked = xp.where(target_here, local_t, 0)
        for rows in _row_blocks(probs):
            block = probs[rows]
            block /= sum_exp[rows, None]
            block[xp.arange(block.shape[0]), picked[rows]] -= target_here[rows]
            block *= row_scale[rows, None]
        return probs.reshape(shape).astype(dtype, copy=False)


ROW_BLOCK_BYTES = 1 << 20  # a block of logit rows small enough that its passes run in L2, not from memory


def _row_blocks(logits):
    """Slices of ``logits``' rows of about ``ROW_BLOCK_BYTES`` each on the CPU; all rows at once on a
    device (one kernel per operation is what a GPU wants)."""
    rows = logits.shape[0]
    if not isinstance(logits, numpy.ndarray):
        return [slice(0, rows)]
    step = max(1, ROW_BLOCK_BYTES // max(1, logits.shape[1] * logits.itemsize))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]
