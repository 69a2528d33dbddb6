"""The paged KV cache (``serve.blocks``, ``kv_cache.PagedKVCache``): blocks follow the tokens held,
full blocks are shared by reference and a partly filled one copied, unreferenced blocks stay cached
until evicted (least recently released first), every reference comes back; prompts prefilled into
scattered blocks are each as alone; a pool too small for the batch preempts the youngest request,
which is recomputed and gives the tokens and logits it gives alone; bad sizes are one ConfigError
line. At tp = world size, float64."""

import subprocess
import sys

import numpy as np
import pytest
from test_continuous import Request, Script, _agrees_with_alone, _alone
from test_continuous import events as events  # noqa: F401, PLC0414 (the fixture, used by its name)
from test_generate import CONFIGS, PROMPTS, _model, larger_weights
from test_threads import thread_count as thread_count  # noqa: F401, PLC0414 (the fixture, used by its name)
from tp_helpers import max_rel_err, tp_and_reference

from hpc_tp.backend import resolve_dtype
from hpc_tp.errors import ConfigError
from hpc_tp.kernels import paged_attention, paged_bf16
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve import continuous
from hpc_tp.serve.api_request import parse_request
from hpc_tp.serve.blocks import SCRATCH, BlockManager, PagedLayout, Sequence
from hpc_tp.serve.continuous import ContinuousBatcher, kv_pool_units
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.kv_cache import KVCache, PagedKVCache, PagedView
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer

IDS = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4]
# Half-precision logits of the decode kernel against the gathered (composed) attention's. bfloat16: both
# sum in float32 and round the output once, so only the order of the sums differs (largest seen at tp =
# 1, 2, 4: 0); the bound is one bfloat16 step (2^-8) of the largest logit. float16: the composed path
# also rounds the scores and the softmax to float16 (largest seen 3.4e-3).
GATHERED_HALF = {"bfloat16": 2.0**-8, "float16": 1e-2}


def _manager(units, size, prefix_caching=True):
    """A manager of ``units`` units for a model without windows: one kind, a unit a block."""
    return BlockManager(units, PagedLayout([0, 0], size), prefix_caching)


def _held(manager, ids, slots):
    seq = Sequence()
    assert manager.reserve(seq, slots)
    manager.written(seq, ids[:slots])
    return seq


def test_full_blocks_are_shared_and_a_partly_filled_one_copied():
    m = _manager(8, 4)
    a = _held(m, IDS, 10)  # blocks of 4, 4 and 2 tokens
    (a_blocks,) = a.tables
    assert len(a_blocks) == 3 and m.available() == 4
    b = Sequence()
    copy = m.admit(b, IDS[:9] + [99, 98], 10)  # A's two full blocks, then 1 of the 2 tokens of its third
    assert b.tables[0][:2] == a_blocks[:2] and [m.refs[x] for x in a_blocks] == [2, 2, 1]
    assert copy == [(a_blocks[2], b.tables[0][2])] and b.length == 9 and b.tokens == IDS[:9]
    assert m.reserve(b, 11) and len(b.tables[0]) == 3  # its own third block takes slots 8..11
    m.written(b, [99, 98])
    c = Sequence()
    assert m.admit(c, IDS[:4] + [5], 4) == [] and c.tables == [a_blocks[:1]] and c.length == 4
    for seq in (a, b, c):
        m.release(seq)
    assert not any(m.refs) and m.available() == 7


def test_a_prompt_keeps_its_last_token_to_prefill():
    m = _manager(8, 4)
    m.release(_held(m, IDS[:8], 8))
    again = Sequence()
    assert m.admit(again, IDS[:8], 7) and again.length == 7  # a block and 3 tokens copied


def test_unreferenced_blocks_are_evicted_least_recently_released_first():
    m = _manager(4, 2)  # three blocks besides the scratch one
    held = _held(m, [1, 2, 3, 4], 4)
    first = list(held.tables[0])
    m.release(held)
    seq = Sequence()
    m.admit(seq, [1, 2, 3, 4, 0], 4)
    assert seq.tables == [first] and m.refs[first[0]] == 1
    m.release(seq)  # [3, 4] released before [1, 2]: evicted first
    other = _held(m, [9, 9], 2)  # the free block
    assert other.tables == [[3]] and m.available() == 2
    third = _held(m, [8, 8], 2)  # evicts [3, 4]
    found = Sequence()
    m.admit(found, [1, 2, 3, 4, 5], 4)
    assert found.length == 2 and found.tables == [first[:1]] and third.tables == [[first[1]]]
    assert not m.reserve(found, 6)  # two more blocks asked for, none left: nothing taken
    assert found.tables == [first[:1]] and m.available() == 0


