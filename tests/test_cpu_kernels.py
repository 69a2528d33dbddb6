"""The fused CPU kernels (numba, hpc_tp/kernels/cpu_kernels.py) give the composed numpy code's numbers:
forward outputs, saved tensors and every gradient, float64 within 1e-12 and float32 within 1e-5,
on ragged shapes, with and without a bias; a forward on one path feeds a backward on the other."""

import numpy as np
import pytest

from hpc_tp.backend import resolve_dtype
from hpc_tp.kernels import cpu_kernels
from hpc_tp.kernels import functional as F

pytestmark = pytest.mark.skipif(not cpu_kernels.ENABLED, reason="numba is not installed (or HPC_TP_CPU_KERNELS=0)")
TOL = {"float64": 1e-12, "float32": 1e-5}
SHAPE = (3, 7, 24)


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, "float64") - b)) / max(np.max(np.abs(b)), 1e-30))


def both_paths(monkeypatch, call):
    """(fused, composed) results of ``call()``."""
    fused = call()
    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    composed = call()
    monkeypatch.setattr(cpu_kernels, "ENABLED", True)
    return fused, composed


def assert_close(got, want, dtype):
    if isinstance(want, tuple):
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, dtype)
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) <= TOL[dtype]


def arrays(dtype, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("norm", ["layernorm", "layernorm-no-bias", "rmsnorm"])
def test_norms(monkeypatch, dtype, norm):
    x, dy, gain, bias = arrays(dtype, SHAPE, SHAPE, SHAPE[-1:], SHAPE[-1:])
    if norm == "rmsnorm":
        forward, backward = (lambda: F.rmsnorm_forward(x, gain, 1e-5)), F.rmsnorm_backward
    else:
        b = None if norm.endswith("no-bias") else bias
        forward, backward = (lambda: F.layernorm_forward(x, gain, b, 1e-5)), F.layernorm_backward
    (y, saved), (y_ref, saved_ref) = both_paths(monkeypatch, forward)
    assert_close((y, *saved), (y_ref, *saved_ref), dtype)
    assert cpu_kernels.fused(dy)
    # The fused backward from the composed forward's saved tensors, and the other way round.
    got, want = backward(dy, gain, saved_ref), both_paths(monkeypatch, lambda: backward(dy, gain, saved))[1]
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gelu_tanh_across_chunks(monkeypatch, dtype):
    monkeypatch.setattr(cpu_kernels, "CHUNK", 100)  # 504 elements: five chunks, the last one short
    x, dy = arrays(dtype, SHAPE, SHAPE, seed=1)
    (y, saved), (y_ref, saved_ref) = both_paths(monkeypatch, lambda: F.gelu_tanh_forward(x))
    assert_close((y, *saved), (y_ref, *saved_ref), dtype)
    assert_close(*both_paths(monkeypatch, lambda: F.gelu_tanh_backward(dy, saved)), dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_softmax_with_masked_rows(monkeypatch, dtype):
    scores, dp = arrays(dtype, SHAPE, SHAPE, seed=2)
    scores[0, 2] = -np.inf  # a fully masked row: zeros, and a zero gradient
    scores[1, 3, 5:] = -np.inf  # a causal-style row
    p, p_ref = both_paths(monkeypatch, lambda: F.softmax_forward(scores))
    assert_close(p, p_ref, dtype)
    assert not p[0, 2].any() and not p[1, 3, 5:].any()
    got, want = both_paths(monkeypatch, lambda: F.softmax_backward(dp, p))
    assert_close(got, want, dtype)
    assert not got[0, 2].any()


def test_non_contiguous_inputs_take_a_copy_not_the_wrong_strides(monkeypatch):
    (x,) = arrays("float64", (3, 24, 7), seed=3)
    view = x.swapaxes(1, 2)  # [3, 7, 24], not C-contiguous: the composed path runs
    assert not cpu_kernels.fused(view)
    dy = np.ascontiguousarray(arrays("float64", view.shape, seed=4)[0])
    y, saved = F.gelu_tanh_forward(np.ascontiguousarray(view))
    assert_close(*both_paths(monkeypatch, lambda: F.gelu_tanh_backward(dy, (view, saved[1]))), "float64")


def test_only_float32_and_float64_numpy_arrays_are_fused():
    assert cpu_kernels.fused(np.zeros(4, "float32")) and cpu_kernels.fused(np.zeros(4))
    assert not cpu_kernels.fused(np.zeros(4, "float16"))
    assert not cpu_kernels.fused([0.0, 1.0])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_scatter_add_rows_matches_add_at_bit_for_bit(monkeypatch, dtype):
    """Repeated rows summed in token order, as numpy's add.at does; values of another dtype cast;
    [B, T] rows with [B, T, H] values (BERT's token types) as well as flat ones."""
    table, values = arrays(dtype, (9, 24), (4, 5, 24))
    rows = np.random.default_rng(1).integers(0, 9, (4, 5))
    rows[0, :3] = 2  # one row hit several times
    for r, v in ((rows, values), (rows.reshape(-1), values.reshape(-1, 24).astype("float64"))):
        fused, composed = both_paths(monkeypatch, lambda: _scattered(table, r, v))
        assert fused.dtype == table.dtype and np.array_equal(fused, composed)


def _scattered(table, rows, values):
    out = table.copy()
    F.scatter_add_rows(out, rows, values)
    return out


@pytest.mark.parametrize("bad", [9, -1])
def test_scatter_add_rows_refuses_a_row_outside_the_table(bad):
    table = np.zeros((9, 4))
    with pytest.raises(IndexError):
        F.scatter_add_rows(table, np.array([0, bad]), np.ones((2, 4)))


def test_scatter_add_rows_leaves_other_shapes_to_add_at():
    """Values that do not match the rows (broadcast ones, a wider row) never reach the unchecked loop."""
    table = np.zeros((9, 4))
    F.scatter_add_rows(table, np.array([0, 1, 1]), np.ones(4))  # broadcast: add.at's meaning
    assert table[0].tolist() == [1.0] * 4 and table[1].tolist() == [2.0] * 4 and table[2:].sum() == 0
    with pytest.raises(ValueError):
        F.scatter_add_rows(table, np.array([0, 1]), np.ones((2, 6)))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("norm", ["layernorm", "layernorm-no-bias", "rmsnorm"])
def test_residual_sum_and_norm_in_one_pass(monkeypatch, dtype, norm):
    """The sum is numpy's bit for bit and the norm the fused norm's: a block's numbers do not move."""
    branch, residual, gain, bias = arrays(dtype, SHAPE, SHAPE, SHAPE[-1:], SHAPE[-1:], seed=5)
    center, bias = norm.startswith("layernorm"), (bias if norm == "layernorm" else None)
    total, y, saved = F.add_norm_forward(branch.copy(), residual, gain, bias, 1e-5, center)
    want = branch + residual
    norm_of = (
        (lambda x: F.layernorm_forward(x, gain, bias, 1e-5)) if center else (lambda x: F.rmsnorm_forward(x, gain, 1e-5))
    )
    y_ref, saved_ref = norm_of(want)
    assert np.array_equal(total, want)
    for got, ref in zip((y, *saved), (y_ref, *saved_ref), strict=True):
        assert np.array_equal(got, ref)
    composed = both_paths(monkeypatch, lambda: F.add_norm_forward(branch.copy(), residual, gain, bias, 1e-5, center))[1]
    assert_close((total, y, *saved), (composed[0], composed[1], *composed[2]), dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_swiglu_gives_the_composed_bits_and_what_backward_keeps(monkeypatch, dtype):
    (h,) = arrays(dtype, (3, 7, 2 * 24), seed=6)
    h[0, 0, :3] = [-200.0, 200.0, 0.0]  # exp overflows to inf, underflows to 0
    with np.errstate(over="ignore"):
        fused, composed = both_paths(monkeypatch, lambda: F.gated_forward(h, 24, F.silu_forward))
    (inner, ((gate, sig), act, up)), (inner_ref, ((gate_ref, sig_ref), act_ref, up_ref)) = fused, composed
    for got, ref in ((inner, inner_ref), (gate, gate_ref), (sig, sig_ref), (act, act_ref), (up, up_ref)):
        assert got.dtype == ref.dtype and np.array_equal(got, ref)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("per_row", [False, True])
def test_rope_rotation_gives_the_composed_bits(monkeypatch, dtype, per_row):
    """Q heads as attention sees them (a strided view [B, hk, g, T, d] of the QKV product), both
    directions, with positions shared by the rows or each row's own, and scaled after the rotation."""
    b, hk, g, t, d = 3, 2, 2, 5, 8
    (qkv,) = arrays(dtype, (b, t, hk * g * d + 16), seed=7)
    q = qkv[..., : hk * g * d].reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)
    positions = np.arange(t) + 3 if not per_row else np.array([[5, 9, 2, 7, 11]]) + np.arange(b)[:, None]
    inv_freq = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    cos, sin = F.rope_tables(positions, inv_freq, dtype)
    if per_row:
        cos, sin = cos[:, None, None], sin[:, None, None]
    for inverse, scale in ((False, 1.0), (True, 1.0), (False, 0.3)):  # 0.3: attention's query scale
        got, want = both_paths(monkeypatch, lambda: F.rope_apply(q, cos, sin, inverse, scale))
        assert got.flags.c_contiguous and got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_write_slots_matches_fancy_indexing(dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = resolve_dtype(dtype)
    k_pool, v_pool = arrays(dtype, (2, 20, 8), (2, 20, 8), seed=8)
    (qkv,) = arrays(dtype, (3, 2, 3 * 2 * 8), seed=9)  # [B, T, ...]: K and V heads as strided views
    k = qkv[..., 16:32].reshape(3, 2, 2, 8).transpose(0, 2, 1, 3)
    v = qkv[..., 32:].reshape(3, 2, 2, 8).transpose(0, 2, 1, 3)
    slots = np.array([[4, 5], [17, 0], [9, 12]])
    want_k, want_v = k_pool.copy(), v_pool.copy()
    want_k[:, slots], want_v[:, slots] = k.swapaxes(0, 1), v.swapaxes(0, 1)
    other = np.float32 if dtype == np.float64 else np.float64
    assert cpu_kernels.can_write_slots(k_pool, k, v) and not cpu_kernels.can_write_slots(k_pool, k, v.astype(other))
    cpu_kernels.write_slots(k_pool, v_pool, slots, k, v)
    assert np.array_equal(k_pool, want_k) and np.array_equal(v_pool, want_v)
    with pytest.raises(IndexError):
        cpu_kernels.write_slots(k_pool, v_pool, np.array([[20, 0]] * 3), k, v)
