"""KV caches for incremental decoding, sharded by heads like the attention that fills them.

Each tp rank caches only the K/V heads its attention owns (with grouped-query attention whole KV
groups; when tp > kv heads a KV head is cached on each rank that replicates it), so a cache shrinks
with tp just as the weights do.

``KVCache`` is a static batch's (``Engine.generate``, ``hpc-tp bench decode``): buffers
[layers, batch, local kv heads, max_len, head_dim] for K and for V, preallocated up to the batch's
final length. Its slots are shared by the rows: the engine left-pads prompts so that every row writes
its next token at the same slot, and a key mask (kept by the engine) hides the padding slots.
``SlotCache`` is that cache as a fixed-shape decode step sees it (``serve.decoding.FixedStep``); its
``query_slots`` tell a sliding-window layer where each row's window ends, as a paged decode step's do.

``PagedKVCache`` is continuous batching's (``serve.continuous``): one pool of fixed-size units,
[depth, local kv heads, units x block size, head_dim], whose units ``serve.blocks`` hands to the
requests a few at a time as their tokens need them, and shares between requests with a common prefix.
A unit holds ``group`` layers' K/V (``blocks.PagedLayout``: every layer where they share one window or
none; with layers of several windows, the layers of one kind are spread over several units a block, each
a lane of its block table); a pipeline stage's pool holds its own of them (``depth``: the most of one
lane it holds). A forward pass sees it through a ``PagedView``: each row's new K/V are
written at the pool slots its block table gives (each layer its own lane's), and attention reads
each row's slots gathered in order, so the layers see the [B, heads, keys, d] arrays of a contiguous
cache.
"""

from __future__ import annotations

import numpy

from .. import backend
from ..kernels import cpu_kernels, cuda_kernels, paged_attention, paged_bf16
from .blocks import PagedLayout


class CacheLayer:
    """One layer's view of a cache, the ``cache`` argument of ``ParallelAttention.forward``: ``offset``
    and ``store`` (there), and ``attend``, which a cache with an attention kernel of its own overrides."""

    def attend(self, q, k, v, out, window: int, key_mask=None) -> bool:
        """Store ``k``, ``v`` and write the causal attention of ``q`` over the cache (each query over its
        last ``window`` positions; 0: all; the keys ``key_mask`` [B, keys] hides left out) into ``out``,
        where this cache has a kernel for it; False (and nothing done): ``store``, then the layer's own
        core."""
        return False

    def decode_pools(self):
        """(K pool, V pool [hk, slots, d], write slots [B, 1], read slots [B, W], counts [B]) of a decode
        step whose caller writes and attends over this layer's float32 pools on the host itself, with
        ``kernels.paged_attention``'s loop (``nn.one_row``); None: ``attend`` or ``store`` are the way."""
        return None

    def parts(self, q, k, v, out, key_mask):
        """The batches a forward pass's tokens make, each attending on its own: [(layer, key mask, q, k,
        v, out)], the arrays views of the pass's (``MixedView`` has several; every other cache one)."""
        return [(self, key_mask, q, k, v, out)]


class LayerCache(CacheLayer):
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

    def advance(self, steps: int):
        """Every layer stored ``steps`` more slots: the next step writes after them."""
        self.length += steps

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


class _View:
    """A cache as one kind of step sees it: each layer's ``store`` of its own kind, and no
    ``advance`` (the caller keeps the lengths)."""

    def __init__(self, layer_kind, layers: int):
        self._layers = [layer_kind(self, i) for i in range(layers)]

    def layer(self, i: int):
        return self._layers[i]

    def advance(self, steps: int):
        pass


class SlotCache(_View):
    """``cache`` for fixed-shape decode steps of one new token per row, the slot to write a device
    array rather than a Python int: each layer writes the token's K/V at the slot that the int64
    array ``slot`` [1] holds, the same for every row (the steps a captured CUDA graph replays), and
    returns all ``max_len`` slots. For the causal mask every slot comes before the query
    (``offset``), so the caller's key mask alone decides which are seen: the filled ones.
    ``advance`` does nothing: the caller moves ``slot`` and the owner's ``length``."""

    def __init__(self, owner: KVCache, slot):
        self.owner, self.slot = owner, slot
        super().__init__(_SlotLayer, owner.k.shape[0])


