"""The device's fused attention (``kernels.flash_attention``) proved on the CPU: its numpy emulation,
tile by tile with small tiles, against the composed attention core in float64 (forward, the
log-sum-exp, dQ, dK, dV), with causal, key-padding and sliding-window masks, grouped-query heads,
a query offset (decoding after a cache) and head sizes that fill a tile partly. The composed reference and the
cases are ``gpu_check``'s, which holds the CUDA kernels to the same on a device. The CUDA source is
compiled with NVRTC in tests/test_gpu.py, and run against the composed path on a device there and in
``make gpu-check``."""

import numpy as np
import pytest
from tp_helpers import max_rel_err

from hpc_tp.bench.gpu_check import attention_case, composed_attention
from hpc_tp.kernels import flash_attention as FA
from hpc_tp.kernels import flash_emulation as E

TOL = 1e-12


CASES = {
    "causal": dict(shape=(2, 2, 1, 13, 13, 8), q_offset=0, causal=True),
    "gqa padded causal": dict(shape=(2, 2, 3, 11, 11, 5), q_offset=0, causal=True, padded=True),
    "padded, not causal": dict(shape=(2, 1, 2, 9, 9, 6), q_offset=0, causal=False, padded=True),
    "after a cache": dict(shape=(1, 2, 2, 5, 14, 7), q_offset=9, causal=True),
    "window": dict(shape=(1, 1, 2, 17, 17, 4), q_offset=0, causal=True, window=5),
    "window after a cache, padded": dict(shape=(2, 1, 1, 6, 15, 3), q_offset=9, causal=True, window=7, padded=True),
    "head size 33": dict(shape=(1, 1, 1, 7, 7, 33), q_offset=0, causal=True),
}


@pytest.mark.parametrize("tiles", [(1, 4), (2, 8)], ids=["4x4 tiles", "8x8 tiles"])
@pytest.mark.parametrize("name", CASES)
def test_emulated_tiles_match_composed_attention(name, tiles):
    """Forward, log-sum-exp and every gradient of the tiled algorithm (``rows`` query rows a warp,
    key tiles of ``lanes``) against the composed core, float64, 1e-12."""
    case = CASES[name]
    q, k, v, dout, key_mask = attention_case(case["shape"], case.get("padded", False))
    masks = (case["q_offset"], case["causal"], key_mask, case.get("window", 0))
    rows, lanes = tiles
    out, lse = E.flash_fwd(q, k, v, *masks, rows=rows, lanes=lanes)
    grads = E.backward(dout, q, k, v, out, lse, *masks, rows=rows, lanes=lanes)
    ref_out, ref_lse, *ref_grads = composed_attention(q, k, v, dout, *masks)
    assert max_rel_err(out, ref_out) < TOL
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen)  # +inf exactly for the rows that see no key
    assert max_rel_err(lse[seen], ref_lse[seen]) < TOL
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert max_rel_err(grad, ref) < TOL, name


def test_fully_masked_rows_give_zeros():
    q, k, v, dout, key_mask = attention_case((2, 1, 1, 6, 6, 4), padded=True)
    out, lse = E.flash_fwd(q, k, v, 0, True, key_mask, rows=1, lanes=4)
    hidden = ~np.isfinite(lse)
    assert hidden.sum() == 3 + 5  # rows 0-2 of sequence 0, 0-4 of sequence 1
    assert not out[hidden].any()
    dq, *_ = E.backward(dout, q, k, v, out, lse, 0, True, key_mask, rows=1, lanes=4)
    assert not dq[hidden].any()


def test_default_tiles_skip_the_causal_upper_triangle():
    """The kernels' own tile sizes (16 query rows, key tiles of 32): a block of queries visits only
    the key tiles its last query can see, and a key tile only the query tiles that see it."""
    assert E.key_range(0, 16, 100, 0, True, 0, 32) == (0, 16)
    assert E.key_range(32, 48, 100, 0, True, 0, 32) == (0, 48)
    assert E.key_range(64, 80, 100, 0, True, 20, 32) == (32, 80)  # window 20: keys 45.. seen, from tile 32
    assert E.query_range(64, 80, 100, 0, True, 0, 32) == (64, 100)
    assert E.query_range(64, 80, 100, 0, True, 10, 32) == (64, 89)
    q, k, v, dout, _ = attention_case((1, 1, 2, 70, 70, 16), False, seed=1)
    out, lse = E.flash_fwd(q, k, v, 0, True)
    ref_out, ref_lse, *ref_grads = composed_attention(q, k, v, dout, 0, True)
    assert max_rel_err(out, ref_out) < TOL and max_rel_err(lse, ref_lse) < TOL
    for grad, ref in zip(E.backward(dout, q, k, v, out, lse, 0, True), ref_grads):
        assert max_rel_err(grad, ref) < TOL


def test_templates_cover_every_head_size_up_to_the_largest():
    assert [FA.bucket(d) for d in (1, 32, 33, 64, 80, 128, 200, 256)] == [32, 32, 64, 64, 128, 128, 256, 256]
    assert FA.names("bfloat16", 128) == ["flash_fwd<bf16, 4>", "flash_dq<bf16, 4>", "flash_dkdv<bf16, 4>"]
    # The largest tiles fit an H100's 227 KiB of shared memory a block, float64 included.
    assert max(FA.shared_bytes(k, 256, "float64") for k in FA.KERNELS) <= 227 * 1024
    assert FA.shared_bytes("flash_fwd", 64, "float32") == (16 + 64) * 65 * 4


def test_host_arrays_take_the_composed_path():
    """The kernels take cupy arrays only: numpy ones (and the switch turned off) never reach them."""
    q = np.zeros((1, 1, 1, 4, 8), dtype="float32")
    assert not FA.supported(q, q, q, q)
