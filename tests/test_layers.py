"""Every tensor-parallel layer at tp = world size gives the numbers of the one-process layer:
outputs, input gradients and every parameter gradient (float64, relative error <= 1e-10),
on ragged shapes (odd batch, sequence 7, vocab 37 that no tp divides)."""

import numpy as np
import pytest
from tp_helpers import assert_grads_match, max_rel_err, same_random, tp_and_reference

from hpc_tp.models.config import ModelConfig
from hpc_tp.models.init import initialize
from hpc_tp.nn import attention
from hpc_tp.nn.attention import ParallelAttention
from hpc_tp.nn.block import TransformerBlock
from hpc_tp.nn.mlp import ParallelMLP
from hpc_tp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)
from hpc_tp.tensor_parallel.mappings import local_chunk

pytestmark = pytest.mark.mpi(min_size=1)
B, T, H = 3, 7, 24
TOL = 1e-10


def _pair(build):
    tp, ref = tp_and_reference()
    par, one = build(tp), build(ref)
    for m in (par, one):
        initialize(m, std=0.3, n_layers=1, seed=5)
    return tp, par, one


def _check(tp, par, one, x, out_sharded=False, in_sharded=False, call=lambda m, x: m.forward(x)):
    y_ref, ctx_ref = call(one, x)
    y_par, ctx_par = call(par, local_chunk(x, tp) if in_sharded else x)
    full = tp.all_gather(y_par, axis=y_par.ndim - 1) if out_sharded else y_par
    assert max_rel_err(full, y_ref) <= TOL
    dy = same_random(11, *y_ref.shape)
    dx_ref = one.backward(dy, ctx_ref)
    dx_par = par.backward(local_chunk(dy, tp).copy() if out_sharded else dy.copy(), ctx_par)
    if dx_ref is not None:
        dx_full = tp.all_gather(dx_par, axis=dx_par.ndim - 1) if in_sharded else dx_par
        assert max_rel_err(dx_full, dx_ref) <= TOL
    assert_grads_match(par, one, tp, TOL)


@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear(gather_output):
    tp, par, one = _pair(lambda c: ColumnParallelLinear(H, 8 * 4, c, gather_output=gather_output))
    _check(tp, par, one, same_random(1, B, T, H), out_sharded=not gather_output)


@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear(input_is_parallel):
    tp, par, one = _pair(lambda c: RowParallelLinear(8 * 4, H, c, input_is_parallel=input_is_parallel))
    _check(tp, par, one, same_random(2, B, T, 32), in_sharded=input_is_parallel)


def test_vocab_parallel_embedding():
    tp, par, one = _pair(lambda c: VocabParallelEmbedding(37, H, c))
    ids = np.random.default_rng(3).integers(0, 37, (B, T))
    _check(tp, par, one, ids)


