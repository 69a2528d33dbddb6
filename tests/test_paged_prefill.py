"""A bfloat16 prefill's attention on the paged kernel's rows (``kernels.paged_bf16.prefill``, dispatched by
``serve.kv_cache``'s paged layers): each value the exact causal attention rounded once (or one step
beside it), the same bits at any thread count, and a model's prefill logits those of the gathered
(composed) attention at bfloat16's rounding, right-padded rows, a prefix held before the chunk, GQA and
sliding windows among them; through continuous batching each request's tokens are its own alone, and
one process's at tp = the world size."""

import numpy as np
import pytest
from test_continuous import Request, Script, _alone
from test_continuous import events as events  # noqa: F401, PLC0414 (the fixture, used by its name)
from test_generate import CONFIGS, PROMPTS, larger_weights
from test_half_inference import SAME_PRECISION
from test_paged_kv import GATHERED_HALF, _dtype
from test_threads import thread_count as thread_count  # noqa: F401, PLC0414 (the fixture, used by its name)
from tp_helpers import max_rel_err, tp_and_reference

from hpc_tp.kernels import paged_bf16
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve.blocks import PagedLayout
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.kv_cache import PagedKVCache, PagedView
from hpc_tp.tokenizer import ByteTokenizer


def _needs_kernel():
    if not paged_bf16.AVAILABLE:
        pytest.skip("needs numba and a CPU with avx512_bf16")


# (rows, KV heads, query heads a KV head, head dimension, queries, offset): grouped-query attention of 3,
# a group of 5 with 80 columns (two value tiles), an odd head dimension and odd lengths after a prefix.
PREFILL_SHAPES = [(2, 3, 3, 64, 37, 0), (1, 1, 5, 80, 20, 9), (3, 2, 1, 7, 13, 5)]


def _scattered_prefill(shape, seed=5):
    """q [B, hk, g, T, d] (scaled), pools [hk, 300, d], each row's slots for positions 0 .. offset + T - 1
    scattered through the pool, and lengths: the first row holds every position, the others fewer
    (right padding)."""
    rows, heads, group, d, count, offset = shape
    rng = np.random.default_rng(seed)
    dtype = _dtype("bfloat16")
    k, v = rng.standard_normal((2, heads, 300, d)).astype(dtype)
    q = (rng.standard_normal((rows, heads, group, count, d)) * 0.4).astype(dtype)
    slots = np.stack([rng.permutation(300)[: offset + count] for _ in range(rows)])
    lengths = np.array([offset + count, offset + count - 4, offset + 1])[:rows]
    return q, k, v, slots, offset, lengths


