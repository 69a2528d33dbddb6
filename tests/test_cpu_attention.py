"""The fused attention core (hpc_tp/kernels/cpu_attention.py: numba loop, MKL tiles) gives the composed
numpy path's numbers: output, saved softmax and dQ/dK/dV, float64 within 1e-12 and float32 within
1e-5, on strided views of a QKV buffer, grouped-query heads, a cache offset, key padding (fully
masked rows included), attention dropout, a sliding window and no mask; both paths give the same numbers again when
forward keeps only the rows' log-sum-exp and backward recomputes the softmax from it (selective
recomputation); a whole attention layer (with and without rope, with dropout) is the same
either way; and the tiles split over threads (forward) or kv heads (backward) give the same bits at
1, 2 and 3 threads."""

import numpy as np
import pytest
from test_threads import thread_count as thread_count  # noqa: F401, PLC0414 (the fixture, used by its name)

from hpc_tp.backend import resolve_dtype
from hpc_tp.comm.mpi import world
from hpc_tp.kernels import cpu_attention, mkl_jit
from hpc_tp.nn import attention
from hpc_tp.nn.attention import ParallelAttention, attention_bias, query_blocks
from hpc_tp.tensor_parallel.random import DropoutRNG

pytestmark = pytest.mark.skipif(not mkl_jit.AVAILABLE, reason="needs numba and MKL (hpc_tp[mkl])")
TOL = {"float64": 1e-12, "float32": 1e-5}


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, "float64") - b)) / max(np.max(np.abs(b)), 1e-30))


def heads(buffer, width, hk, g, d):
    """[B, hk, g, T, d] view of columns [width * ..., ...) of a [B, T, C] buffer."""
    b, t, _ = buffer.shape
    return buffer[..., width : width + hk * g * d].reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)


def inputs(dtype, b, hk, g, t, keys, d, dropout=0.0, seed=0):
    """Q (a strided view, as the layer has it), K, V, dO and a dropout keep mask (or None)."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((b, t, hk * g * d)).astype(dtype)
    q = heads(qkv, 0, hk, g, d)
    k, v = (rng.standard_normal((b, hk, keys, d)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    keep = None if not dropout else ((rng.random((b, hk, g, t, keys)) >= dropout) / (1 - dropout)).astype(dtype)
    return q, k, v, dout, keep


def core(fused, statistics, q, k, v, dout, keep, causal, offset, key_mask, window=0):
    """(out, what forward kept, dq, dk, dv) on one path; ``statistics``: the selective
    recomputation's (forward keeps the rows' log-sum-exp, backward recomputes the softmax)."""
    (b, hk, g, t, d), keys, dtype = q.shape, k.shape[2], q.dtype
    blocks = query_blocks(t, keys, offset, causal, window=window)
    out = heads(np.empty((b, t, hk * g * d), dtype), 0, hk, g, d)
    dq, dk, dv = np.empty_like(q), np.zeros_like(k), np.zeros_like(v)
    if fused:
        key_bias = None if key_mask is None else np.where(key_mask.astype(bool), 0.0, -np.inf)
        kept = cpu_attention.forward(q, k, v, out, blocks, offset, causal, key_bias, keep, statistics, window)
        if statistics:
            cpu_attention.backward_recompute(
                dout, q, k, v, kept, blocks, offset, causal, key_bias, dq, dk, dv, keep, window
            )
        else:
            cpu_attention.backward(dout, q, k, v, kept, blocks, dq, dk, dv, keep)
            kept = [
                p.reshape(b, hk, g, rows.stop - rows.start, seen.stop - seen.start)
                for p, (rows, seen) in zip(np.split(kept.reshape(b, hk, g, -1), _tile_ends(blocks), axis=-1), blocks)
            ]
    else:
        masks = (
            None if key_mask is None else attention_bias(b, t, keys, False, key_mask, offset, dtype),
            offset if causal else None,
            window,
        )
        kept = attention._composed_forward(q, k, v, out, blocks, masks, keep, statistics)
        attention._composed_backward(
            dout, q, k, v, None if statistics else kept, blocks, keep, dq, dk, dv, (kept, masks) if statistics else None
        )
        if causal and not statistics:  # the softmax's causal mask is the added -inf bias it replaces, to the bit
            whole = attention_bias(b, t, keys, True, key_mask, offset, dtype, window)
            by_bias = attention._composed_forward(q, k, v, np.empty_like(out), blocks, (whole, None, 0), keep)
            assert all(np.array_equal(x, y) for x, y in zip(kept, by_bias))
    return out, kept, dq, dk, dv


def both_cores(dtype, b, hk, g, t, keys, d, causal, offset, key_mask, dropout=0.0, seed=0, window=0):
    q, k, v, dout, keep = inputs(dtype, b, hk, g, t, keys, d, dropout, seed)
    return [core(fused, False, q, k, v, dout, keep, causal, offset, key_mask, window) for fused in (True, False)]


def _tile_ends(blocks):
    return np.cumsum([(rows.stop - rows.start) * (seen.stop - seen.start) for rows, seen in blocks])[:-1]


CASES = {
    "causal, 4 blocks, last one short, grouped-query": (2, 2, 3, 200, 200, 8, True, 0, None),
    "causal with attention dropout": (2, 2, 2, 130, 130, 8, True, 0, "dropout"),
    "causal with a cache offset and padding": (2, 2, 2, 5, 37, 8, True, 32, "padded"),
    "bidirectional with padding": (3, 1, 2, 70, 70, 16, False, 0, "padded"),
    "bidirectional, no mask": (2, 3, 1, 64, 64, 4, False, 0, None),
    "sliding window of 50 over 4 blocks": (2, 2, 3, 200, 200, 8, True, 0, None, 50),
    "sliding window with dropout": (2, 2, 2, 130, 130, 8, True, 0, "dropout", 7),
    "sliding window with a cache offset and padding": (2, 2, 2, 5, 37, 8, True, 32, "padded", 3),
    "sliding window wider than the sequence": (1, 1, 2, 70, 70, 8, True, 0, None, 500),
}


def case(name):
    """A case's parameters, its sliding window last (0 where it has none)."""
    return (*CASES[name], 0)[:10]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", CASES)