def test_vocab_parallel_cross_entropy_padding_never_leaks():
    tp, ref = tp_and_reference()
    V = 37
    logits = same_random(4, B * T, V) * 3
    targets = np.random.default_rng(4).integers(0, V, B * T)
    targets[::5] = -100
    ref_ce, par_ce = VocabParallelCrossEntropy(V, ref), VocabParallelCrossEntropy(V, tp)
    loss_ref, n_ref, ctx_ref = ref_ce.forward(logits, targets)
    local = -(-V // tp.size)
    padded = np.concatenate([logits, np.full((B * T, local * tp.size - V), 1e6)], axis=1)  # huge padding logits
    mine = padded[:, tp.rank * local : (tp.rank + 1) * local]
    loss_par, n_par, ctx_par = par_ce.forward(mine, targets)
    # the textbook formula, for the reference itself
    keep = targets != -100
    z = logits[keep]
    expected = np.sum(
        np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1) - z[np.arange(len(z)), targets[keep]]
    )
    assert abs(loss_ref - expected) <= 1e-12 * abs(expected)
    assert n_par == n_ref == keep.sum() and abs(loss_par - loss_ref) <= TOL * abs(loss_ref)
    g_ref = ref_ce.backward(ctx_ref, 0.5)
    g_par = par_ce.backward(ctx_par, 0.5)
    g_full = tp.all_gather(g_par, axis=1)
    assert np.all(g_full[:, V:] == 0), "padding columns got gradient"
    assert max_rel_err(g_full[:, :V], g_ref) <= TOL
    assert np.all(g_ref[~keep] == 0)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cross_entropy_row_blocks_and_overwrite_keep_the_bits(dtype, monkeypatch):
    """Blocks of one row, of three, or all rows at once, into a copy or into the logits' own buffer:
    the same loss and gradient to the last bit (numpy's operations per row are the same)."""
    from hpc_tp.tensor_parallel import vocab

    tp, _ = tp_and_reference()
    logits = (same_random(5, B * T, 29) * 4).astype(dtype)
    targets = np.random.default_rng(5).integers(0, 29, B * T)
    targets[::3] = -100
    local = -(-29 // tp.size)
    mine = np.ascontiguousarray(
        np.pad(logits, ((0, 0), (0, local * tp.size - 29)))[:, tp.rank * local : (tp.rank + 1) * local]
    )
    results = []
    for block_bytes, overwrite in ((1 << 40, False), (1, False), (3 * local * mine.itemsize, True)):
        monkeypatch.setattr(vocab, "ROW_BLOCK_BYTES", block_bytes)
        ce, given = VocabParallelCrossEntropy(29, tp), mine.copy()
        loss, count, ctx = ce.forward(given, targets, overwrite=overwrite)
        grad = ce.backward(ctx, 0.25)
        assert (grad is given.reshape(grad.shape) or np.shares_memory(grad, given)) == overwrite
        results.append((loss, count, grad.copy()))
    for loss, count, grad in results[1:]:
        assert (loss, count) == results[0][:2] and np.array_equal(grad, results[0][2])


ATTN_CASES = {
    "mha-causal": dict(n_heads=4, n_kv_heads=4, causal=True),
    "gqa-kv2": dict(n_heads=4, n_kv_heads=2, causal=True),  # kv replicated when tp = 4
    "mqa-rope": dict(n_heads=4, n_kv_heads=1, causal=True, rope_theta=10000.0),
    "bidirectional-padded": dict(n_heads=4, n_kv_heads=4, causal=False, padded=True),
    "gqa-sliding-window": dict(n_heads=4, n_kv_heads=2, causal=True, rope_theta=10000.0, window=3),
    "sliding-window-padded": dict(n_heads=4, n_kv_heads=4, causal=True, window=2, padded=True),
}


@pytest.fixture(params=[None, 3], ids=["one-query-block", "query-blocks-of-3"])
def query_block(request, monkeypatch):
    """Causal attention in blocks of 3 queries (7 = 3 + 3 + 1) as well as the default (one block at T = 7)."""
    if request.param:
        monkeypatch.setattr(attention, "QUERY_BLOCK", request.param)
    return request.param


@pytest.mark.parametrize("case", ATTN_CASES, ids=str)
def test_parallel_attention(case, query_block):
    opts = dict(ATTN_CASES[case])
    padded = opts.pop("padded", False)
    key_mask = None
    if padded:
        key_mask = np.ones((B, T), dtype=np.int64)
        key_mask[0, 5:] = 0
        key_mask[2, 2:] = 0
    tp, par, one = _pair(lambda c: ParallelAttention(H, comm=c, **opts))
    _check(tp, par, one, same_random(6, B, T, H), call=lambda m, x: m.forward(x, key_mask))


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "swiglu"])
def test_parallel_mlp(activation):
    tp, par, one = _pair(lambda c: ParallelMLP(H, 40, c, activation))
    _check(tp, par, one, same_random(7, B, T, H))


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_transformer_block_with_dropout(style, query_block):
    extra = (
        dict(norm="rmsnorm", activation="swiglu", position="rope", n_kv_heads=2, bias=False) if style == "llama" else {}
    )
    cfg = ModelConfig(vocab_size=37, hidden=H, n_heads=4, ffn_hidden=40, dropout=0.1, attn_dropout=0.2, **extra)
    from hpc_tp.tensor_parallel.random import DropoutRNG

    def build(c):
        return TransformerBlock(cfg, c, layer_id=3, rng=DropoutRNG(9))

    tp, par, one = _pair(build)
    # dropout masks are keyed by site and global head, so tp=N drops what tp=1 drops
    _check(tp, par, one, same_random(8, B, T, H))


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("window", [0, 1, 50])
@pytest.mark.parametrize(
    "q_len, k_len, offset", [(7, 7, 0), (5, 12, 7), (200, 200, 0), (130, 140, 10), (1100, 1100, 0)]
)
def test_query_blocks_see_exactly_the_causal_keys(q_len, k_len, offset, window, on_device):
    """Each block's keys run from its first query's window start to its last query's position."""
    rows = []
    for block, seen in attention.query_blocks(q_len, k_len, offset, True, on_device, window):
        rows += list(range(block.start, block.stop))
        assert seen.stop == min(k_len, block.stop + offset)  # the block's last query sees keys up to its position
        assert seen.start == (max(0, block.start + offset - window + 1) if window else 0)
        assert block.stop - block.start <= attention.query_block(on_device)
    assert rows == list(range(q_len))
    if q_len > attention.query_block(on_device):
        assert attention.saved_score_elements(q_len, k_len, True, on_device) < q_len * k_len
    if window == 50 and q_len > 2 * attention.query_block(on_device):  # whole tiles outside the window skipped
        block = attention.query_block(on_device)
        assert attention.saved_score_elements(q_len, k_len, True, on_device, window) <= q_len * (window + block)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("window", [0, 2])
def test_softmax_causal_offset_is_the_added_bias_to_the_bit(dtype, offset, window):
    from hpc_tp.kernels import functional as F

    scores = np.random.default_rng(0).standard_normal((2, 3, 6, 9)).astype(dtype)
    bias = attention.attention_bias(1, 6, 9, True, None, offset, dtype, window)[0]  # [1, 1, 6, 9]
    masked = F.softmax_forward(scores, causal_offset=offset, window=window)
    assert np.array_equal(masked, F.softmax_forward(scores + bias))
    if window:  # query i sees keys i + offset - 1 and i + offset only
        seen = np.abs(np.subtract.outer(np.arange(6) + offset, np.arange(9)) - 0.5) < 1
        assert ((masked != 0) == seen).all()