def _exact_prefill(q, k, v, slots, offset, lengths, window):
    """The prefill's causal attention in float64, query by query over its visible slots (zeros for none)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        for t in range(q.shape[3]):
            position = offset + t
            first = max(0, position + 1 - window) if window else 0
            seen = slots[b, first : min(position + 1, lengths[b])]
            if len(seen):
                scores = np.einsum("hgd,hkd->hgk", q[b, :, :, t], k[:, seen])
                p = np.exp(scores - scores.max(axis=-1, keepdims=True))
                out[b, :, :, t] = np.einsum("hgk,hkd->hgd", p / p.sum(axis=-1, keepdims=True), v[:, seen])
    return out


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
@pytest.mark.parametrize("window", [0, 5])
def test_the_prefill_rows_give_the_exact_attention_rounded_once(shape, window):
    """Each value the exact attention of the same bfloat16 inputs rounded once, or the value one step
    beside it (the float32 sums landing across a rounding boundary); into a strided view of the output."""
    _needs_kernel()
    q, k, v, slots, offset, lengths = _scattered_prefill(shape)
    merged = np.zeros((q.shape[0], q.shape[3], q.shape[1], q.shape[2], q.shape[4]), q.dtype)
    out = merged.transpose(0, 2, 3, 1, 4)  # [B, hk, g, T, d] seen in the layer's merged layout
    paged_bf16.prefill(q, k, v, np.asfortranarray(slots), offset, lengths, out, window)
    want = _exact_prefill(q, k, v, slots, offset, lengths, window).astype(q.dtype)
    steps = np.abs(out.view(np.int16).astype(np.int64) - want.view(np.int16).astype(np.int64))
    assert steps.max() <= 1 and (steps == 0).mean() >= 0.9


@pytest.mark.parametrize("shape", PREFILL_SHAPES[:2])
@pytest.mark.parametrize("window", [0, 5])
def test_threads_split_the_prefill_rows_without_changing_a_bit(shape, window, thread_count):
    _needs_kernel()
    q, k, v, slots, offset, lengths = _scattered_prefill(shape)
    results = []
    for count in (1, 2, 3):
        thread_count(count)
        out = np.zeros_like(q)
        paged_bf16.prefill(q, k, v, slots, offset, lengths, out, window)
        results.append(out)
    assert all(np.array_equal(results[0], result) for result in results[1:])
    assert np.isfinite(results[0].astype(np.float64)).all()


def _chunked_prefill(model, tokens, lengths, start, slots):
    """The logits of each row's last token [B, V] for right-padded prompts ``tokens`` [B, T] held to
    ``lengths``, into a fresh pool at ``slots`` [lanes, B, T] (the padding's: the scratch unit's first):
    the first ``start`` tokens in one pass, then the rest over them."""
    cache = PagedKVCache.for_model(model, 60, PagedLayout.of(model.cfg, 4))
    held = np.arange(tokens.shape[1]) < lengths[:, None]
    if start:
        model.infer(tokens[:, :start], np.arange(start), held[:, :start], PagedView(cache, slots[:, :, :start]))
    view = PagedView(cache, slots[:, :, start:], slots if start else None)
    return model.infer(tokens[:, start:], np.arange(start, tokens.shape[1]), held, view, last=lengths - start - 1)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("start", [0, 6])
@pytest.mark.parametrize("name", ["llama-gqa", "llama-window"])
def test_a_model_s_prefill_on_the_rows_equals_the_gathered_attention_and_one_process(name, start, monkeypatch):
    """Right-padded prompts of odd lengths into scattered blocks, in one pass or a second chunk from slot
    ``start`` over the first's, GQA and a sliding window: each row's last logits within one bfloat16
    step of the largest logit of the gathered attention's, every layer's prefill on the rows; at tp =
    the world size, one process's at the same precision (``SAME_PRECISION``)."""
    _needs_kernel()
    calls, prefill = [], paged_bf16.prefill
    monkeypatch.setattr(paged_bf16, "prefill", lambda *args: calls.append(1) or prefill(*args))
    rng = np.random.default_rng(2)
    lengths = start + np.array([13, 5, 9])
    layout = PagedLayout.of(ModelConfig(**CONFIGS[name]), 4)
    units = rng.permutation(np.arange(1, 60))
    slots = np.zeros((layout.lanes, 3, lengths.max()), np.int64)  # padding: the scratch unit's slot 0
    for lane in range(layout.lanes):
        for i, table in enumerate(np.split(units[24 * lane : 24 * (lane + 1)], [6, 12])[:3]):
            slots[lane, i, : lengths[i]] = (table[:, None] * 4 + np.arange(4)).reshape(-1)[: lengths[i]]
    tokens = rng.integers(0, CONFIGS[name]["vocab_size"], (3, lengths.max()))
    logits = []
    for comm in tp_and_reference():
        model = larger_weights(GPTModel(ModelConfig(**CONFIGS[name]), comm, dtype=_dtype("bfloat16"), seed=4))
        calls.clear()
        logits.append(_chunked_prefill(model, tokens, lengths, start, slots))
        assert len(calls) == model.cfg.n_layers * (2 if start else 1)
    with monkeypatch.context() as gather:
        gather.setattr(paged_bf16, "prefills", lambda q, pool: False)
        gathered = _chunked_prefill(model, tokens, lengths, start, slots)
    assert max_rel_err(logits[1], gathered) <= GATHERED_HALF["bfloat16"]
    assert max_rel_err(logits[0], logits[1]) <= SAME_PRECISION["bfloat16"]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["llama-gqa", "llama-window"])
def test_bfloat16_requests_batched_and_chunked_give_their_tokens_alone(name, events, monkeypatch):
    """bfloat16 prompts admitted together into two rows, prefilled in chunks of 4 on the prefill rows:
    each request's greedy tokens are those it gives alone, at tp = the world size."""
    _needs_kernel()
    calls, prefill = [], paged_bf16.prefill
    monkeypatch.setattr(paged_bf16, "prefill", lambda *args: calls.append(1) or prefill(*args))
    tp, _ = tp_and_reference()
    model = larger_weights(GPTModel(ModelConfig(**CONFIGS[name]), tp, dtype=_dtype("bfloat16"), seed=4))
    engine = Engine(model, ByteTokenizer())
    requests = [Request(PROMPTS[0] + PROMPTS[2], 5), Request(PROMPTS[1], 4), Request(PROMPTS[2], 6)]
    batcher = ContinuousBatcher(engine, 2, chunk_tokens=4)
    for request in requests:
        events.watch(request)
    batcher.run(Script([(1, r) for r in requests]) if tp.rank == 0 else None)
    assert calls
    for request in requests:
        out, _ = _alone(engine, request, events)
        if tp.rank == 0:
            assert request.done[0].ids == out[0][0].ids