def test_fused_core_matches_composed(dtype, name):
    b, hk, g, t, keys, d, causal, offset, padding, window = case(name)
    key_mask, dropout = None, 0.3 if padding == "dropout" else 0.0
    if padding == "padded":
        key_mask = (np.random.default_rng(1).random((b, keys)) > 0.3).astype("int64")
        key_mask[0, :] = 0  # every key of sequence 0 is padding: its rows are fully masked
    fused, composed = both_cores(dtype, b, hk, g, t, keys, d, causal, offset, key_mask, dropout, window=window)
    out, probs, dq, dk, dv = fused
    for got, want in zip((out, *probs, dq, dk, dv), (composed[0], *composed[1], *composed[2:])):
        assert got.shape == want.shape and rel_err(got, want) <= TOL[dtype]
    if padding == "padded":
        assert not out[0].any() and not dq[0].any() and not dk[0].any() and not dv[0].any()


def reference_lse(q, k, causal, offset, key_mask, window=0):
    """log(sum(exp(scores))) of each query row over the keys it may see, whole-array numpy; -inf
    for a row that may see none."""
    (b, _, _, t, _), keys = q.shape, k.shape[2]
    scores = np.einsum("bhgtd,bhkd->bhgtk", q.astype("float64"), k.astype("float64"))
    if causal or key_mask is not None:
        scores = scores + attention_bias(b, t, keys, causal, key_mask, offset, "float64", window)
    top = scores.max(axis=-1, keepdims=True)
    shift = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return (shift + np.log(np.exp(scores - shift).sum(axis=-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", CASES)
def test_recomputing_from_row_statistics_matches_the_kept_softmax(name, dtype, fused):
    """Selective recomputation's forward keeps each row's log-sum-exp ([B, hk, g, T], +inf for a
    fully masked row) and its backward rebuilds every tile from it: the output and dQ, dK, dV equal
    the path that keeps the softmax, and fully masked rows still give zeros, not NaN."""
    b, hk, g, t, keys, d, causal, offset, padding, window = case(name)
    key_mask, dropout = None, 0.3 if padding == "dropout" else 0.0
    if padding == "padded":
        key_mask = (np.random.default_rng(1).random((b, keys)) > 0.3).astype("int64")
        key_mask[0, :] = 0
    q, k, v, dout, keep = inputs(dtype, b, hk, g, t, keys, d, dropout)
    out, _, *grads = core(fused, False, q, k, v, dout, keep, causal, offset, key_mask, window)
    again, lse, *again_grads = core(fused, True, q, k, v, dout, keep, causal, offset, key_mask, window)
    assert lse.shape == q.shape[:4] and lse.dtype == q.dtype
    want = reference_lse(q, k, causal, offset, key_mask, window)
    masked = np.isneginf(want)
    assert np.array_equal(np.isposinf(lse), masked) and masked.any() == (padding == "padded")
    assert np.max(np.abs(lse[~masked] - want[~masked])) <= TOL[dtype] * np.max(np.abs(want[~masked]))
    for got, expected in zip((again, *again_grads), (out, *grads)):
        assert np.isfinite(got).all() and rel_err(got, expected) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
def test_half_precision_recomputation_keeps_float32_statistics(name, dtype):
    """Half dtypes run the composed path, whose softmax is computed in float32: the rows'
    log-sum-exp are kept in float32 (a half one would shift whole rows), forward's output is
    unchanged and the gradients differ from keeping the softmax by less than the dtype's rounding."""
    b, hk, g, t, keys, d, causal, offset, padding, window = case(name)
    key_mask, dropout = None, 0.3 if padding == "dropout" else 0.0
    if padding == "padded":
        key_mask = (np.random.default_rng(1).random((b, keys)) > 0.3).astype("int64")
        key_mask[0, :] = 0
    arrays = [
        None if a is None else a.astype(resolve_dtype(dtype)) for a in inputs("float32", b, hk, g, t, keys, d, dropout)
    ]
    out, _, *grads = core(False, False, *arrays, causal, offset, key_mask, window)
    again, lse, *again_grads = core(False, True, *arrays, causal, offset, key_mask, window)
    assert lse.dtype == np.float32 and np.array_equal(again, out)
    for got, want in zip(again_grads, grads):
        assert np.isfinite(got.astype("float32")).all() and rel_err(got, want.astype("float64")) <= 2e-3


@pytest.mark.parametrize("statistics", [False, True], ids=["kept softmax", "recomputed"])
@pytest.mark.parametrize(
    "b, t, offset, dropout, window",
    [(1, 200, 0, 0.0, 0), (2, 130, 0, 0.3, 7), (2, 5, 32, 0.0, 0)],
    ids=["one sequence", "dropout and a window", "a cache offset"],
)
def test_threads_split_the_tiles_without_changing_a_bit(b, t, offset, dropout, window, statistics, thread_count):
    """Forward's tiles split by their work, backward's by kv head (a head's tiles all add into its dK
    and dV): output, what forward keeps and dQ, dK, dV are the same bits at 1, 2 and 3 threads, with
    3 kv heads (one sequence's split unevenly over 2 threads) and tiles of unequal sizes."""
    q, k, v, dout, keep = inputs("float32", b, 3, 2, t, t + offset, 8, dropout)
    results = []
    for count in (1, 2, 3):
        thread_count(count)
        out, kept, *grads = core(True, statistics, q, k, v, dout, keep, True, offset, None, window)
        results.append([out, kept if statistics else np.concatenate([p.ravel() for p in kept]), *grads])
    assert all(np.array_equal(x, y) for result in results[1:] for x, y in zip(results[0], result, strict=True))


def test_only_views_mkl_can_read_are_fused():
    x = np.zeros((2, 3, 4, 8))
    assert cpu_attention.supported(x, x[:, :, ::2], x.astype("float32").astype("float64"))
    assert not cpu_attention.supported(x, x.astype("float32"))  # one dtype
    assert not cpu_attention.supported(x.astype("float16"))
    assert not cpu_attention.supported(x[..., ::2])  # the head dimension must be unit-stride
    assert not cpu_attention.supported(x[:, ::-1])  # negative strides
    assert not cpu_attention.supported(np.broadcast_to(x[:, :, :1], x.shape))  # rows overlap (stride 0)
    assert not cpu_attention.supported([[0.0]])


@pytest.mark.parametrize("rope, dropout", [(None, 0.0), (10000.0, 0.0), (None, 0.25)])
def test_attention_layer_is_the_same_on_both_paths(monkeypatch, rope, dropout):
    """Forward output, input gradient and every parameter gradient of a grouped-query layer (the K
    bias gradient is zero up to rounding: a bias on every key shifts a row's scores by a constant)."""
    rng = np.random.default_rng(2)
    layer = ParallelAttention(48, 6, 2, world(), rope_theta=rope, dropout=dropout, rng=DropoutRNG(5), dtype="float64")
    for _, p in layer.named_parameters():
        p.data[...] = rng.standard_normal(p.data.shape) * 0.2
    x, dy = rng.standard_normal((2, 90, 48)), rng.standard_normal((2, 90, 48))

    def run():
        for _, p in layer.named_parameters():
            p.grad[...] = 0.0
        y, ctx = layer.forward(x)
        dx = layer.backward(dy, ctx)
        return [y, dx] + [p.grad.copy() for _, p in layer.named_parameters()]

    fused = run()
    monkeypatch.setattr(cpu_attention, "supported", lambda *arrays: False)
    for got, want in zip(fused, run(), strict=True):
        assert np.max(np.abs(got - want)) <= 1e-12 * max(1.0, np.max(np.abs(want)))


def test_a_key_mask_for_every_sequence_is_broadcast_and_a_wrong_one_refused(monkeypatch):
    """A [1, keys] padding mask applies to every sequence on both paths; a mask of the wrong
    length raises on the fused path as numpy's broadcasting does on the composed one (the numba
    kernel reads the mask without bounds checks)."""
    rng = np.random.default_rng(3)
    layer = ParallelAttention(48, 6, 6, world(), causal=False, dtype="float64")
    for _, p in layer.named_parameters():
        p.data[...] = rng.standard_normal(p.data.shape) * 0.2
    x = rng.standard_normal((4, 30, 48))
    key_mask = (rng.random((1, 30)) > 0.3).astype("int64")
    fused, _ = layer.forward(x, key_mask=key_mask)
    with pytest.raises(ValueError):
        layer.forward(x, key_mask=key_mask[:, :10])
    monkeypatch.setattr(cpu_attention, "supported", lambda *arrays: False)
    composed, _ = layer.forward(x, key_mask=key_mask)
    assert np.max(np.abs(fused - composed)) <= 1e-12 * np.max(np.abs(composed))