class _SlotLayer(CacheLayer):
    def __init__(self, slots: SlotCache, layer: int):
        self._slots, self._layer = slots, layer

    @property
    def offset(self) -> int:
        return self._slots.owner.max_len - 1

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
            if isinstance(cache, numpy.ndarray):
                cache[:, :, int(slots.slot[0])] = new[:, :, 0]
            else:
                cuda_kernels.write_slot(cache, new, slots.slot)
        return keys, values


class PagedKVCache:
    """Over the pool ``k``, ``v`` [depth, local kv heads, slots, head_dim] of ``layout``
    (``blocks.PagedLayout``), its slots in units of ``layout.size`` (unit u: slots u * size onwards);
    ``place``: each of the model's layers' (index on the leading axis, lane)."""

    def __init__(self, k, v, layout: PagedLayout, place: list[tuple[int, int]]):
        self.k, self.v, self.layout, self.place, self.block_size = k, v, layout, place, layout.size

    @classmethod
    def for_model(cls, model, units: int, layout: PagedLayout) -> PagedKVCache:
        attn, xp, place = model.layers[0].attn, backend.xp, cls.places(model, layout)
        shape = (_depth(place), attn.kv_local, units * layout.size, attn.head_dim)
        return cls(xp.zeros(shape, dtype=model.dtype), xp.zeros(shape, dtype=model.dtype), layout, place)

    @staticmethod
    def places(model, layout: PagedLayout) -> list[tuple[int, int]]:
        """``layout.places`` of ``model``'s layers (a pipeline stage's own)."""
        return layout.places([block.attn.layer_id for block in model.layers])

    @classmethod
    def unit_bytes(cls, model, layout: PagedLayout) -> int:
        """What one unit takes on this rank, K and V of the layers of it that this rank holds."""
        attn, depth = model.layers[0].attn, _depth(cls.places(model, layout))
        return 2 * depth * attn.kv_local * layout.size * attn.head_dim * numpy.dtype(model.dtype).itemsize

    @property
    def units(self) -> int:
        return self.k.shape[2] // self.block_size

    def copy_block(self, source: int, target: int):
        """Unit ``target``'s slots made unit ``source``'s, every layer it holds (copy-on-write)."""
        size = self.block_size
        for pool in (self.k, self.v):
            pool[:, :, target * size : (target + 1) * size] = pool[:, :, source * size : (source + 1) * size]

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def _depth(place) -> int:
    """The pool's leading axis for layers at ``place`` ((index, lane) each): the most of one lane held."""
    return 1 + max(index for index, _ in place)


class PagedView(_View):
    """``cache`` for one forward pass of B rows of T new tokens over a ``PagedKVCache``: each layer
    writes the tokens' K/V at the pool slots ``write[lane]`` [lanes, B, T] (int64, on the device) of
    its lane and attends over the slots ``read[lane]`` [lanes, B, K] (each row's slots 0..K-1 in
    order, the new ones last among them), or, with ``read`` None, over the new K/V alone (a prefill
    from slot 0). The new tokens are the last T of the K slots (``offset`` K - T) for the causal mask;
    the caller's key mask [B, K] hides the slots a row does not fill, and a windowed layer's window
    those before it (its kind's table gives them the scratch unit once given back). ``counts`` [B] (host int64) makes it a decode step's: how many of its
    ``read`` slots each row sees (its length and the new one), so where its query is (a sliding
    window's end) and how far ``kernels.paged_attention`` reads each row's own slots in place on the
    CPU instead of gathering them. ``advance`` does nothing: the caller keeps the rows' lengths."""

    def __init__(self, cache: PagedKVCache, write, read=None, counts=None):
        self.cache, self.write, self.read, self.counts = cache, write, read, counts
        self.query_slots = None if counts is None else backend.xp_of(write).asarray(counts - 1)
        self.offset = 0 if read is None else read.shape[-1] - write.shape[-1]
        self._held = (None, None)  # (key mask, what ``held`` made of it): every layer of a pass asks
        super().__init__(_PagedLayer, len(cache.place))

    def held(self, key_mask):
        """How many of its slots each row holds (int64 [B]) where ``key_mask`` [B, K] (None: all) shows
        each row its first ones, as a right-padded prefill's does; None where it shows others."""
        if self._held[0] is not key_mask or key_mask is None:
            batch, keys = self.write.shape[1], self.offset + self.write.shape[2]
            if key_mask is None:
                lengths = numpy.full(batch, keys, numpy.int64)
            else:
                mask = backend.to_numpy(key_mask)
                lengths = mask.sum(axis=1, dtype=numpy.int64)
                lengths = lengths if numpy.array_equal(mask, numpy.arange(keys) < lengths[:, None]) else None
            self._held = (key_mask, lengths)
        return self._held[1]


