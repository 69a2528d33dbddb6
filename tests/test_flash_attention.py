"""The device's fused attention (``kernels.flash_attention``) proved on the CPU: its numpy emulation,
tile by tile with small tiles, against the composed attention core in float64 (forward, the
log-sum-exp, dQ, dK, dV), with causal, key-padding and sliding-window masks, grouped-query heads,
a query offset (decoding after a cache) and head sizes that fill a tile partly. The composed reference and the
cases are ``gpu_check``'s, which holds the CUDA kernels to the same on a device. The CUDA source is
compiled with NVRTC in tests/test_gpu.py, and run against the composed path on a device there and in
``make gpu-check``."""

import re

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


@pytest.mark.parametrize("layout", ["QKV buffer", "rotated copy", "heads apart"])
def test_heads_are_walked_with_one_stride(layout):
    """What the kernels are given for Q [B, hk, g, T, d] and K [B, hk, T, d] views: (array, batch, head,
    row strides) such that element (b, h, t, c) sits at b sb + h sh + t st + c from the array's start,
    head h being KV head h // g's member h % g (numpy stands in for cupy)."""
    b, t, hk, g, d = 2, 5, 2, 3, 4
    qkv = np.arange(b * t * (hk * g + 2 * hk) * d, dtype=np.float64).reshape(b, t, -1)
    q = qkv[..., : hk * g * d].reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)
    if layout == "rotated copy":
        q = np.ascontiguousarray(q)
    elif layout == "heads apart":  # group members further apart than KV heads: no single head stride
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3, 4)).transpose(0, 2, 1, 3, 4)
    k = qkv[..., hk * g * d : (hk * g + hk) * d].reshape(b, t, hk, d).transpose(0, 2, 1, 3)
    for x, group in ((q, g), (k, 1)):
        array, sb, sh, st = FA._heads(x)
        flat = array.reshape(-1) if array.flags.c_contiguous else array.base.reshape(-1)
        start = (array.ctypes.data - flat.ctypes.data) // array.itemsize
        for bi, h, ti, c in np.ndindex(b, hk * group, t, d):
            index = (bi, h, ti, c) if x.ndim == 4 else (bi, h // group, h % group, ti, c)
            assert flat[start + bi * sb + h * sh + ti * st + c] == x[index]


def _signature(kernel: str) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of ``kernel`` as the CUDA source declares it."""
    params = re.search(rf"\b{kernel}\((.*?)\)\s*{{", FA.SOURCE, re.S).group(1)
    return [tuple(p.strip().rsplit(" ", 1)) for p in params.split(",")]


SCALARS = {"int": np.int32, "long long": np.int64, "double": np.float64}


def _emulated_launch(kernel, grid, x, args):
    """A launch of ``kernel`` run by the emulation on numpy arrays, after checking ``args`` against the
    CUDA signature one by one: a pointer gets an array of its element type, ``int`` a numpy int32,
    ``long long`` an int64, ``double`` a float64 (cupy passes each as its numpy type says); the arrays
    that come without strides are dense."""
    signature = _signature(kernel)
    assert len(args) == len(signature), kernel
    named = {}
    for (ctype, name), arg in zip(signature, args):
        if ctype.endswith("*"):
            wide = FA.statistics_dtype(x.dtype)
            want = {"T*": x.dtype, "type*": wide, "char*": np.uint8}[ctype.split()[-1].split("::")[-1]]
            assert isinstance(arg, np.ndarray) and arg.dtype == want, (kernel, name, arg.dtype)
        else:
            assert type(arg) is SCALARS[ctype], (kernel, name, type(arg))
        named[name.lstrip("*")] = arg
    for name in ("lse", "delta", "key_mask"):  # read as dense arrays: no strides are passed for them
        assert name not in named or named[name].flags.c_contiguous, (kernel, name)
    heads, group, n_q, n_keys, d = (int(named[k]) for k in ("heads", "group", "n_q", "n_keys", "d"))
    per_block = heads // group if kernel == "flash_dkdv" else heads
    batch, tiles = grid[0] // per_block, -(-(n_keys if kernel == "flash_dkdv" else n_q) // (FA.WARPS * FA.ROWS))
    assert grid == (batch * per_block, tiles), kernel

    def view(array, prefix, n_heads, rows):
        item = array.itemsize
        strides = tuple(int(named[prefix + s]) * item for s in "bht") + (item,)
        return np.lib.stride_tricks.as_strided(array, (batch, n_heads, rows, d), strides)

    def five(x4):  # [B, heads, T, d] as [B, hk, g, T, d]
        return x4.reshape(batch, heads // group, group, *x4.shape[2:])

    q, k = five(view(named["q"], "q", heads, n_q)), view(named["k"], "k", heads // group, n_keys)
    v = view(named["v"], "v", heads // group, n_keys)
    masks = (int(named["q_offset"]), bool(named["causal"]))
    masks += (named["key_mask"].reshape(batch, n_keys) if named["has_mask"] else None, int(named["window"]))
    stats = (batch, heads, n_q)  # the emulation's delta: [B, heads, T]
    if kernel == "flash_fwd":
        out, lse = E.flash_fwd(q, k, v, *masks)
        view(named["o"], "o", heads, n_q)[...] = out.reshape(batch, heads, n_q, d)
        named["lse"].reshape(-1)[...] = lse.reshape(-1)
        return
    dout = five(view(named["dout"], "g", heads, n_q))
    lse, delta = named["lse"].reshape(stats), named["delta"].reshape(stats)
    if kernel == "flash_dq":
        assert named["scale"] == 1 / np.sqrt(d)
        view(named["dq"], "dq", heads, n_q)[...] = E.flash_dq(q, k, v, dout, lse, delta, *masks).reshape(
            batch, heads, n_q, d
        )
    else:
        dk, dv = E.flash_dkdv(q, k, v, dout, lse, delta, *masks)
        view(named["dk"], "dk", heads // group, n_keys)[...] = dk
        view(named["dv"], "dv", heads // group, n_keys)[...] = dv


@pytest.mark.parametrize("name", ["gqa padded causal", "window after a cache, padded", "padded, not causal"])
def test_the_kernel_wrappers_pass_what_the_cuda_signatures_declare(name, monkeypatch):
    """``flash_attention.forward`` and ``backward`` as the attention layer calls them (views of a QKV
    buffer, output and gradients written in place), each launch run by the emulation after its arguments
    are checked against the kernel's CUDA parameter list: the layer's results equal the composed core."""
    monkeypatch.setattr(FA, "_launch", _emulated_launch)
    case = CASES[name]
    q, k, v, dout, key_mask = attention_case(case["shape"], case.get("padded", False))
    b, hk, g, t, d = q.shape
    cached = k.shape[2] != t  # after a cache, keys are arrays of their own
    own = (q,) if cached else (q, k[:, :, None], v[:, :, None])
    qkv = np.concatenate([x.transpose(0, 3, 1, 2, 4).reshape(b, t, -1) for x in own], -1)
    qkv_views = [qkv[..., : hk * g * d].reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)]
    qkv_views += (
        [k, v]
        if cached
        else [
            qkv[..., (hk * g + i * hk) * d :][..., : hk * d].reshape(b, t, hk, d).transpose(0, 2, 1, 3) for i in (0, 1)
        ]
    )
    merged = np.empty((b, t, hk * g * d))
    out = merged.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)
    masks = (case["q_offset"], case["causal"], key_mask, case.get("window", 0))
    lse = FA.forward(*qkv_views, out, masks[0], masks[1], masks[2], masks[3])
    grads = np.empty_like(qkv)
    gq = grads[..., : hk * g * d].reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)
    gk, gv = np.empty_like(k), np.empty_like(v)
    FA.backward(dout, *qkv_views, out, lse, masks[0], masks[1], masks[2], gq, gk, gv, window=masks[3])
    ref_out, ref_lse, *ref_grads = composed_attention(q, k, v, dout, *masks)
    seen = np.isfinite(ref_lse)
    assert max_rel_err(out, ref_out) < TOL and max_rel_err(lse[seen], ref_lse[seen]) < TOL
    for grad, ref in zip((gq, gk, gv), ref_grads):
        assert max_rel_err(grad, ref) < TOL
