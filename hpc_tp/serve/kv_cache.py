"""KV cache for incremental decoding, sharded by heads like the attention that fills it.

Each tp rank caches only the K/V heads its attention owns (with grouped-query attention whole KV
groups; when tp > kv heads a KV head is cached on each rank that replicates it), so the cache
shrinks with tp just as the weights do. Buffers are preallocated for the whole batch up to its
final length: [layers, batch, local kv heads, max_len, head_dim] for K and for V.

Slots are shared by the rows of a batch: the engine left-pads prompts so that every row writes its
next token at the same slot, and a key mask (kept by the engine) hides the padding slots.

``SlotCache`` is the same cache as a fixed-shape decode step sees it (``serve.decoding``): the slot
to write is a device array rather than a Python int, and every step attends over all the slots.
"""
from __future__ import annotations

import numpy

from .. import backend
from ..nn import cuda_kernels


class LayerCache:
    """One layer's view of the cache, the ``cache`` argument of ``ParallelAttention.forward``."""

    def __init__(self, owner: "KVCache", layer: int):
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
    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype):
        xp = backend.xp
        shape = (n_layers, batch, kv_heads, max_len, head_dim)
        self.k = xp.zeros(shape, dtype=dtype)
        self.v = xp.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # slots filled, the same for every row
        self._layers = [LayerCache(self, i) for i in range(n_layers)]

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        attn = model.layers[0].attn
        return cls(len(model.layers), batch, attn.kv_local, max_len, attn.head_dim, model.dtype)

    def layer(self, i: int) -> LayerCache:
        return self._layers[i]

    def advance(self, steps: int):
        """Every layer stored ``steps`` more slots: the next step writes after them."""
        self.length += steps

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


class SlotCache:
    """``cache`` for decode steps of one new token that all have the same shapes and addresses, as a
    captured CUDA graph needs: each layer writes the token's K/V at the slot that the one-element
    int64 array ``slot`` holds (read on the device) and returns all ``max_len`` slots. For the causal
    mask every slot comes before the query (``offset``), so the caller's key mask over all the slots
    alone decides which are seen: the filled ones. ``advance`` does nothing: the caller moves ``slot``
    and the owner's ``length``."""

    def __init__(self, owner: KVCache, slot):
        self.owner, self.slot = owner, slot
        self._layers = [_SlotLayer(self, i) for i in range(owner.k.shape[0])]

    def layer(self, i: int) -> "_SlotLayer":
        return self._layers[i]

    def advance(self, steps: int):
        pass


class _SlotLayer:
    def __init__(self, slots: SlotCache, layer: int):
        self._slots, self._layer = slots, layer

    @property
    def offset(self) -> int:
        return self._slots.owner.max_len - 1

    def store(self, k, v):
        if k.shape[2] != 1:
            raise ValueError(f"a fixed-shape decode step takes one new token per row, got {k.shape[2]}")
        owner, slot = self._slots.owner, self._slots.slot
        keys, values = owner.k[self._layer], owner.v[self._layer]
        for cache, new in ((keys, k), (values, v)):
            if isinstance(cache, numpy.ndarray):
                cache[:, :, int(slot[0])] = new[:, :, 0]
            else:
                cuda_kernels.write_slot(cache, new, slot)
        return keys, values
