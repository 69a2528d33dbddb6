"""Weights kept quantized at inference (``kernels/quantized.py``, ``hpc-tp convert --quantize``): the
few-row float kernel and the blockwise path against dequantize-then-numpy, the integer kernel
(``kernels/int8_dot.py``, where the CPU has AVX512-VNNI) against numpy doing its arithmetic; quantized
models at tp = the world size against one process at the same precision; the int8 head; weights packed
at load (one copy, the stored layout's numbers, nothing built at the first forward, a checkpoint saved
from them); GGUF Q8_0, Q4_0 and Q4_1 kept as stored against the widened import; and the errors of a bad
format, a tp that cuts a group, and training."""

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from test_convert import IDS, convert_on_rank0, llama_source, rel_err, tp_logits, write_gguf
from test_generate import CONFIGS, PROMPTS, larger_weights
from tp_helpers import max_rel_err, tp_and_reference

from hpc_tp.checkpoint import convert, load_checkpoint, save_checkpoint
from hpc_tp.checkpoint.importers import quantize as quantize_source
from hpc_tp.checkpoint.importers.source import open_source
from hpc_tp.cli import main
from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.kernels import int8_dot, quantized, small_m, threads
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve import continuous, generate
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine, left_pad
from hpc_tp.serve.kv_cache import KVCache
from hpc_tp.serve.loading import load_for_inference
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tensor_parallel.layers import RowParallelLinear
from hpc_tp.tensor_parallel.packing import pack_for_inference
from hpc_tp.tokenizer import ByteTokenizer

mpi = pytest.mark.mpi(min_size=1)
# 128 inputs to every row-parallel layer: four groups of 32, whole at tp = 1, 2 and 4.
CONFIG = dict(CONFIGS["llama-gqa"], vocab_size=300, hidden=128, ffn_hidden=256)
STEPS = 3
# Across tp only the order of the sums differs: float64 to rounding, float32 to its rounding of the logits.
SAME_PRECISION = {"float64": 1e-10, "float32": 1e-5}
HOST_VNNI = int8_dot.AVAILABLE
needs_vnni = pytest.mark.skipif(not HOST_VNNI, reason="needs numba and a CPU with avx512_vnni")


@pytest.fixture
def float_products(monkeypatch):
    """Few-row products of float32 activations by the float kernel, as on a CPU without VNNI."""
    monkeypatch.setattr(int8_dot, "AVAILABLE", False)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 64, 65, 130])
def test_product_equals_dequantize_then_numpy(bits, dtype, rows, float_products):
    """1-64 rows: the numba kernel (dequantized in cache); more: blocks dequantized and BLAS."""
    rng = np.random.default_rng(rows)
    w = quantized.quantize(rng.normal(size=(192, 200)), bits)
    a = rng.normal(size=(rows, 192)).astype(dtype)
    want = a.astype(np.float64) @ w.dequantize(dtype=np.float64)
    got = quantized.matmul(a, w)
    assert got.dtype == np.dtype(dtype)
    assert rel_err(got, want) < (1e-13 if dtype == "float64" else 3e-6)


