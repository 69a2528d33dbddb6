"""KV cache for incremental decoding, sharded by heads like the attention that fills it.

Each tp rank caches only the K/V heads its attention owns (with grouped-query attention whole KV
groups; when tp > kv heads a KV head is cached on each rank that replicates it), so the cache
shrinks with tp just as the weights do. Buffers are preallocated for the whole batch up to its
final length: [layers, batch, local kv heads, max_len, head_dim] for K and for V.

Slots are shared by the rows of a batch: the engine left-pads prompts so that every row writes its
next token at the same slot, and a key mask (kept by the engine) hides the padding slots.
"""
from __future__ import annotations

from .. import backend


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