class MixedView(_View):
    """``cache`` for one forward pass over several batches' tokens at once (continuous batching's
    prefill chunks and decode step together, ``serve.continuous``): ``parts`` [(view, rows, width, key
    mask)], each a ``PagedView`` of ``rows`` x ``width`` new tokens and that batch's key mask, their
    tokens flattened in order into the pass's one row. Every layer but attention works token by token,
    so the weights are read once for all the parts; each layer's attention splits the tokens back into
    the parts' [rows, ..., width, d] views and each part attends over its own slots, as alone."""

    def __init__(self, parts):
        self.parts = parts
        super().__init__(_MixedLayer, len(parts[0][0].cache.place))


class _MixedLayer(CacheLayer):
    def __init__(self, view: MixedView, layer: int):
        self._parts = [(part.layer(layer), rows, width, mask) for part, rows, width, mask in view.parts]

    def parts(self, q, k, v, out, key_mask):
        split, start = [], 0
        for layer, rows, width, mask in self._parts:
            views = [_tokens(x, start, rows, width) for x in (q, k, v, out)]
            split.append((layer, mask, *views))
            start += rows * width
        return split


def _tokens(x, start: int, rows: int, width: int):
    """Of ``x`` [1, ..., N, d] (one row of N tokens), tokens ``start`` .. ``start + rows x width`` as a view
    [rows, ..., width, d]: splitting the token axis keeps its stride, so no copy is made and what is
    written into it lands in ``x``."""
    part = x[0, ..., start : start + rows * width, :]
    part = part.reshape(*part.shape[:-2], rows, width, part.shape[-1])
    return backend.xp_of(x).moveaxis(part, -3, 0)


class _PagedLayer(CacheLayer):
    def __init__(self, view: PagedView, layer: int):
        self._view, self._layer = view, layer
        self._pool, self._lane = view.cache.place[layer]
        self.offset = view.offset

    def _write(self, k, v):
        view = self._view
        keys, values = view.cache.k[self._pool], view.cache.v[self._pool]
        if cpu_kernels.can_write_slots(keys, k, v):
            cpu_kernels.write_slots(keys, values, view.write[self._lane], k, v)  # both in one call
            return keys, values
        for pool, new in ((keys, k), (values, v)):
            pool[:, view.write[self._lane]] = new.swapaxes(0, 1)  # [hk, B, T, d] at the (row, token) pairs' slots
        return keys, values

    def store(self, k, v):
        keys, values = self._write(k, v)
        read = self._view.read
        if read is None:
            return k, v
        # gathered as [hk, B, K, d] and seen as [B, hk, K, d]: one copy, rows of unit stride
        read = read[self._lane]
        return keys[:, read].swapaxes(0, 1), values[:, read].swapaxes(0, 1)

    @property
    def query_slots(self):
        """Each row's query among the ``read`` slots (its position: a row's slots are in order from
        0), where a decode step's sliding window ends; None for a prefill, whose ``offset`` says it."""
        return self._view.query_slots

    def decode_pools(self):
        view = self._view
        keys, values = view.cache.k[self._pool], view.cache.v[self._pool]
        if view.counts is None or not (cpu_kernels.fused(keys) and keys.dtype == numpy.float32):
            return None
        return keys, values, view.write[self._lane], view.read[self._lane], view.counts

    def attend(self, q, k, v, out, window: int, key_mask=None) -> bool:
        view = self._view
        if view.counts is None:
            return self._prefill(q, k, v, out, window, key_mask)
        if not paged_attention.supported(q, view.cache.k):
            return False
        keys, values = self._write(k, v)
        paged_attention.decode(q, keys, values, view.read[self._lane], view.counts, out, window)
        return True

    def _prefill(self, q, k, v, out, window: int, key_mask) -> bool:
        """A prefill's attention on ``kernels.paged_bf16``'s rows (bfloat16 pools where the CPU has
        AVX512_BF16) over each row's slots in the pool, where each row's visible keys are its first ones
        (a right-padded batch's key mask); else False."""
        view = self._view
        if not paged_bf16.prefills(q, view.cache.k):
            return False
        lengths = view.held(key_mask)
        if lengths is None:
            return False
        keys, values = self._write(k, v)
        slots = view.write[self._lane] if view.read is None else view.read[self._lane]
        paged_bf16.prefill(q, keys, values, slots, self.offset, lengths, out, window)
        return True
