"""KV cache for incremental decoding, sharded by heads like the attention that fills it.

Each tp rank caches only the K/V heads its attention owns (with grouped-query attention whole KV
groups; when tp > kv heads a KV head is cached on each rank that replicates it), so the cache
shrinks with tp just as the weights do. Buffers are preallocated, [layers, batch, local kv heads,
max_len, head_dim] for K and for V: a static batch's up to its final length, continuous batching's
for every row at the longest a request may be (serve's --max-model-len).

In a static batch (``Engine.generate``) slots are shared by the rows: the engine left-pads prompts
so that every row writes its next token at the same slot, and a key mask (kept by the engine) hides
the padding slots. Under continuous batching (``serve.continuous``) each row is its own request:
prompts are prefilled into their rows (``RowsPrefill``), ``rows`` gives the first rows to a decode
step, which writes every row's token at that row's own slot, and ``copy_slots`` hands a cached prompt
prefix from one row to another.

``RowsPrefill`` is the cache as one prefill of several right-padded prompts sees it, each into a
row of its own chosen by the caller (continuous batching's admissions).

``SlotCache`` is the cache as a decode step of one token per row sees it (``serve.decoding``): the
slots to write are a device array rather than a Python int (one slot for every row, or one per row),
and the step attends over a fixed number of slots, its key mask alone deciding which are seen; its
``query_slots`` tell a sliding-window layer where each row's window ends.
"""

from __future__ import annotations

import numpy

from .. import backend
from ..kernels import cuda_kernels


class LayerCache:
    """One layer's view of the cache, the ``cache`` argument of ``ParallelAttention.forward``."""

    def __init__(self, owner: KVCache, layer: int):
        self._owner, self._layer = owner, layer

    @property
    def offset(self) -> int:
        return self._owner.length

    def store(self, k, v):
        """Write this step's K/V [B, hk, T, d] at the next free slots; return every filled slot."""
        start, stop = self.offset, self.offset + k.shape[2]
        if stop > self._owner.max_len:
            raise ValueError(f"KV cache of {self._owner.max_len} slots cannot take slots {start}..{stop - 1}")
        keys, values = self._owner.k[self._layer], self._owner.v[self._layer]
        keys[:, :, start:stop] = k
        values[:, :, start:stop] = v
        return keys[:, :, :stop], values[:, :, :stop]


class KVCache:
    """Over the buffers ``k`` and ``v`` [layers, batch, local kv heads, max_len, head_dim], none filled."""

    def __init__(self, k, v):
        self.k, self.v = k, v
        self.max_len = k.shape[3]
        self.length = 0  # slots filled, the same for every row
        self._layers = [LayerCache(self, i) for i in range(k.shape[0])]

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> KVCache:
        attn, xp = model.layers[0].attn, backend.xp
        shape = (len(model.layers), batch, attn.kv_local, max_len, attn.head_dim)
        return cls(xp.zeros(shape, dtype=model.dtype), xp.zeros(shape, dtype=model.dtype))

    def layer(self, i: int) -> LayerCache:
        return self._layers[i]

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows ``start:stop`` as a cache of their own, empty (length 0) and sharing this one's memory: a
        decode step over the first rows touches no other. Whatever those rows hold stays in memory;
        the step's key mask decides what is seen."""
        return KVCache(self.k[:, start:stop], self.v[:, start:stop])

    def copy_slots(self, source: int, target: int, slots: int):
        """Row ``target``'s first ``slots`` slots made row ``source``'s, every layer: a prompt prefix
        cached in one row, reused in another (continuous batching's prefix caching)."""
        for buffers in (self.k, self.v):
            buffers[:, target, :, :slots] = buffers[:, source, :, :slots]

    def advance(self, steps: int):
        """Every layer stored ``steps`` more slots: the next step writes after them."""
        self.length += steps

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