def _integer_reference(a, w):
    """``int8_dot``'s arithmetic in numpy: rows quantized per group of 32 (scale max |a| / 127, codes
    rounded half to even), integer dots per group with the weight codes, each group's dot scaled, and
    for 4 bits the minimum times the scale times the sum of the group's codes."""
    m, k = a.shape
    groups = a.reshape(m, k // 32, 32)
    scale = np.abs(groups).max(axis=2) / np.float32(127)
    codes = np.rint(groups / np.where(scale > 0, scale, np.float32(1))[..., None])
    w_codes = w.codes.astype(np.int64)
    if w.bits == 4:
        w_codes = np.empty((k, w.shape[1]), np.int64)
        w_codes[0::2], w_codes[1::2] = w.codes & 15, w.codes >> 4
    dots = np.einsum("mgi,gin->mgn", codes.astype(np.int64), w_codes.reshape(k // 32, 32, -1))
    out = np.einsum("mg,gn,mgn->mn", scale.astype(np.float64), w.scale.astype(np.float64), dots)
    if w.bits == 4:
        out += (scale * codes.sum(axis=2)).astype(np.float64) @ w.low  # float32 sums of codes: exact
    return out


@needs_vnni
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 17, 64, 130])
def test_integer_product_equals_numpy_doing_its_arithmetic(bits, rows):
    """float32 activations, 1-130 rows (tiles of four and single rows; a decode step's rows and a
    prefill's): products to float32 rounding (one activation code off by one would move a product by
    about 1e-3); 200 columns leave a partial tile of 16. The product's distance from the float one stays within what rounding ``a`` to
    half a step (max |a| / 254 per group) can move it: sum over k of that half step times |w|."""
    rng = np.random.default_rng(rows)
    w = quantized.quantize(rng.normal(size=(192, 200)), bits)
    a = (rng.normal(size=(rows, 192)) * rng.uniform(0.01, 10, size=(rows, 1))).astype(np.float32)
    want = _integer_reference(a, w)
    got = quantized.matmul(a, w)
    assert got.dtype == np.float32 and rel_err(got, want) < 3e-6
    dense = w.dequantize(dtype=np.float64)
    half_step = np.repeat(np.abs(a.reshape(rows, -1, 32)).max(axis=2) / 254, 32, axis=1)
    assert (np.abs(got - a.astype(np.float64) @ dense) <= half_step @ np.abs(dense) * 1.001 + 1e-5).all()


@needs_vnni
@pytest.mark.parametrize("bits", [8, 4])
def test_a_rows_products_are_the_same_bits_whatever_rows_are_beside_it(bits):
    """Each row is quantized by itself and a tile of four rows does a row's float operations as the
    one-row tile does: the rows of a prefill-sized product (130 rows) and of a decode step's (5) equal
    the row multiplied alone bit for bit."""
    rng = np.random.default_rng(bits)
    w = quantized.quantize(rng.normal(size=(192, 200)), bits)
    a = (rng.normal(size=(130, 192)) * rng.uniform(0.01, 10, size=(1, 192))).astype(np.float32)
    alone = np.concatenate([quantized.matmul(a[i : i + 1], w) for i in range(a.shape[0])])
    for rows in (5, 130):
        assert np.array_equal(quantized.matmul(a[:rows], w), alone[:rows]), rows


@needs_vnni
def test_activation_codes_are_numpys_rounding_of_the_exact_quotient():
    """The activations' int8 codes and group scales are numpy's to the bit: scale max |a| / 127, codes
    rint(a / scale), a true division (a reciprocal in its place moves codes next to half a step).
    Values are put next to half steps, where the two disagree."""
    rng = np.random.default_rng(7)
    a = rng.normal(size=(64, 32 * 32)).astype(np.float32)
    groups = a.reshape(64, -1, 32)
    scale = np.abs(groups).max(axis=2) / np.float32(127)
    halves = (rng.integers(-126, 126, size=groups.shape) + np.float32(0.5)).astype(np.float32)
    near = (halves * scale[..., None]).astype(np.float32)
    keep = np.abs(groups) == np.abs(groups).max(axis=2, keepdims=True)
    groups = np.where(keep | (rng.random(groups.shape) < 0.5), groups, near)  # the largest stays
    a = groups.reshape(64, -1)
    scale = np.abs(groups).max(axis=2) / np.float32(127)
    want = np.rint(groups / scale[..., None]).astype(np.int8).reshape(64, -1)
    codes, got_scale, code_sums, sums = int8_dot._quantized(a)
    assert np.array_equal(got_scale, scale)
    assert np.array_equal(codes, want)
    assert np.array_equal(code_sums, want.reshape(64, -1, 32).sum(axis=2, dtype=np.int32))
    assert np.array_equal(sums, scale * code_sums.astype(np.float32))


@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_kernels_write_only_their_column_range(bits, integer):
    """[start, stop) of the product, the other columns untouched (a split over cores writes one
    output): ranges that start and stop inside a tile of 16 and inside a block of columns."""
    if integer and not HOST_VNNI:
        pytest.skip("needs numba and a CPU with avx512_vnni")
    if not small_m.cpu_kernels.ENABLED:
        pytest.skip("needs numba")
    rng = np.random.default_rng(bits)
    w = quantized.quantize(rng.normal(size=(96, 300)), bits)
    a = rng.normal(size=(5, 96)).astype(np.float32)
    low = w.scale[:0] if w.low is None else w.low
    for start, stop in [(0, 300), (7, 150), (150, 299), (33, 34)]:
        out = np.full((5, 300), np.nan, np.float32)
        if integer:
            lows = np.empty(0, np.float32) if w.low is None else int8_dot.interleave_columns(w.low)
            columns = int8_dot.interleave(w.codes, bits), int8_dot.interleave_columns(w.scale), lows
            int8_dot.matmul(a, *columns, bits, 300, start, stop, out)
            full = _integer_reference(a, w)
        else:
            rows = small_m._operand_rows(a, np.dtype(np.float32))
            scales, lows = w.scale.reshape(-1), low.reshape(-1)
            small_m._rows_by_quantized(rows, w.codes.reshape(-1), scales, lows, np.float32(0), out, start, stop)
            full = a.astype(np.float64) @ w.dequantize(dtype=np.float64)
        assert np.isnan(out[:, :start]).all() and np.isnan(out[:, stop:]).all()
        assert rel_err(out[:, start:stop], full[:, start:stop]) < 3e-6


@needs_vnni
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_the_integer_kernel_gives_the_same_bits_at_any_thread_count(bits, rows):
    """Each column is summed by whichever thread takes its range, in one order: the same bits at 1, 2
    and 3 threads, with more ranges than threads and a ragged last tile."""
    rng = np.random.default_rng(rows + bits)
    w = quantized.quantize(rng.normal(size=(576, 3000)), bits)
    a = rng.normal(size=(rows, 576)).astype(np.float32)
    assert w.pack()
    before, results = threads.COUNT, []
    try:
        for count in (1, 2, 3):
            threads.use(count)
            assert count == 1 or len(threads.shared(3000, small_m.COLUMN_ALIGN, 576 * bits // 8)) - 1 > count
            results.append(quantized.matmul(a, w))
    finally:
        threads.use(before)
    assert all(np.array_equal(results[0], result) for result in results[1:])


def test_the_head_of_a_quantized_model_is_int8_below_float64():
    """float32 (or half): the int8 copy of the head; float64 keeps the float head, as does a float model."""
    float_model = GPTModel(ModelConfig(**CONFIG), self_comm(), dtype="float32", seed=4)
    assert isinstance(
        _quantized_model(self_comm(), "int4", "float32").head._product_weight(), quantized.QuantizedMatrix
    )
    assert isinstance(_quantized_model(self_comm(), "int4", "float64").head._product_weight(), np.ndarray)
    assert isinstance(float_model.head._product_weight(), np.ndarray)


def test_the_kernel_takes_the_few_row_products():
    assert small_m.takes_quantized(np.zeros((64, 32), np.float32)) == small_m.cpu_kernels.ENABLED
    assert not small_m.takes_quantized(np.zeros((65, 32), np.float32))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_rounds_within_half_a_step_and_packs_two_codes_a_byte(bits):
    rng = np.random.default_rng(bits)
    w = rng.normal(size=(64, 40)) * rng.uniform(0.1, 3, size=40)
    m = quantized.quantize(w, bits)
    assert m.codes.shape == ((64, 40) if bits == 8 else (32, 40)) and m.scale.shape == (2, 40)
    step = np.repeat(m.scale, 32, axis=0)
    assert (np.abs(m.dequantize(dtype=np.float64) - w) <= step / 2 * (1 + 1e-6)).all()
    codes = m.codes[0] & 15 if bits == 4 else m.codes[0]
    assert np.allclose(codes * m.scale[0] + (0 if m.low is None else m.low[0]), m.dequantize()[0])


def _quantized_model(comm, fmt, dtype):
    """The llama-gqa model with ``larger_weights``, its linear weights quantized to ``fmt``."""
    float_model = larger_weights(GPTModel(ModelConfig(**CONFIG), self_comm(), dtype="float64", seed=4))
    return quantized_copy(float_model, comm, fmt, dtype)


def quantized_copy(float_model, comm, fmt, dtype):
    """A model of ``float_model``'s config (one process's) at ``comm``, its linear weights quantized to ``fmt``."""
    full = {name: p.data for name, p in float_model.named_parameters()}
    model = GPTModel(dataclasses.replace(float_model.cfg, quantize=fmt), comm, dtype=dtype, seed=4)
    for name, p in model.named_parameters():
        if name in full:
            p.load_full(full[name])
            continue
        weight, part = name.rsplit(".", 1)
        p.load_full(dict(quantized.quantize(full[weight], quantized.FORMATS[fmt]).arrays())[part])
    return model


def _logits(model):
    """Prefill logits of PROMPTS at their real tokens, then STEPS decode steps' (KV cache), float64."""
    tokens, key_mask, positions = left_pad(PROMPTS, STEPS, pad_id=0)
    width = tokens.shape[1]
    cache = KVCache.for_model(model, len(PROMPTS), width + STEPS)
    prefill = model.infer(tokens, positions, key_mask[:, :width], cache, all_positions=True)
    out = [prefill[key_mask[:, :width]]]
    ids, lens = np.argmax(prefill[:, -1], axis=-1), np.array([len(p) for p in PROMPTS])
    for s in range(STEPS):
        key_mask[:, width + s] = True
        out.append(model.infer(ids[:, None], (lens + s)[:, None], key_mask[:, : width + s + 1], cache))
        ids = (ids * 7 + 3) % CONFIG["vocab_size"]
    return [np.asarray(o, np.float64) for o in out]


@mpi
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tp_gives_one_process_logits_at_the_same_precision(fmt, dtype, float_products):
    """Float products (float32 ones by the float kernel). With int8 activations each rank quantizes
    the same numbers as one process only up to float32 rounding: a value that tp's other order of sums
    moves across half a step takes the next code; this small random model's prefill logits move by a
    few percent for such codes, enough to change the argmax token the decode steps are fed. So the
    integer path is held layer by layer instead (``test_integer_layers_at_tp_give_one_process_numbers``)."""
    tp, one = tp_and_reference()
    got, want = _logits(_quantized_model(tp, fmt, dtype)), _logits(_quantized_model(one, fmt, dtype))
    for step, (g, w) in enumerate(zip(got, want)):
        assert max_rel_err(g, w) <= SAME_PRECISION[dtype], f"step {step}"


@mpi
@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [3, 100])
def test_integer_layers_at_tp_give_one_process_numbers(fmt, rows):
    """One input of a decode step's rows or a prefill's, int8 activations: the MLP (column-parallel
    gate and up, row-parallel down: each rank quantizes whole groups of the same numbers) and the int8
    head's logits for this rank's vocabulary block equal one process's to float32 rounding."""
    tp, one = tp_and_reference()
    x = np.random.default_rng(5).normal(size=(1, rows, CONFIG["hidden"])).astype(np.float32)
    model, reference = _quantized_model(tp, fmt, "float32"), _quantized_model(one, fmt, "float32")
    assert max_rel_err(model.layers[0].mlp.forward(x)[0], reference.layers[0].mlp.forward(x)[0]) <= 1e-6
    assert isinstance(model.head._product_weight(), quantized.QuantizedMatrix)
    block = -(-CONFIG["vocab_size"] // tp.size)
    want = reference.head.forward(x)[0][..., tp.rank * block : (tp.rank + 1) * block]
    got = model.head.forward(x)[0][..., : want.shape[-1]]
    assert max_rel_err(got, want) <= 1e-6


@mpi
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tp_greedy_tokens_equal_one_process(fmt, float_products):
    tp, one = tp_and_reference()
    params = [SamplingParams(max_new_tokens=6)] * len(PROMPTS)
    out_tp = Engine(_quantized_model(tp, fmt, "float32"), ByteTokenizer()).generate(PROMPTS, params)
    ids_tp = tp.allgather_object(None if out_tp is None else [c.ids for c in out_tp[0]])[0]
    out_one = Engine(_quantized_model(one, fmt, "float32"), ByteTokenizer()).generate(PROMPTS, params)
    assert ids_tp == [c.ids for c in out_one[0]]


@mpi
@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_batcher_gives_each_request_its_tokens_alone(fmt, monkeypatch):
    """A float32 model on the integer path at tp = the world size: prompts right-padded into one
    prefill pass of 100 rows (the product's many-row shape), then decoded together, give each request
    the greedy tokens it has alone (a prefill of its own rows, steps of one row). A row's products do
    not depend on the rows beside it, but attention over the batcher's paged cache rounds otherwise
    than over the engine's, and an activation that this moves across half a step takes the next code:
    the logits move by about 1% where that happens (a row mixed up with another's would move them by
    their whole size)."""
    monkeypatch.setattr(continuous, "PASS_TOKENS", 1000)  # every prompt in one prefill pass
    tp, _ = tp_and_reference()
    chosen, pick = {}, generate.next_token

    def spy(logits, params, rng):
        chosen.setdefault(params.seed, []).append(np.array(logits))
        return pick(logits, params, rng)

    monkeypatch.setattr(generate, "next_token", spy)
    engine = Engine(_quantized_model(tp, fmt, "float32"), ByteTokenizer())
    prompts = [*PROMPTS, [int(i) for i in np.random.default_rng(6).integers(0, 256, 20)]]
    batched = [SamplingParams(max_new_tokens=6, seed=i) for i in range(len(prompts))]
    together = ContinuousBatcher(engine, len(prompts)).generate(*((prompts, batched) if tp.rank == 0 else ()))
    for i, ids in enumerate(prompts):
        params = [SamplingParams(max_new_tokens=6, seed=len(prompts) + i)]
        alone = engine.generate(*(([ids], params) if tp.rank == 0 else ()))
        if tp.rank == 0:
            assert together[i][0].ids == alone[0][0].ids, i
            assert max(max_rel_err(a, b) for a, b in zip(chosen[i], chosen[len(prompts) + i])) <= 0.05


@needs_vnni
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [200, 64])
def test_a_packed_matrix_keeps_one_copy_of_the_stored_numbers(bits, n):
    """``pack``: the stored arrays dropped; the parts written back out equal them, blocks of rows
    dequantized from the packed layout (at 1 and 2 threads, float32 and float64) equal the stored
    layout's bit for bit, and so do the products of many rows by those blocks (200 columns: a partial
    tile)."""
    rng = np.random.default_rng(n + bits)
    w = quantized.quantize(rng.normal(size=(192, n)), bits)
    stored = {part: a.copy() for part, a in w.arrays()}
    blocks = [(0, 192, np.float32), (32, 128, np.float32), (64, 192, np.float64)]
    want = [w.dequantize(start, stop, dtype) for start, stop, dtype in blocks]
    many = rng.normal(size=(small_m.MAX_ROWS + 7, 192)).astype(np.float32)
    product = quantized.dequantized_matmul(many, w, np.dtype(np.float32))
    assert w.pack() and w.codes is None and w.scale is None and w.low is None
    for part, a in w.arrays():
        assert a.dtype == stored[part].dtype and np.array_equal(a, stored[part]), part
    before = threads.COUNT
    try:
        for count in (1, 2):
            threads.use(count)
            for (start, stop, dtype), block in zip(blocks, want):
                got = w.dequantize(start, stop, dtype)
                assert got.dtype == block.dtype and np.array_equal(got, block), (count, start, stop)
    finally:
        threads.use(before)
    assert np.array_equal(quantized.dequantized_matmul(many, w, np.dtype(np.float32)), product)


@needs_vnni
@pytest.mark.parametrize("bits", [8, 4])
def test_float16_scales_are_packed_as_half_and_give_the_float32_layouts_numbers(bits):
    """Scales and minimums that are float16 numbers (GGUF's) are packed as float16 bits: products of 1
    and 5 rows (200 columns: a partial tile) and blocks of rows dequantized equal those of the same
    numbers packed as float32, bit for bit, and the parts written back are the stored float32 ones;
    scales a float16 cannot hold stay float32."""
    rng = np.random.default_rng(bits)
    w = quantized.quantize(rng.normal(size=(192, 200)), bits)
    as_half = lambda values: None if values is None else values.astype(np.float16).astype(np.float32)  # noqa: E731
    half = quantized.QuantizedMatrix(w.codes, as_half(w.scale), as_half(w.low), bits)
    stored = {part: a.copy() for part, a in half.arrays()}
    assert half.pack() and half.packed.scales.dtype == half.packed.lows.dtype == np.uint16
    p = half.packed
    lows = int8_dot.interleave_columns(stored["min"]) if bits == 4 else np.empty(0, np.float32)
    wide = (p.codes, int8_dot.interleave_columns(stored["scale"]), lows)
    for rows in (1, 5):
        a = rng.normal(size=(rows, 192)).astype(np.float32)
        got = int8_dot.matmul(a, p.codes, p.scales, p.lows, bits, p.n)
        assert np.array_equal(got, int8_dot.matmul(a, *wide, bits, p.n)), rows
    block = int8_dot.dequantize(p.codes, p.scales, p.lows, bits, p.n, 1, 5)
    assert np.array_equal(block, int8_dot.dequantize(*wide, bits, p.n, 1, 5))
    for part, a in half.arrays():
        assert a.dtype == stored[part].dtype and np.array_equal(a, stored[part]), part
    assert w.pack() and w.packed.scales.dtype == np.float32


@mpi
@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_loading_packs_once_and_the_first_forward_builds_nothing(fmt, monkeypatch):
    """``pack_for_inference`` (what loading for inference calls): every linear weight and the int8 head
    packed, their stored arrays dropped, each Parameter's values still the loaded ones; a forward then
    quantizes and interleaves nothing, and its logits are a model's packed at its first products, at
    the world's tp; a float64 model keeps its stored layout."""
    tp, _ = tp_and_reference()
    model, lazy = _quantized_model(tp, fmt, "float32"), _quantized_model(tp, fmt, "float32")
    loaded = {name: np.array(p.data) for name, p in model.named_parameters()}
    pack_for_inference(model)
    packed = [m for m in model.modules() if isinstance(getattr(m, "quantize", None), str)]
    matrices = [getattr(m, "_weight", None) or getattr(m, "_matrix", None) or m._int8 for m in packed]
    assert len(matrices) == 4 * CONFIG["n_layers"] + 1  # qkv, out, fc1, fc2 a layer, and the head
    assert all(w.packed is not None and w.codes is None for w in matrices)
    for name, p in model.named_parameters():
        assert isinstance(p.data, quantized.PackedPart) == (name.rsplit(".", 1)[-1] in quantized.PARTS), name
        assert np.array_equal(np.asarray(p.data), loaded[name]), name

    def rebuilt(*args):
        raise AssertionError("a forward rebuilt a packed weight")

    monkeypatch.setattr(int8_dot, "interleave", rebuilt)
    monkeypatch.setattr(quantized, "quantize", rebuilt)
    got = _logits(model)
    monkeypatch.undo()
    for step, (g, w) in enumerate(zip(got, _logits(lazy))):
        assert np.array_equal(g, w), f"step {step}"
    float64 = _quantized_model(tp, fmt, "float64")
    pack_for_inference(float64)
    assert float64.layers[0].mlp.fc2._matrix.packed is None


@mpi
@needs_vnni
def test_a_packed_model_saves_the_weights_it_loaded(shared_dir, comm_world):  # noqa: F811
    """A checkpoint saved from a packed int4 model (its Parameters written out of the packed layout)
    loads into a fresh model with the same arrays, at the world's tp."""
    grid = ProcessGrid(tp=comm_world.size, world=comm_world)
    model = _quantized_model(grid.tp, "int4", "float32")
    want = {name: np.array(p.data) for name, p in model.named_parameters()}
    pack_for_inference(model)
    path = save_checkpoint(shared_dir, 1, model.state(), {}, grid)
    fresh = GPTModel(model.cfg, grid.tp, dtype="float32", seed=9)
    load_checkpoint(path, fresh.state(), grid)
    for name, p in fresh.named_parameters():
        assert np.array_equal(p.data, want[name]), name


def convert_quantized_on_rank0(source, output, fmt, comm):
    """``hpc-tp convert source -o output --quantize fmt`` in rank 0's process; the other ranks wait."""
    if comm.rank == 0:
        imported = quantize_source.quantize_imported(open_source(source, convert.split_axes), fmt, convert.split_axes)
        convert.replace_folder(output, False, lambda temp: convert.write_checkpoint(imported, temp))
    comm.barrier()


@mpi
@pytest.mark.parametrize("fmt, kind", [("int8", "Q8_0"), ("int4", "Q4_0"), ("int4", "Q4_1")])
def test_gguf_weights_kept_quantized_give_the_widened_imports_logits(shared_dir, comm_world, fmt, kind):  # noqa: F811
    """Every linear weight of a llama GGUF stored as ``kind``: converted with --quantize, its numbers
    are kept (nothing is quantized again), and the logits at every tp are the float import's."""
    import gguf

    config, tensors = llama_source(hidden=128, ffn=256)
    linear = [n for n in tensors if n.endswith("proj.weight")]
    path = shared_dir / "m.gguf"
    kinds = dict.fromkeys(linear, gguf.GGMLQuantizationType[kind])
    comm_world.bcast_object(write_gguf(path, config, tensors, quantized=kinds) if comm_world.rank == 0 else None)
    convert_on_rank0(lambda: path, shared_dir / "widened", comm_world)
    requantized = []
    original = quantize_source.quantize
    quantize_source.quantize = lambda w, bits: requantized.append(w) or original(w, bits)
    try:
        convert_quantized_on_rank0(path, shared_dir / "kept", fmt, comm_world)
    finally:
        quantize_source.quantize = original
    assert not requantized
    assert rel_err(tp_logits(shared_dir / "kept", comm_world), tp_logits(shared_dir / "widened", comm_world)) < 1e-6


@mpi
def test_convert_quantizes_an_hpc_tp_checkpoint_that_loads_at_every_tp(shared_dir, comm_world):  # noqa: F811
    """float checkpoint -> convert --quantize int4 -> the model loads at every tp, its logits those of
    the float weights quantized in process; loaded for inference (``load_for_inference``), packed."""
    config, tensors = llama_source(hidden=128, ffn=256)
    path = shared_dir / "m.gguf"
    comm_world.bcast_object(write_gguf(path, config, tensors, quantized=()) if comm_world.rank == 0 else None)
    convert_on_rank0(lambda: path, shared_dir / "float", comm_world)
    one = ProcessGrid(tp=1, world=self_comm())
    convert_quantized_on_rank0(shared_dir / "float", shared_dir / "q", "int4", comm_world)
    float_model = GPTModel(ModelConfig.from_dict(load_checkpoint(shared_dir / "float", {}, one)["config"]), self_comm())
    load_checkpoint(shared_dir / "float", float_model.state(), one)
    want = quantized_copy(float_model, self_comm(), "int4", "float64").logits(IDS)
    assert rel_err(tp_logits(shared_dir / "q", comm_world), want) < 1e-10
    # loaded for inference in float32: packed where the integer kernel runs, the numbers of a model
    # loaded by hand and packed at its first products
    args = SimpleNamespace(ckpt=str(shared_dir / "q"), tp=None, pp=1, device="cpu", dtype="float32")
    _, served, _ = load_for_inference(args)
    assert (served.layers[0].mlp.fc2._matrix.packed is not None) == HOST_VNNI
    grid = ProcessGrid(tp=comm_world.size, world=comm_world)
    by_hand = GPTModel(served.cfg, grid.tp, dtype="float32")
    load_checkpoint(shared_dir / "q", by_hand.state(), grid)
    assert np.array_equal(served.logits(IDS), by_hand.logits(IDS))


def test_bad_quantize_values_are_one_line(tmp_path, capsys):
    assert main(["convert", str(tmp_path), "-o", str(tmp_path / "out"), "--quantize", "int3"]) == 2
    assert capsys.readouterr().err.strip() == "hpc-tp: error: --quantize 'int3': expected one of int8, int4"
    with pytest.raises(ConfigError, match="model config quantize 'fp8': expected one of int8, int4"):
        ModelConfig(**CONFIG, quantize="fp8")
    with pytest.raises(ConfigError, match="for dense decoders"):
        ModelConfig(**CONFIG, quantize="int4", num_experts=4)


def test_a_tp_that_cuts_a_group_is_refused():
    class FourRanks:
        size, rank = 4, 0

    with pytest.raises(ConfigError, match="along its 64 inputs: tensor parallelism 4 would cut a group"):
        RowParallelLinear(64, 32, FourRanks(), bias=False, quantize="int4")
    with pytest.raises(ConfigError, match="along its 48 inputs: they are not whole groups"):
        quantized.check_rows(48, 1, "a weight", 8)


def test_training_refuses_a_quantized_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "tiny", "--set", "quantize=int8", "--steps", "1"]) == 2
    assert "model config quantize='int8': quantized weights are for inference" in capsys.readouterr().err


@needs_vnni
def test_warm_up_prepares_the_integer_kernel_a_decode_step_takes():
    """In a fresh process, ``quantized.warm_up`` for float32 activations leaves ``int8_dot``'s kernel
    compiled or loaded for 8- and 4-bit codes, scales float32 or float16 (at one thread the kernel
    itself, at more its driver): a server's first request does not wait for it."""
    code = (
        "from hpc_tp.kernels import int8_dot, quantized; quantized.warm_up('float32'); "
        "print(len(int8_dot._product.signatures) + len(int8_dot._product_over.signatures))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(result.stdout) == 4  # int8 codes and packed 4-bit ones, each with float32 and float16 scales
