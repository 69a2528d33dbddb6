"""Self-attention split by heads.

QKV is one column-parallel GEMM: each rank owns whole query heads and the K/V heads they
attend to. With grouped-query attention and tp > kv heads, a KV head is replicated on the
tp/kv ranks whose query heads use it (its gradient is summed across those replicas). Heads
are independent, so attention itself needs no communication; the output projection is
row-parallel and its g all-reduce is the layer's only forward collective. The head size may be
set apart from hidden / heads (``head_dim``), and ``qk_norm_eps`` adds an RMSNorm over head_dim to
every query and key head before RoPE (Qwen3, Gemma 3).

The core (Q K^T, softmax and P V per causal query block, and their backward) runs as one fused
numba/MKL loop on the CPU (``cpu_attention``) for float32/float64 numpy arrays;
``_composed_forward``/``_composed_backward`` are its reference and the path everywhere else (half
dtypes on the CPU, no MKL, a GPU). With ``HPC_TP_FLASH_ATTENTION=1`` the core on a GPU runs as the
fused FlashAttention-style kernels of ``flash_attention`` instead (cupy arrays without attention
dropout): they keep only each row's log-sum-exp and the output for backward, whatever
``recompute_scores`` says.

Incremental decoding passes a ``cache`` (one layer's slots of a KV cache, e.g.
``hpc_tp.serve.kv_cache.LayerCache``): an object with ``offset`` (slots already filled),
``store(k, v) -> (keys, values)``, which writes this step's rotated K/V heads at slots
``offset:offset+T`` and returns every filled slot, and ``attend(q, k, v, out)``, True where the cache
stored them and attended with a kernel of its own (a paged cache's decode step on the CPU). Each rank
caches only its own K/V heads.

A sliding ``window`` (Mistral, Gemma 3's local layers) lets a query see itself and the window - 1
keys before it: each causal block reads only the keys from its first query's window on
(``query_blocks``), and the masks hide the rest of its tile. A cache whose rows write at slots of
their own (``query_slots``: the fixed-shape and continuous-batching decode steps) says where each
row's query is, and the window joins the key mask there instead.

With ``recompute_scores`` (selective recomputation, ``hpc_tp.recompute``) forward keeps neither
the softmax outputs nor the dropout masks, only each query row's log-sum-exp ([B, hk, g, T], in
float32 at least): backward makes each block's softmax again from the kept Q and K right before
using it, exp(Q K^T + masks - lse) (the FlashAttention statistics, tile by tile in the fused
kernel, block by block in the composed path), so no layer's whole softmax is ever rebuilt. The
dropout masks are redrawn whole from the dropout generator, which the caller sets back to
forward's position (as the pipeline does for any recomputation).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy

from .. import backend
from ..comm.base import Communicator
from ..errors import ConfigError
from ..kernels import blas, cpu_attention, flash_attention
from ..kernels import functional as F
from ..module import Module
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, Segment
from ..tensor_parallel.lora import LoRA
from ..tensor_parallel.random import DropoutRNG
from ..tensor_parallel.sequence_parallel import sum_grads_over
from .dropout import keep_mask
from .norms import RMSNorm


def heads_fit(n_heads: int, n_kv_heads: int, tp: int) -> bool:
    return n_heads % tp == 0 and (n_kv_heads % tp == 0 or tp % n_kv_heads == 0)


def check_heads(n_heads: int, n_kv_heads: int, tp: int):
    if not heads_fit(n_heads, n_kv_heads, tp):
        works = [t for t in range(1, n_heads + 1) if heads_fit(n_heads, n_kv_heads, t)]
        raise ConfigError(
            f"{n_heads} attention heads with {n_kv_heads} kv heads cannot be split over tp={tp}; "
            f"tp values that work: {', '.join(map(str, works))}"
        )


def attention_bias(batch, q_len, k_len, causal: bool, key_mask, q_offset: int, dtype, window: int = 0):
    """Additive mask [B|1, 1, 1, Tq, Tk]: 0 where a query may look, -inf where it may not.
    ``key_mask`` [B, Tk] is 1 for real tokens and 0 for padding; ``q_offset`` is the absolute
    position of the first query (decoding with a cache); ``window``: a causal sliding window."""
    xp = backend.xp
    allowed = xp.ones((1, q_len, k_len), dtype=bool)
    if causal:
        allowed = allowed & ~F.causal_hidden(q_len, k_len, q_offset, xp, window)[None]
    if key_mask is not None:
        allowed = allowed & (key_mask.astype(bool)[:, None, :])
    return xp.where(allowed, 0.0, -xp.inf).astype(dtype)[:, None, None]


# Causal attention runs in blocks of this many queries. On a CPU small tiles stay in cache and skip
# most of the masked triangle. On a GPU each block costs a dozen kernel launches, each tens of
# microseconds of host time, and those launches bound a W1 step on an H200: blocks of 256
# queries (W1's whole sequence), whose masked tiles cost the card less than the launches they save.
QUERY_BLOCK, DEVICE_QUERY_BLOCK = 64, 256


def query_block(on_device: bool) -> int:
    """Queries per causal block for arrays on a GPU or on the host (read at call time: tests shrink them)."""
    return DEVICE_QUERY_BLOCK if on_device else QUERY_BLOCK


def query_blocks(
    q_len: int, k_len: int, q_offset: int, causal: bool, on_device: bool = False, window: int = 0
) -> list[tuple[slice, slice]]:
    """(query rows, keys they may see) per block: with a causal mask a block of queries needs only
    the keys up to its last query's position, so blocks of 64 skip most of the masked upper
    triangle (T = 256: 10 of 16 tiles are computed); with a sliding ``window`` only the keys from
    its first query's window on, so a long sequence costs T x (window + 64) scores, not T^2 / 2.
    Without a causal mask, the whole square in one block."""
    return _blocks(q_len, k_len, q_offset, causal, query_block(on_device), window)


def _blocks(q_len: int, k_len: int, q_offset: int, causal: bool, block: int, window: int = 0):
    if not causal:
        return [(slice(0, q_len), slice(0, k_len))]
    if q_len <= block:
        return [(slice(0, q_len), slice(_window_start(q_offset, window), k_len))]
    return [
        (
            slice(start, min(start + block, q_len)),
            slice(_window_start(start + q_offset, window), min(k_len, min(start + block, q_len) + q_offset)),
        )
        for start in range(0, q_len, block)
    ]


def _window_start(position: int, window: int) -> int:
    """The first key a query at ``position`` sees in a sliding ``window`` (0: no window)."""
    return max(0, position - window + 1) if window else 0


def saved_score_elements(q_len: int, k_len: int, causal: bool, on_device: bool = False, window: int = 0) -> int:
    """Softmax outputs attention keeps per head and sequence (the blocks of ``query_blocks``)."""
    return _saved_elements(q_len, k_len, causal, query_block(on_device), window)


@functools.lru_cache(maxsize=4096)  # the planner asks for every layout it tries: most of a 175B search's time
def _saved_elements(q_len: int, k_len: int, causal: bool, block: int, window: int) -> int:
    return sum(
        (rows.stop - rows.start) * (keys.stop - keys.start)
        for rows, keys in _blocks(q_len, k_len, 0, causal, block, window)
    )


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None):
    """Inverse frequencies of rotate-half RoPE, with Hugging Face style ``rope_scaling``:
    {"rope_type": "linear", "factor": f} divides every frequency by f (positions interpolated);
    "llama3" divides only the low frequencies (wavelength above original_max_position_embeddings /
    low_freq_factor) by ``factor``, keeps the high ones (below .../high_freq_factor) and blends between."""
    xp = backend.xp
    inv_freq = 1.0 / (theta ** (xp.arange(0, head_dim, 2, dtype="float64") / head_dim))
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(
            f'rope_scaling {scaling!r}: expected null or an object such as {{"rope_type": "linear", "factor": 2.0}}'
        )
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    try:
        factor = float(scaling["factor"])
        if kind == "linear":
            return inv_freq / factor
        if kind == "llama3":
            low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
            original = float(scaling["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv_freq
            smooth = xp.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
            return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    except KeyError as e:
        raise ConfigError(f"rope_scaling {scaling!r}: missing key {e.args[0]!r}") from None
    raise ConfigError(f"rope_scaling type {kind!r}: expected 'default', 'linear' or 'llama3'")


def _per_row(tables, ndim: int):
    """RoPE tables of per-row positions [B, T, d/2] shaped to broadcast over heads of an
    ``ndim``-dimensional [B, ..., T, d] tensor; shared positions [T, d/2] broadcast as they are."""
    if tables[0].ndim == 2:
        return tables
    return tuple(t.reshape(t.shape[0], *(1,) * (ndim - 3), *t.shape[1:]) for t in tables)


class AttentionContext(NamedTuple):
    """What ``ParallelAttention.forward`` keeps for backward. Under selective recomputation
    (``recompute_scores``) ``probs`` and ``mask`` are None, and ``lse``, ``key_mask`` and ``dropped``
    are what rebuilds them."""

    qkv_ctx: object  # the QKV projection's context
    q: object  # rotated and scaled queries [B, hk, g, T, d]
    k: object  # keys and values [B, hk, keys, d]: with a cache, every filled slot
    v: object
    probs: object  # the softmax of each query block (None: recomputed)
    lse: object  # each query row's log-sum-exp [B, hk, g, T] (None: probs kept)
    mask: object  # the dropout keep-mask (None: no dropout, or recomputed)
    key_mask: object  # the key padding mask [B, keys], kept for recomputation only
    dropped: bool  # whether dropout ran (recomputation redraws its mask)
    fused: bool  # whether the fused CPU kernel ran (backward takes the same path)
    rope: object  # the rotary tables (None: no rope)
    norms: object  # the query and key norms' saved values (None: no qk_norm)
    offset: int  # cache slots filled before this call
    window: int  # the sliding window the blocks were cut for (0: none, or applied by the key mask)
    out_ctx: object  # the output projection's context
    flash_out: object = None  # the device kernels' attention output [B, hk, g, T, d] (None: they did not run)


class ParallelAttention(Module):
    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        comm: Communicator,
        *,
        causal=True,
        bias=True,
        rope_theta: float | None = None,
        rope_scaling: dict | None = None,
        window: int = 0,
        dropout: float = 0.0,
        rng: DropoutRNG | None = None,
        layer_id: int = 0,
        sequence_parallel: bool = False,
        head_dim: int | None = None,
        qk_norm_eps: float | None = None,
        query_scale: float | None = None,
        dtype="float64",
        quantize: str | None = None,
        lora: LoRA | None = None,
    ):
        if head_dim is None and hidden % n_heads:
            raise ConfigError(f"hidden size {hidden} is not divisible by {n_heads} attention heads")
        if n_heads % n_kv_heads:
            raise ConfigError(f"{n_heads} attention heads are not a multiple of {n_kv_heads} kv heads")
        d = hidden // n_heads if head_dim is None else head_dim
        if rope_theta is not None and d % 2:
            raise ConfigError(f"rope needs an even head size, got {d}")
        tp, rank = comm.size, comm.rank
        check_heads(n_heads, n_kv_heads, tp)
        self.head_dim = d
        self.heads_local = n_heads // tp
        self.head_start = rank * self.heads_local
        if n_kv_heads >= tp:
            kv_parts, kv_index, kv_replicas, replica_comm = tp, rank, 1, None
        else:
            kv_replicas = tp // n_kv_heads
            kv_parts, kv_index = n_kv_heads, rank // kv_replicas
            replica_comm = comm.split(color=kv_index, key=rank)
        self.kv_local = n_kv_heads // kv_parts
        self.causal, self.dropout, self.rng, self.layer_id = causal, dropout, rng, layer_id
        self.window = window  # sliding-window attention: each query sees its last ``window`` keys (0: all)
        self.recompute_scores = False  # selective recomputation (GPTModel.set_selective_recompute)
        self.inv_freq = None if rope_theta is None else rope_inv_freq(d, rope_theta, rope_scaling)
        # what makes two layers' rotary tables the same: a pass makes them once for all such layers
        self.rope_key = None if rope_theta is None else (d, rope_theta, repr(rope_scaling))
        # The cores' backward undoes 1/sqrt(d) on dQ; another scale (Gemma's query_pre_attn_scalar)
        # is fixed up after them by this ratio.
        self.query_scale = 1.0 / math.sqrt(d) if query_scale is None else query_scale
        self._scale_ratio = self.query_scale * math.sqrt(d)
        # what both linears are built with (their weights' precision, or format, the layout, the adapters)
        storage = dict(dtype=dtype, sequence_parallel=sequence_parallel, quantize=quantize, lora=lora)
        self.qkv = ColumnParallelLinear(
            hidden,
            None,
            comm,
            bias,
            segments=[
                Segment("q", n_heads * d, tp, rank),
                Segment("k", n_kv_heads * d, kv_parts, kv_index, kv_replicas, replica_comm),
                Segment("v", n_kv_heads * d, kv_parts, kv_index, kv_replicas, replica_comm),
            ],
            **storage,
        )
        # Query/key RMSNorm: one gain over head_dim shared by every head, so replicated; each rank's
        # gradient covers its own heads only and is summed over tp (a replicated K/V head's partial
        # gradients add up to its whole one there too).
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(d, tp, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(d, tp, qk_norm_eps, dtype)
        self._comm = comm
        self.out = RowParallelLinear(n_heads * d, hidden, comm, bias, input_is_parallel=True, **storage)

    def _split_heads(self, qkv):
        """Views of Q [B, hk, g, T, d] and of K, V [B, hk, T, d] in a [B, T, (hq + 2 hk) d] buffer:
        the QKV output, or its gradient."""
        b, t, _ = qkv.shape
        d, hq, hk = self.head_dim, self.heads_local, self.kv_local
        q = self._heads_view(qkv[..., : hq * d])
        k = qkv[..., hq * d : (hq + hk) * d].reshape(b, t, hk, d).transpose(0, 2, 1, 3)
        v = qkv[..., (hq + hk) * d :].reshape(b, t, hk, d).transpose(0, 2, 1, 3)
        return q, k, v

    def _dropout_masks(self, shape, dtype):
        """One mask per local head, keyed by the global head index: the same draw at any tp. Written
        head by head into one array: stacking a list of them held the layer's masks twice."""
        b, hk, g, tq, tk = shape
        masks = backend.xp.empty(shape, dtype)
        for h in range(hk * g):
            masks[:, h // g, h % g] = keep_mask(
                self.rng, ("attn", self.layer_id, self.head_start + h), (b, tq, tk), self.dropout, dtype
            )
        return masks

    def forward(self, x, key_mask=None, positions=None, cache=None, rope_tables=None):
        """``positions`` [T] or [B, T] (per row: padded batches); ``key_mask`` [B, keys] covers every
        key, so with a ``cache`` it spans the filled slots plus this step's. ``rope_tables``: a dict
        that the layers of one pass share, the rotary tables of ``positions`` by ``rope_key``, made
        by the first layer that needs them (None: this call makes its own)."""
        xp = backend.xp_of(x)
        qkv, qkv_ctx = self.qkv.forward(x)
        b, t, _ = qkv.shape  # the whole sequence, also when x is a sequence-parallel shard
        q, k, v = self._split_heads(qkv)
        norms = None
        if self.q_norm is not None:
            (q, q_saved), (k, k_saved) = self.q_norm.forward(q), self.k_norm.forward(k)
            norms = (q_saved, k_saved)
        rope = None
        if self.inv_freq is not None:
            rope = self.rope_tables_of(positions, t, x.dtype, rope_tables)
            # the queries scaled as they are rotated (not the [T, keys] scores)
            q = F.rope_apply(q, *_per_row(rope, q.ndim), scale=self.query_scale)
            k = F.rope_apply(k, *_per_row(rope, k.ndim))
        else:
            # Scale the queries, not the [T, keys] scores: in place, since qkv (or the normed copy) is
            # this call's own array and K/V views do not overlap Q.
            q *= self.query_scale
        if cache is not None:  # inference: nothing kept for a backward
            return self.out.forward(self.attend_cached(q, k, v, key_mask, cache))[0], None
        merged = xp.empty((b, t, self.heads_local * self.head_dim), dtype=x.dtype)
        attn = self._heads_view(merged)  # [B, hk, g, T, d] view: P V lands in the merged layout
        offset, window = 0, self.window
        keys = k.shape[2]
        mask = None
        if self.dropout > 0 and self.rng is not None and self.rng.training:
            mask = self._dropout_masks((b, self.kv_local, self.heads_local // self.kv_local, t, keys), x.dtype)
        fused = cpu_attention.supported(q, k, v, attn, *(() if mask is None else (mask,)))
        if mask is None and flash_attention.supported(q, k, v, attn):
            lse = flash_attention.forward(q, k, v, attn, offset, self.causal, key_mask, window)
            y, out_ctx = self.out.forward(merged)
            ctx = AttentionContext(
                qkv_ctx, q, k, v, None, lse, None, key_mask, False, False, rope, norms, offset, window, out_ctx, attn
            )
            return y, ctx
        saved = self._core(q, k, v, attn, key_mask, offset, window, mask, fused, self.recompute_scores)
        y, out_ctx = self.out.forward(merged)
        ctx = AttentionContext(
            qkv_ctx,
            q,
            k,
            v,
            probs=saved,
            lse=None,
            mask=mask,
            key_mask=None,
            dropped=False,
            fused=fused,
            rope=rope,
            norms=norms,
            offset=offset,
            window=window,
            out_ctx=out_ctx,
        )
        if self.recompute_scores:
            # Selective recomputation keeps what rebuilds the softmax and masks instead: the rows'
            # log-sum-exp, the key mask ([B, keys], small) and whether dropout ran.
            ctx = ctx._replace(probs=None, lse=saved, mask=None, key_mask=key_mask, dropped=mask is not None)
        return y, ctx

    def rope_tables_of(self, positions, t: int, dtype, made: dict | None):
        """cos/sin of ``positions`` (None: 0 .. t - 1) for this layer's rope, from ``made`` where a
        layer of the same rope made them for this pass, else made and kept there (None: made for this call)."""
        made = {} if made is None else made
        if self.rope_key not in made:
            pos = backend.xp.arange(t) if positions is None else positions
            made[self.rope_key] = F.rope_tables(pos, self.inv_freq, dtype)
        return made[self.rope_key]

    def attend_cached(self, q, k, v, key_mask, cache):
        """Inference's attention of the rotated, scaled queries ``q`` [B, hk, g, T, d] over ``cache``
        with this pass's keys and values [B, hk, T, d] stored in it: the heads merged [B, T, hq d], as the
        output projection takes them."""
        b, _, _, t, _ = q.shape
        merged = backend.xp_of(q).empty((b, t, self.heads_local * self.head_dim), dtype=q.dtype)
        attn = self._heads_view(merged)  # [B, hk, g, T, d] view: P V lands in the merged layout
        for part in cache.parts(q, k, v, attn, key_mask):
            self._attend_cached(*part)
        return merged

    def _attend_cached(self, cache, key_mask, q, k, v, attn):
        """Inference's attention of one batch over ``cache`` (a ``serve.kv_cache`` layer) into ``attn``:
        the cache's own kernel where it has one, else its stored K/V through the core."""
        if self.causal and cache.attend(q, k, v, attn, self.window, key_mask):
            return
        offset, window = cache.offset, self.window
        k, v = cache.store(k, v)
        if window and getattr(cache, "query_slots", None) is not None:
            key_mask, window = _slot_window(key_mask, cache.query_slots, k.shape[2], window)
        if flash_attention.supported(q, k, v, attn):
            flash_attention.forward(q, k, v, attn, offset, self.causal, key_mask, window)
            return
        self._core(q, k, v, attn, key_mask, offset, window, None, cpu_attention.supported(q, k, v, attn))

    def _core(self, q, k, v, attn, key_mask, offset, window, mask, fused, statistics=False):
        """softmax(Q K^T + masks) per query block, returned for backward, and P V (through the
        dropout ``mask``) into ``attn``; with ``statistics`` the rows' log-sum-exp [B, hk, g, T] is
        returned instead of the softmax (selective recomputation)."""
        t, keys = q.shape[3], k.shape[2]
        blocks = query_blocks(t, keys, offset, self.causal, backend.xp_of(q) is not numpy, window)
        if fused:
            return cpu_attention.forward(
                q, k, v, attn, blocks, offset, self.causal, _padding_bias(key_mask), mask, statistics, window
            )
        masks = self._masks(q, keys, key_mask, offset, window)
        return _composed_forward(q, k, v, attn, blocks, masks, mask, statistics)

    def _masks(self, q, keys, key_mask, offset, window):
        """The composed path's masks: the key padding as an additive bias (``attention_bias``; None
        without padding), the causal mask's offset for the softmax (None: not causal) and the window."""
        bias = (
            None if key_mask is None else attention_bias(q.shape[0], q.shape[3], keys, False, key_mask, offset, q.dtype)
        )
        return bias, offset if self.causal else None, window

    def _heads_view(self, merged):
        """[B, T, hq*d] seen as [B, hk, g, T, d] (query heads grouped by the KV head they share)."""
        b, t, _ = merged.shape
        hk = self.kv_local
        return merged.reshape(b, t, hk, self.heads_local // hk, self.head_dim).transpose(0, 2, 3, 1, 4)

    def backward(self, dy, ctx):
        (
            qkv_ctx,
            q,
            k,
            v,
            probs,
            lse,
            mask,
            key_mask,
            dropped,
            fused,
            rope,
            norms,
            offset,
            window,
            out_ctx,
            flash_out,
        ) = ctx
        xp = backend.xp_of(dy)
        hk, hq, d = self.kv_local, self.heads_local, self.head_dim
        dmerged = self.out.backward(dy, out_ctx)
        b, t, _ = dmerged.shape
        dattn = self._heads_view(dmerged)
        # dQ, dK, dV are written straight into the QKV gradient, in the layout QKV's GEMM produced.
        dqkv = xp.empty((b, t, (hq + 2 * hk) * d), dtype=q.dtype if fused or flash_out is not None else dy.dtype)
        dq, dk, dv = self._split_heads(dqkv)
        if flash_out is not None:  # the kernels write every element of dQ, dK and dV
            flash_attention.backward(
                dattn.astype(q.dtype, copy=False),
                q,
                k,
                v,
                flash_out,
                lse,
                offset,
                self.causal,
                key_mask,
                dq,
                dk,
                dv,
                window,
            )
            return self._scale_rope_norm_backward_and_qkv(dqkv, dq, dk, rope, norms, qkv_ctx)
        dk[...] = 0.0
        dv[...] = 0.0
        keys = k.shape[2]
        blocks = query_blocks(t, keys, offset, self.causal, xp is not numpy, window)
        if lse is not None:  # selective recomputation: the same masks (same generator position)
            mask = self._dropout_masks(q.shape[:4] + (keys,), q.dtype) if dropped else None
        if fused and lse is not None:
            cpu_attention.backward_recompute(
                dattn.astype(q.dtype, copy=False),
                q,
                k,
                v,
                lse,
                blocks,
                offset,
                self.causal,
                _padding_bias(key_mask),
                dq,
                dk,
                dv,
                mask,
                window,
            )
        elif fused:
            cpu_attention.backward(dattn.astype(q.dtype, copy=False), q, k, v, probs, blocks, dq, dk, dv, mask)
        else:
            recompute = None if lse is None else (lse, self._masks(q, keys, key_mask, offset, window))
            _composed_backward(dattn, q, k, v, probs, blocks, mask, dq, dk, dv, recompute)
        del probs, mask  # a redrawn dropout mask is freed before QKV's backward
        return self._scale_rope_norm_backward_and_qkv(dqkv, dq, dk, rope, norms, qkv_ctx)

    def _scale_rope_norm_backward_and_qkv(self, dqkv, dq, dk, rope, norms, qkv_ctx):
        """dQ and dK back through the query scale's departure from 1/sqrt(d), the rotation and the
        query/key norms (in place in ``dqkv``), then QKV's backward."""
        if self._scale_ratio != 1.0:
            dq *= self._scale_ratio
        if rope is not None:
            dq[...] = F.rope_apply(dq, *_per_row(rope, dq.ndim), inverse=True)
            dk[...] = F.rope_apply(dk, *_per_row(rope, dk.ndim), inverse=True)
        if norms is not None:
            with sum_grads_over(self._comm, [self.q_norm.weight, self.k_norm.weight]):
                dq[...] = self.q_norm.backward(dq, norms[0])
                dk[...] = self.k_norm.backward(dk, norms[1])
        return self.qkv.backward(dqkv, qkv_ctx)


def _slot_window(key_mask, query_slots, keys: int, window: int):
    """A cache whose rows write at slots of their own (``query_slots`` [B] or [1], on the device) says
    nothing to the blocks about where each query is, so its window joins the key mask instead:
    (key mask, 0), with slot j seen by row r only when it is one of the ``window`` last up to
    ``query_slots[r]``."""
    xp = backend.xp_of(query_slots)
    recent = xp.arange(keys)[None, :] > query_slots.reshape(-1, 1) - window
    return (recent if key_mask is None else key_mask.astype(bool) & recent), 0


def _padding_bias(key_mask):
    """The fused kernel's padding mask [B, keys]: 0 for real keys, -inf for padding (None: none)."""
    if key_mask is None:
        return None
    xp = backend.xp_of(key_mask)
    return xp.where(key_mask.astype(bool), 0.0, -xp.inf)


def _scores(q, k_t, rows, keys, bias):
    """Q K^T (+ the additive mask) of one query block."""
    scores = blas.matmul(q[..., rows, :], k_t[..., keys])
    if bias is not None:
        scores += bias[..., rows, keys]
    return scores


def _tile_causal_offset(causal_offset, rows, keys):
    """The causal offset of a block's tile, whose first key is ``keys.start`` (None: not causal)."""
    return None if causal_offset is None else causal_offset + rows.start - keys.start


def statistics_dtype(dtype) -> str:
    """The rows' log-sum-exp are kept in float32 at least: a half-precision one would shift a whole
    row's recomputed softmax by its rounding (bfloat16: up to 0.4%)."""
    return "float64" if dtype.itemsize >= 8 else "float32"


def _composed_forward(q, k, v, attn, blocks, masks, mask, statistics=False):
    """The attention core as whole-array numpy/cupy operations over all heads, block by block
    (the fused CPU kernel's reference, and the path for devices and half dtypes); ``masks``: the
    key-padding bias and the causal offset (``ParallelAttention._masks``), the causal mask applied
    by the softmax. Returns the softmax outputs per block, or with ``statistics`` the rows'
    log-sum-exp [B, hk, g, T]."""
    xp = backend.xp_of(q)
    bias, causal_offset, window = masks
    k_t, v5 = k[:, :, None].swapaxes(-1, -2), v[:, :, None]
    kept = xp.empty(q.shape[:4], dtype=statistics_dtype(q.dtype)) if statistics else []
    for rows, keys in blocks:
        scores = _scores(q, k_t, rows, keys, bias)
        causal = _tile_causal_offset(causal_offset, rows, keys)
        if statistics:  # the softmax in the statistics' dtype (as ``softmax_forward`` widens half ones anyway)
            wide = scores.astype(kept.dtype, copy=False)
            p = F.softmax_forward(wide, causal, window)
            kept[..., rows] = _log_sum_exp(wide, p)
            p = p.astype(scores.dtype, copy=False)
        else:
            p = F.softmax_forward(scores, causal, window)
            kept.append(p)
        if mask is not None:
            p = p * mask[..., rows, keys]
        blas.matmul(p, v5[..., keys, :], out=attn[..., rows, :])
    return kept


def _log_sum_exp(scores, p):
    """Each row's log(sum(exp(scores))) over its visible keys, from its softmax ``p`` without
    another exp: at the row's largest score s, p = exp(0) / sum, so the log-sum-exp is s - log(p).
    +inf for a fully masked row (p all 0), whose recomputed exp(scores - lse) are then 0 too."""
    xp = backend.xp_of(p)
    top = p.argmax(axis=-1)[..., None]
    largest, at_top = xp.take_along_axis(scores, top, -1)[..., 0], xp.take_along_axis(p, top, -1)[..., 0]
    visible = at_top > 0
    return xp.where(visible, largest - xp.log(xp.where(visible, at_top, 1)), xp.inf)


def _recomputed_softmax(q, k_t, rows, keys, recompute):
    """Forward's softmax of one block again, exp(Q K^T + masks - lse), from the rows' log-sum-exp."""
    lse, (bias, causal_offset, window) = recompute
    xp = backend.xp_of(q)
    scores = _scores(q, k_t, rows, keys, bias)
    if causal_offset is not None:
        scores = F.causal_masked(scores, _tile_causal_offset(causal_offset, rows, keys), window)
    wide = scores.astype(lse.dtype, copy=False)
    wide -= lse[..., rows, None]
    return xp.exp(wide, out=wide).astype(scores.dtype, copy=False)


def _composed_backward(dattn, q, k, v, probs, blocks, mask, dq, dk, dv, recompute=None):
    """dQ (through the query scaling) into ``dq``, dK and dV added into theirs; ``recompute`` (lse,
    masks): each block's softmax made again from forward's statistics instead of read from ``probs``."""
    k5, v_t = k[:, :, None], v[:, :, None].swapaxes(-1, -2)
    k_t = k5.swapaxes(-1, -2)
    grouped = q.shape[2] > 1  # several query heads per KV head: their K/V gradients are summed
    for block, (rows, keys) in enumerate(blocks):
        p = probs[block] if recompute is None else _recomputed_softmax(q, k_t, rows, keys, recompute)
        dout = dattn[..., rows, :]
        keep = None if mask is None else mask[..., rows, keys]
        dropped = p if keep is None else p * keep
        dprobs = blas.matmul(dout, v_t[..., keys])
        if keep is not None:
            dprobs *= keep
        dscores = F.softmax_backward(dprobs, p)
        blas.matmul(dscores, k5[..., keys, :], out=dq[..., rows, :])
        kv_grads = (blas.matmul(dscores.swapaxes(-1, -2), q[..., rows, :]), blas.matmul(dropped.swapaxes(-1, -2), dout))
        for grad, total in zip(kv_grads, (dk, dv)):
            total[:, :, keys] += grad.sum(axis=2) if grouped else grad[:, :, 0]
    dq *= 1.0 / math.sqrt(q.shape[-1])