class _View:
    """The cache as one kind of step sees it: each layer's ``store`` of its own kind, and no
    ``advance`` (the caller keeps the rows' lengths)."""

    def __init__(self, owner: KVCache, layer_kind):
        self.owner = owner
        self._layers = [layer_kind(self, i) for i in range(owner.k.shape[0])]

    def layer(self, i: int):
        return self._layers[i]

    def advance(self, steps: int):
        pass


class RowsPrefill(_View):
    """``cache`` for one prefill of right-padded prompts [B, T] into rows ``rows`` (an int array [B] on
    the device) of ``owner`` from slot ``offset``, rows that need not be neighbours (continuous
    batching admits into whichever are free), each holding the first ``offset`` tokens of its prompt
    already (prefix caching; 0: none). Each layer writes its K/V for the T slots straight into those
    rows and attends over them, after the held slots where there are any. A row shorter than T gets
    padding after its prompt there, which its length hides as it hides whatever an earlier request
    left. ``advance`` does nothing: each row's length is the caller's to keep."""

    def __init__(self, owner: KVCache, rows, offset: int = 0):
        self.rows, self.offset = rows, offset
        super().__init__(owner, _RowsLayer)


class _RowsLayer:
    def __init__(self, prefill: RowsPrefill, layer: int):
        self._prefill, self._layer = prefill, layer
        self.offset = prefill.offset

    def store(self, k, v):
        owner, rows = self._prefill.owner, self._prefill.rows
        start, stop = self.offset, self.offset + k.shape[2]
        if stop > owner.max_len:
            raise ValueError(f"KV cache of {owner.max_len} slots cannot take slots {start}..{stop - 1}")
        keys, values = owner.k[self._layer], owner.v[self._layer]
        keys[rows, :, start:stop] = k
        values[rows, :, start:stop] = v
        if start == 0:
            return k, v
        return keys[rows, :, :stop], values[rows, :, :stop]


class SlotCache(_View):
    """``cache`` for decode steps of one new token per row whose slots are read on the device: each
    layer writes the token's K/V at the slot that the int64 array ``slot`` holds, [1] for every row
    alike (the fixed-shape steps a captured CUDA graph replays) or [B] one per row (continuous
    batching), and returns the first ``width`` slots (default all ``max_len``). For the causal mask
    every returned slot comes before the query (``offset``), so the caller's key mask over them alone
    decides which are seen: the filled ones. ``advance`` does nothing: the caller moves ``slot`` and
    the owner's ``length``."""

    def __init__(self, owner: KVCache, slot, width: int | None = None):
        self.slot = slot
        self.width = owner.max_len if width is None else width
        self.rows = backend.xp_of(slot).arange(owner.k.shape[1]) if len(slot) > 1 else None
        super().__init__(owner, _SlotLayer)


class _SlotLayer:
    def __init__(self, slots: SlotCache, layer: int):
        self._slots, self._layer = slots, layer

    @property
    def offset(self) -> int:
        return self._slots.width - 1

    @property
    def query_slots(self):
        """The slot each row's new token is written at: where a sliding window ends."""
        return self._slots.slot

    def store(self, k, v):
        if k.shape[2] != 1:
            raise ValueError(f"a slot-addressed decode step takes one new token per row, got {k.shape[2]}")
        slots = self._slots
        keys, values = slots.owner.k[self._layer], slots.owner.v[self._layer]
        for cache, new in ((keys, k), (values, v)):
            if slots.rows is not None:  # row r at slot[r]: [B, slots, hk, d] indexed by (row, slot) pairs
                cache.swapaxes(1, 2)[slots.rows, slots.slot] = new[:, :, 0]
            elif isinstance(cache, numpy.ndarray):
                cache[:, :, int(slots.slot[0])] = new[:, :, 0]
            else:
                cuda_kernels.write_slot(cache, new, slots.slot)
        return keys[:, :, : slots.width], values[:, :, : slots.width]