def test_without_prefix_caching_a_released_block_is_free():
    m = _manager(4, 2, prefix_caching=False)
    seq = _held(m, [1, 2, 3], 3)
    m.release(seq)
    again = Sequence()
    assert m.admit(again, [1, 2, 3, 4], 3) == [] and again.length == 0 and not m.evictable
    assert m.available() == 3


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_right_padded_prompts_prefilled_into_scattered_blocks_are_each_as_alone(name, block_size):
    """One prefill of right-padded prompts, each into blocks of its own out of order in the pool (as
    continuous batching hands them out), the padding into the scratch block, with ``last`` at each
    one's final token: each prompt's logits and K/V are those of the prompt prefilled alone, and no
    other block is touched. Then a decode step reads each row's blocks up to its own length."""
    tp, _ = tp_and_reference()
    model = _model(name, tp)
    lens = np.array([len(p) for p in PROMPTS])
    blocks = np.random.default_rng(1).permutation(np.arange(1, 40))
    tables = np.split(blocks, np.cumsum([-(-n // block_size) + 1 for n in lens]))[: len(PROMPTS)]
    slots = [(t[:, None] * block_size + np.arange(block_size)).reshape(-1) for t in tables]
    cache = PagedKVCache.for_model(model, 40, PagedLayout.of(model.cfg, block_size))
    assert cache.layout.lanes == 1  # one block table: these models have no windows
    cache.k[:], cache.v[:] = 7.0, 7.0  # what earlier requests left: stays where no prompt is written
    tokens, write = np.zeros((len(PROMPTS), lens.max()), np.int64), np.zeros((len(PROMPTS), lens.max()), np.int64)
    for i, prompt in enumerate(PROMPTS):
        tokens[i, : len(prompt)], write[i, : len(prompt)] = prompt, slots[i][: len(prompt)]
    arange = np.arange(lens.max())
    batched = model.infer(tokens, arange, arange < lens[:, None], PagedView(cache, write[None]), last=lens - 1)
    untouched = np.ones(cache.k.shape[2], bool)
    for i, prompt in enumerate(PROMPTS):
        alone = KVCache.for_model(model, 1, len(prompt) + 1)
        logits = model.infer(np.array([prompt]), np.arange(len(prompt))[None], np.ones((1, len(prompt)), bool), alone)
        assert max_rel_err(batched[i], logits[0]) <= 1e-10, f"prompt {i}"
        for pool, own in ((cache.k, alone.k), (cache.v, alone.v)):
            assert max_rel_err(pool[:, :, slots[i][: len(prompt)]], own[:, 0, :, : len(prompt)]) <= 1e-10
        untouched[slots[i][: len(prompt)]] = False
        # one decode step of this row alone, against the contiguous cache's
        step = model.infer(np.array([[3]]), np.array([[len(prompt)]]), np.ones((1, len(prompt) + 1), bool), alone)
        read = slots[i][: len(prompt) + 1][None]
        paged = model.infer(
            np.array([[3]]),
            np.array([[len(prompt)]]),
            np.ones((1, len(prompt) + 1), bool),
            PagedView(cache, read[None, :, -1:], read[None]),
        )
        assert max_rel_err(paged, step) <= 1e-10, f"prompt {i}"
        untouched[read[0, -1]] = False
    untouched[:block_size] = False  # the scratch block: the padding's
    assert (cache.k[:, :, untouched] == 7.0).all() and (cache.v[:, :, untouched] == 7.0).all()


def _tiny_pool(engine, blocks: int, block_size: int) -> float:
    """GiB of ``blocks`` units (the scratch one among them)."""
    return blocks * PagedKVCache.unit_bytes(engine.model, PagedLayout.of(engine.model.cfg, block_size)) / 2**30


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_a_tiny_pool_preempts_the_youngest_and_recomputes_it(block_size, prefix_caching, events, monkeypatch):
    """Three rows, a pool of 28 tokens: three requests of up to 23 positions each start (their prompts
    fit) and run out of blocks as they decode: the youngest is preempted, its blocks given back, and
    prefilled again with its prompt and tokens so far once there is room. Every request gives the
    tokens and logits it gives alone, and every block comes back."""
    tp, _ = tp_and_reference()
    engine = Engine(_model("llama-gqa", tp), ByteTokenizer())
    preempted, forward = [], ContinuousBatcher._forward

    def spy(self, admitted):
        logits = forward(self, admitted)
        preempted.extend(self.preempted)
        return logits

    monkeypatch.setattr(ContinuousBatcher, "_forward", spy)
    requests = [Request(PROMPTS[2], 16), Request(PROMPTS[0], 14), Request(PROMPTS[1] + [9, 9], 12)]
    due = [(1, r) for r in requests]
    for request in requests:
        events.watch(request)
    memory = _tiny_pool(engine, 28 // block_size + 1, block_size)
    batcher = ContinuousBatcher(engine, 3, prefix_caching=prefix_caching, block_size=block_size, kv_cache_memory=memory)
    assert batcher.kv_tokens == 28
    batcher.run(Script(due) if tp.rank == 0 else None)
    assert preempted and not any(batcher.blocks.refs)
    for request in requests:
        _agrees_with_alone(engine, request, events)
    if tp.rank == 0:
        assert [len(r.done[0].ids) for r in requests] == [16, 14, 12]
        assert requests[2].done[1].batch == 3  # preempted and resumed: the batch it was first admitted to
        assert sum(r.done[0].preemptions for r in requests) == len(preempted)  # each counted on its request


@pytest.mark.mpi(min_size=1)
def test_a_request_the_whole_cache_cannot_hold_is_refused():
    tp, _ = tp_and_reference()
    engine = Engine(_model("gpt2", tp), ByteTokenizer())
    batcher = ContinuousBatcher(engine, 2, block_size=4, kv_cache_memory=_tiny_pool(engine, 4, 4))
    assert batcher.kv_tokens == 12
    with pytest.raises(ConfigError, match=r"needs 13 positions; this server's KV cache holds 12 tokens \(--kv-cache"):
        batcher.generate(
            [[1] * 10] if tp.rank == 0 else None, [SamplingParams(max_new_tokens=4)] if tp.rank == 0 else None
        )


@pytest.mark.parametrize(
    "memory, block_size, message",
    [
        (0.0, 16, "--kv-cache-memory 0.0: expected a number of GiB > 0"),
        (-1.0, 16, "--kv-cache-memory -1.0: expected a number of GiB > 0"),
        (float("nan"), 16, "--kv-cache-memory nan: expected a number of GiB > 0"),
        (float("inf"), 16, "--kv-cache-memory inf: expected a number of GiB > 0"),
        (1e-9, 16, r"--kv-cache-memory 1e-09: holds 0 units of 16 tokens \(\d+ bytes each a rank\); expected at"),
        (None, 0, "--kv-block-size 0: expected an integer >= 1"),
    ],
)
def test_bad_kv_cache_sizes_are_one_config_error_line(memory, block_size, message):
    model = _model("gpt2", tp_and_reference()[1])
    with pytest.raises(ConfigError, match=message) as error:
        kv_pool_units(model, PagedLayout.of(model.cfg, block_size), 4, 32, memory)
    assert "\n" not in str(error.value)
    layout = PagedLayout.of(model.cfg, 16)
    assert kv_pool_units(model, layout, 4, 32, None) == 4 * 2 + 1  # every row at its longest, and the scratch unit
    assert continuous.KV_BLOCK_SIZE == 16


def test_an_http_request_the_whole_cache_cannot_hold_is_a_400_reason():
    cfg = _model("gpt2", tp_and_reference()[1]).cfg
    body = b'{"prompt": "0123456789", "max_tokens": 4}'
    with pytest.raises(ConfigError, match=r"needs 13 positions; this server's KV cache holds 12 tokens"):
        parse_request(body, ByteTokenizer(), cfg, 16, kv_tokens=12)
    assert len(parse_request(body, ByteTokenizer(), cfg, 16, kv_tokens=13).jobs) == 1


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "name, dtype",
    [("gpt2", "float64"), ("llama-gqa", "float64"), ("llama-window", "float64")]
    + [("llama-window", "bfloat16"), ("llama-gqa", "bfloat16"), ("llama-gqa", "float16")],
)
def test_the_decode_kernel_reading_blocks_in_place_equals_the_gathered_attention(name, dtype, monkeypatch):
    """A decode step of rows of different lengths over scattered blocks: the CPU kernel that reads
    each row's own slots (``counts`` given) and the gather of every row up to the longest, masked;
    in half precision to the rounding of the activations (``GATHERED_HALF``)."""
    dtype = _dtype(dtype)
    if not paged_attention.supported(np.zeros(1, dtype), np.zeros(1, dtype)):
        pytest.skip("the fused CPU kernels are off (no numba, or HPC_TP_CPU_KERNELS=0)")
    calls, decode = [], paged_attention.decode
    monkeypatch.setattr(paged_attention, "decode", lambda *args: calls.append(1) or decode(*args))
    tp, _ = tp_and_reference()
    model = larger_weights(GPTModel(ModelConfig(**CONFIGS[name]), tp, dtype=dtype, seed=4))
    layout = PagedLayout.of(model.cfg, 4)
    cache = PagedKVCache.for_model(model, 40, layout)
    rng = np.random.default_rng(2)
    cache.k[:], cache.v[:] = rng.standard_normal(cache.k.shape), rng.standard_normal(cache.v.shape)
    lens = np.array([9, 2, 14, 0])
    units = rng.permutation(np.arange(1, 40))  # each lane's (layer kind's) tables of its own units
    slots = np.zeros((layout.lanes, 4, lens.max() + 1), np.int64)
    for lane in range(layout.lanes):
        for i, table in enumerate(np.split(units[16 * lane : 16 * (lane + 1)], [3, 4, 8])):
            slots[lane, i, : lens[i] + 1] = (table[:, None] * 4 + np.arange(4)).reshape(-1)[: lens[i] + 1]
    write, visible = slots[:, np.arange(4), lens][:, :, None], np.arange(lens.max() + 1) <= lens[:, None]
    ids, positions = np.array([[5], [6], [7], [8]]), lens[:, None]
    pools = cache.k.copy(), cache.v.copy()
    with monkeypatch.context() as gather:
        gather.setattr(paged_attention, "supported", lambda q, pool: False)
        gathered = model.infer(ids, positions, visible, PagedView(cache, write, slots, lens + 1))
    assert not calls
    cache.k[:], cache.v[:] = pools
    in_place = model.infer(ids, positions, visible, PagedView(cache, write, slots, lens + 1))
    assert max_rel_err(in_place, gathered) <= GATHERED_HALF.get(dtype.name, 1e-12) and len(calls) == model.cfg.n_layers


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("block_size", [1, 2])
def test_a_model_windowed_in_every_layer_gives_back_the_blocks_its_window_passed(block_size, events, monkeypatch):
    """Every layer with a sliding window of 3 (Mistral's kind): a request of 27 prompt tokens (in
    chunks of 4) and 6 new ones holds no more than the blocks of its last 3 positions after any
    iteration, and gives the tokens and logits it gives alone, beside a short one; every block comes back."""
    tp, _ = tp_and_reference()
    model = larger_weights(GPTModel(ModelConfig(**dict(CONFIGS["llama-gqa"], rope_scaling=None, sliding_window=3)), tp))
    engine, held, forward = Engine(model, ByteTokenizer()), [], ContinuousBatcher._forward

    def spy(self, admitted):
        logits = forward(self, admitted)
        held.append(max(len(s.tables[0]) - s.dropped[0] for s in self.seqs))
        return logits

    monkeypatch.setattr(ContinuousBatcher, "_forward", spy)
    long_prompt = [int(i) for i in np.random.default_rng(3).integers(0, 256, 27)]
    requests = [Request(long_prompt, 6), Request(PROMPTS[0], 6)]
    for request in requests:
        events.watch(request)
    batcher = ContinuousBatcher(engine, 2, block_size=block_size, chunk_tokens=4)
    assert batcher.layout.windows == [3] and batcher.kv_tokens == batcher.max_len  # any length fits
    batcher.run(Script([(1, r) for r in requests]) if tp.rank == 0 else None)
    assert 0 < max(held) <= -(-3 // block_size) + 1 and not any(batcher.blocks.refs)
    for request in requests:
        _agrees_with_alone(engine, request, events)


def _dtype(name):
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    return resolve_dtype(name)


# (rows, KV heads, query heads a KV head, head dimension, the queries' scale): the first a decode step of
# grouped-query attention; then one head a group, a group of 5 (a whole tile of 4 query heads and 1),
# a head dimension of 80 (two value tiles, a half step of scores) and 130 (a word of the last), an odd
# one; the last's scores span hundreds, so most weights fall below exp(-87).
DECODE_SHAPES = [(5, 3, 3, 16, 0.7), (3, 2, 1, 64, 0.3), (4, 1, 5, 80, 0.2), (2, 2, 8, 130, 0.1), (3, 1, 2, 7, 9.0)]


def _scattered_decode_step(dtype, shape=DECODE_SHAPES[0], seed=3):
    """q [rows, heads, group, 1, d], K/V pools [heads, 200, d] and rows of unequal lengths (1 to 40,
    odd among them) over scattered slots: a decode step (grouped-query attention where group > 1)."""
    rng = np.random.default_rng(seed)
    rows, heads, group, d, scale = shape
    pool = 200
    k, v = rng.standard_normal((2, heads, pool, d)).astype(dtype)
    q = (rng.standard_normal((rows, heads, group, 1, d)) * scale).astype(dtype)
    counts = np.array([40, 1, 17, 2, 33])[:rows]
    slots = np.stack([rng.permutation(pool)[: counts.max()] for _ in range(rows)])
    return q, k, v, slots, counts


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("shape", [DECODE_SHAPES[0], DECODE_SHAPES[2]])
def test_threads_split_the_decode_kernel_s_rows_and_heads_without_changing_a_bit(shape, window, dtype, thread_count):
    """Rows of unequal lengths over scattered slots: the same bits at 1, 2 and 3 threads, each
    thread a range of (row, KV head) pairs of about equal work."""
    dtype = _dtype(dtype)
    if not paged_attention.supported(np.zeros(1, dtype), np.zeros(1, dtype)):
        pytest.skip("the fused CPU kernels are off (no numba, or HPC_TP_CPU_KERNELS=0)")
    q, k, v, slots, counts = _scattered_decode_step(dtype, shape)
    results = []
    for count in (1, 2, 3):
        thread_count(count)
        out = np.zeros_like(q)
        paged_attention.decode(q, k, v, slots, counts, out, window)
        results.append(out)
    assert all(np.array_equal(results[0], result) for result in results[1:])
    assert np.isfinite(results[0].astype(np.float64)).all()


def _exact_decode(q, k, v, slots, counts, window):
    """The decode step's attention in float64, row by row over each row's visible slots."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    for b, n in enumerate(counts):
        seen = slots[b, max(0, n - window) if window else 0 : n]
        scores = np.einsum("hgd,hkd->hgk", q[b, :, :, 0], k[:, seen])
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[b, :, :, 0] = np.einsum("hgk,hkd->hgd", p / p.sum(axis=-1, keepdims=True), v[:, seen])
    return out


@pytest.mark.parametrize("dtype, path", [("bfloat16", "vdpbf16ps"), ("bfloat16", "widened"), ("float16", "widened")])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("window", [0, 5])
def test_half_pools_give_the_exact_attention_rounded_once(dtype, path, shape, window, monkeypatch):
    """Half-precision queries and pools: scores, softmax and sums in float32, the output rounded once,
    so each value is the exact attention of the same inputs rounded to the dtype, or (where the float32
    sums land across a rounding boundary) the value one step beside it. bfloat16 on ``vdpbf16ps``
    (``kernels.paged_bf16``) where the CPU has it, and widened to float32 (the path elsewhere, forced)."""
    dtype = _dtype(dtype)
    if not paged_attention.supported(np.zeros(1, dtype), np.zeros(1, dtype)):
        pytest.skip("the fused CPU kernels are off (no numba, or HPC_TP_CPU_KERNELS=0)")
    if path == "vdpbf16ps" and not paged_bf16.AVAILABLE:
        pytest.skip("needs a CPU with avx512_bf16")
    monkeypatch.setattr(paged_bf16, "AVAILABLE", path == "vdpbf16ps")
    q, k, v, slots, counts = _scattered_decode_step(dtype, shape)
    out = np.zeros_like(q)
    paged_attention.decode(q, k, v, np.asfortranarray(slots), counts, out, window)  # slots of any strides
    want = _exact_decode(q, k, v, slots, counts, window).astype(dtype)
    # adjacent values of one sign are adjacent integers in the bits (the exact values here are far from 0)
    steps = np.abs(out.view(np.int16).astype(np.int64) - want.view(np.int16).astype(np.int64))
    assert steps.max() <= 1 and (steps == 0).mean() >= 0.9


def test_warm_up_compiles_the_bfloat16_decode_kernel_where_the_cpu_takes_it():
    """In a fresh process, ``paged_attention.warm_up`` for a bfloat16 model leaves ``paged_bf16``'s
    kernel compiled (or loaded from numba's cache) before a server's first request would wait for it."""
    if not paged_bf16.AVAILABLE:
        pytest.skip("needs numba and a CPU with avx512_bf16")
    code = (
        "import ml_dtypes; from hpc_tp.kernels import paged_attention, paged_bf16; "
        "paged_attention.warm_up(ml_dtypes.bfloat16); print(len(paged_bf16._decode.signatures))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(result.stdout) == 1


def test_the_bfloat16_kernel_s_softmax_weights_are_exp_within_a_float32_ulp():
    """``paged_bf16``'s vector exp on [-87, 0] against float64's, each weight within one ulp; a nan
    score stays nan."""
    if not paged_bf16.AVAILABLE:
        pytest.skip("needs numba and a CPU with avx512_bf16")
    numba = pytest.importorskip("numba")
    softmax = numba.njit(lambda scores: paged_bf16._softmax_row(scores, 0, scores.shape[0]))
    scores = np.linspace(-87.0, 0.0, 200_001).astype(np.float32)  # the last the largest: 0
    weights = scores.copy()
    total = softmax(weights)
    exact = np.exp(scores.astype(np.float64))
    assert (np.abs(weights - exact) <= np.spacing(exact.astype(np.float32))).all()
    assert abs(total - exact.sum()) <= 1e-6 * exact.sum()
    with_nan = np.array([1.0, np.nan, 2.0], np.float32)
    softmax(with_nan)
    assert np.isnan(with_nan[1]) and with_nan[2] == 1.0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["llama-gqa", "llama-window"])
def test_bfloat16_continuous_batching_at_tp_gives_one_process_tokens(name, monkeypatch):
    """bfloat16 requests through continuous batching, two rows for four prompts, every decode step's
    attention on the paged kernel: at tp = the world size each request's greedy tokens are one process's."""
    dtype = _dtype("bfloat16")
    if not paged_attention.supported(np.zeros(1, dtype), np.zeros(1, dtype)):
        pytest.skip("the fused CPU kernels are off (no numba, or HPC_TP_CPU_KERNELS=0)")
    calls, decode = [], paged_attention.decode
    monkeypatch.setattr(paged_attention, "decode", lambda *args: calls.append(1) or decode(*args))
    tokens = []
    for comm in tp_and_reference():
        model = larger_weights(GPTModel(ModelConfig(**CONFIGS[name]), comm, dtype=dtype, seed=4))
        params = [SamplingParams(max_new_tokens=6, ignore_eos=True) for _ in PROMPTS]
        out = ContinuousBatcher(Engine(model, ByteTokenizer()), 2).generate(
            *((PROMPTS, params) if comm.rank == 0 else ())
        )
        tokens.append(comm.allgather_object(None if out is None else [c.ids for c, _ in out])[0])
    assert tokens[0] == tokens[1] and all(len(ids) == 6 for ids in tokens[0]) and calls


def test_layers_of_one_window_are_a_kind_whose_blocks_take_units_of_one_pool():
    """Windows 3 and none, 4 layers to 2: units of 2 layers, a windowed block 2 units and a global one
    1, three lanes; a windowed kind holds at most its window and a chunk, so what a sequence holds,
    and the longest that fits a pool, count its window and not its length."""
    layout = PagedLayout([3, 3, 0, 3, 3, 0], 2)
    assert (layout.windows, layout.group, layout.units, layout.lanes) == ([0, 3], 2, [1, 2], 3)
    assert layout.places(range(6)) == [(0, 1), (1, 1), (0, 0), (0, 2), (1, 2), (1, 0)]
    assert layout.places([3, 4, 5]) == [(0, 2), (1, 2), (0, 0)]  # a pipeline stage's own layers
    assert layout.cap(0) is None and layout.cap(1) == 2  # 3 positions: 2 blocks of 2 wherever they fall
    assert layout.units_for(20) == 10 + 2 * 2 and layout.most_slots(20) == 2 * 16  # 16 + 2 x 2 units
    assert PagedLayout([3, 3, 0, 3, 3, 0], 2, chunk_tokens=8).cap(1) == 6  # slots 6..15 of a chunk 8..15
    plain = PagedLayout([0, 0, 0], 16)
    assert (plain.group, plain.units, plain.places(range(3)), plain.most_slots(5)) == (
        3,
        [1],
        [(0, 0), (1, 0), (2, 0)],
        80,
    )
    assert PagedLayout([4, 4], 2).most_slots(3) is None  # every layer windowed, the window fits: any length


def test_a_windowed_kind_gives_back_what_its_window_passed_and_shares_what_it_sees():
    """Layers of window 3 and global ones, blocks of 2: blocks reserved together take their units in a
    run, dealt column by column (each lane's slots in order). As a sequence decodes, its global kind keeps
    every block and its windowed kind gives back those wholly before its window (the scratch unit in
    their place). A prompt that begins with its tokens shares every global block and the windowed
    blocks its window sees, and copies the partly filled block of each kind, every unit of it; once
    the oldest windowed blocks are evicted, the prefix is still found as far as the window's are
    cached. Every reference comes back."""
    m = BlockManager(30, PagedLayout([3, 3, 0, 3, 3, 0], 2))
    fresh = Sequence(2)
    assert m.reserve(fresh, 6)  # 3 global blocks, units 1-3; 3 windowed ones, units 4-9 dealt by column
    assert fresh.tables == [[1, 2, 3], [4, 5, 6]] and (m.slots(fresh, 6) == np.arange(2, 20).reshape(3, 6)).all()
    m.release(fresh)
    a = Sequence(2)
    for token in IDS + [9]:  # 11 tokens decoded one at a time
        assert m.reserve(a, a.length + 1)
        m.written(a, [token])
        assert len(a.tables[1]) - a.dropped[1] <= 2  # the window's 3 positions
    (glob, windowed), dropped = a.tables, a.dropped[1]
    assert len(glob) == len(windowed) == 6 and dropped == 4 and windowed[:4] == [SCRATCH] * 4
    assert m.available() == 29 - 6 - 2 * 2  # the given-back blocks are evictable: available
    b = Sequence(2)
    copies = m.admit(b, IDS + [9, 5], 11)  # 5 full blocks and the first token of a's sixth
    assert b.length == 11 and b.tables[0][:5] == glob[:5] and b.tables[1][4] == windowed[4]
    assert b.dropped == [0, 4] and [m.refs[x] for x in glob] == [2] * 5 + [1] and m.refs[windowed[4]] == 2
    sources = [glob[5], *m.members[windowed[5]]]
    assert [s for s, _ in copies] == sources and len({t for _, t in copies} | set(sources)) == 6  # 3 units each
    m.release(b)
    m.release(a)
    assert not any(m.refs) and m.available() == 29
    c = Sequence(2)
    assert m.reserve(c, 10)  # 5 + 5 x 2 units: the free 11, then the 2 oldest blocks (a's first windowed) evicted
    d = Sequence(2)
    assert m.admit(d, IDS, 10) == [] and d.length == 10 and d.tables[0] == glob[:5] and d.dropped == [0, 4]
    m.release(c)
    m.release(d)
    assert not any(m.refs)


def _gemma_like(tp):
    """Gemma 3's block with two layers of window 3, then a global one: a windowed block is 2 units."""
    kinds = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg = dict(CONFIGS["gemma3"], n_layers=3, layer_types=kinds, max_seq_len=40)
    return larger_weights(GPTModel(ModelConfig(**cfg), tp))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_windowed_layers_hold_only_their_window_beside_global_ones(block_size, events, monkeypatch):
    """A Gemma-3-like model served with chunks of 4: a long request and a short one, then a chat's next
    turn after the long one (its prompt and answer, then more), which finds its prefix cached. After
    every iteration each request's windowed kind holds no more than its window and a chunk while the
    global kind holds every block; windowed blocks are given back. Each request gives the tokens and
    logits it gives alone through the contiguous cache; every reference comes back."""
    tp, _ = tp_and_reference()
    engine, held, forward = Engine(_gemma_like(tp), ByteTokenizer()), [], ContinuousBatcher._forward

    def spy(self, admitted):
        logits = forward(self, admitted)
        for s in self.seqs:
            assert len(s.tables[0]) == self.blocks.blocks_for(s.length)  # global: every block
            held.append((len(s.tables[1]) - s.dropped[1], s.dropped[1]))
        return logits

    monkeypatch.setattr(ContinuousBatcher, "_forward", spy)
    long_prompt = [int(i) for i in np.random.default_rng(3).integers(0, 256, 20)]
    first = Request(long_prompt, 4)
    answer, _ = _alone(engine, first, events)
    answer = tp.bcast_object(answer[0][0].ids if tp.rank == 0 else None)
    requests = [first, Request(PROMPTS[0], 6), Request(long_prompt + answer + [7, 8, 9], 4)]
    for request in requests:
        events.watch(request)
    batcher = ContinuousBatcher(engine, 2, block_size=block_size, chunk_tokens=4)
    assert batcher.layout.units == [1, 2]
    batcher.run(Script([(1, requests[0]), (1, requests[1]), (30, requests[2])]) if tp.rank == 0 else None)
    assert max(h for h, _ in held) <= batcher.layout.cap(1) and not any(batcher.blocks.refs)
    assert max(d for _, d in held) > 0 or block_size == 16  # windowed blocks given back (a block of 16: none)
    for request in requests:
        _agrees_with_alone(engine, request, events)
    if tp.rank == 0:
        assert requests[2].done[0].cached_tokens == len(long_prompt) + len(answer) - 1


@pytest.mark.mpi(min_size=1)
def test_a_long_request_fits_a_pool_that_holds_only_its_windowed_layers_window(events, monkeypatch):
    """The Gemma-3-like model, blocks of 1, chunks of 4, a pool of 46 units: a windowed block takes 2
    units and a global one 1, a request holds at most 6 windowed blocks, so one of 34 tokens fits
    (34 + 2 x 6) where counting every layer's every token it would need 102 units. Three requests,
    the longest 32 positions, preempt each other and each gives the tokens and logits it gives alone;
    one of 35 positions is refused."""
    tp, _ = tp_and_reference()
    engine, preempted, forward = Engine(_gemma_like(tp), ByteTokenizer()), [], ContinuousBatcher._forward

    def spy(self, admitted):
        logits = forward(self, admitted)
        preempted.extend(self.preempted)
        return logits

    monkeypatch.setattr(ContinuousBatcher, "_forward", spy)
    long_prompt = [int(i) for i in np.random.default_rng(4).integers(0, 256, 27)]
    requests = [Request(long_prompt, 6), Request(PROMPTS[2], 14), Request(PROMPTS[0] + [9, 9], 12)]
    for request in requests:
        events.watch(request)
    memory = _tiny_pool(engine, 47, 1)
    batcher = ContinuousBatcher(engine, 3, block_size=1, chunk_tokens=4, kv_cache_memory=memory)
    assert batcher.kv_tokens == 34 and batcher.blocks.usable == 46
    batcher.run(Script([(1, r) for r in requests]) if tp.rank == 0 else None)
    assert preempted and not any(batcher.blocks.refs)
    for request in requests:
        _agrees_with_alone(engine, request, events)
    with pytest.raises(ConfigError, match=r"needs 35 positions; this server's KV cache holds 34 tokens \(--kv-cache"):
        asked = [SamplingParams(max_new_tokens=6)]
        batcher.generate([[1] * 30] if tp.rank == 0 else None, asked if tp.rank == 0 else None)
