"""Incremental decoding: the KV cache gives the full forward pass's logits at every position, greedy
tokens are the same at every tp, a Llama-family model matches a plain-numpy reference, sampling and
stop rules behave, and ``hpc-tp generate`` serves a JSON-lines batch from a checkpoint."""

import json
import math

import numpy as np
import pytest
from test_model import GEMMA3_BLOCK
from tp_helpers import CaptureProbe, max_rel_err, tp_and_reference

from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.module import gather_full
from hpc_tp.nn import attention
from hpc_tp.nn.attention import rope_inv_freq
from hpc_tp.serve.decoding import FixedStep, GrowingStep, decode_stepper
from hpc_tp.serve.generate import Engine, left_pad
from hpc_tp.serve.kv_cache import KVCache
from hpc_tp.serve.sampling import SamplingParams, next_token
from hpc_tp.tokenizer import ByteTokenizer

pytestmark = pytest.mark.mpi(min_size=1)

V = 258  # the byte tokenizer's vocabulary
CONFIGS = {
    "gpt2": dict(vocab_size=V, hidden=24, n_layers=2, n_heads=4, ffn_hidden=40, max_seq_len=32),
    # 2 kv heads: replicated at tp = 4; llama3 rope scaling with a short original context so every band is hit
    "llama-gqa": dict(
        vocab_size=V,
        hidden=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=48,
        max_seq_len=32,
        norm="rmsnorm",
        norm_eps=1e-6,
        activation="swiglu",
        position="rope",
        rope_theta=500.0,
        bias=False,
        tie_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}
# Gemma-style layers: a sliding window of 3 positions, then a global one
CONFIGS["llama-window"] = dict(
    CONFIGS["llama-gqa"], rope_scaling=None, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
)
# Qwen3: heads sized apart from hidden (4 x 12 != 32), each query and key head RMS-normed before RoPE.
CONFIGS["qwen3"] = dict(CONFIGS["llama-gqa"], head_dim=12, qk_norm=True, rope_scaling=None)
# Gemma 3's block: post-norms, GeGLU, scaled embeddings, local and global rope bases, soft-capped logits.
CONFIGS["gemma3"] = dict(CONFIGS["llama-window"], **GEMMA3_BLOCK, head_dim=12)
# Qwen-MoE: a dense first layer, then experts narrower than it, a shared expert, the top k unnormalised;
# a capacity that never drops (as imported), so the full forward the cache is checked against drops nothing.
CONFIGS["qwen-moe"] = dict(
    CONFIGS["qwen3"],
    n_layers=3,
    num_experts=4,
    top_k=2,
    capacity_factor=2.0,
    dense_layers=[0],
    expert_ffn_hidden=16,
    shared_expert_ffn_hidden=24,
    normalize_top_k=False,
)
PROMPTS = [[5, 17, 99, 3, 250], [42, 7], [1, 2, 3, 4, 5, 6, 7], [200]]


def _model(name, comm, seed=4):
    return larger_weights(GPTModel(ModelConfig(**CONFIGS[name]), comm, seed=seed))


def larger_weights(model):
    """Larger weights than the training init, so logits vary and greedy choices are far from ties."""
    for i, (name, p) in enumerate(model.named_parameters()):
        gain = "norm" in name and name.endswith("weight")
        p.load_full(np.random.default_rng(100 + i).standard_normal(p.partition.full_shape) * 0.3 + gain)
    return model


@pytest.mark.parametrize("query_block", [None, 3], ids=["one-query-block", "query-blocks-of-3"])
@pytest.mark.parametrize("name", CONFIGS)
def test_cached_logits_equal_full_forward_at_every_position(name, query_block, monkeypatch):
    if query_block:  # the prefill and the full forward run causal attention in blocks of 3 queries
        monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
    tp, _ = tp_and_reference()
    model = _model(name, tp)
    new = 4
    follow = np.random.default_rng(1).integers(0, V, (len(PROMPTS), new))
    tokens, key_mask, positions = left_pad(PROMPTS, new, pad_id=0)
    width = tokens.shape[1]
    cache = KVCache.for_model(model, len(PROMPTS), width + new)
    steps = [model.infer(tokens, positions, key_mask[:, :width], cache, all_positions=True)]
    lens = np.array([len(p) for p in PROMPTS])
    for s in range(new):
        key_mask[:, width + s] = True
        steps.append(
            model.infer(
                follow[:, s : s + 1], (lens + s)[:, None], key_mask[:, : width + s + 1], cache, all_positions=True
            )
        )
    for i, prompt in enumerate(PROMPTS):
        seq = np.array(prompt + list(follow[i]))[None]
        full = model.logits(seq)[0]
        cached = np.concatenate([steps[0][i, width - len(prompt) :]] + [step[i] for step in steps[1:]])
        assert max_rel_err(cached, full) <= 1e-10, f"row {i}"


def test_moe_inference_keeps_every_tokens_experts():
    """Inference is dropless: with a capacity that drops in training, each prompt's logits are the
    same alone and batched with the others (neither its neighbours nor its padding take its place)."""
    tp, _ = tp_and_reference()
    cfg = ModelConfig(**dict(CONFIGS["gpt2"], num_experts=4, top_k=2, capacity_factor=0.5))
    model = larger_weights(GPTModel(cfg, tp, seed=4))

    def last_logits(prompts):
        tokens, key_mask, positions = left_pad(prompts, 0, pad_id=0)
        return model.infer(tokens, positions, key_mask, KVCache.for_model(model, len(prompts), tokens.shape[1]))

    batched = last_logits(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        assert max_rel_err(last_logits([prompt])[0], batched[i]) <= 1e-10, f"prompt {i}"
    assert not any(moe.dropless for moe in model.moe_layers())  # training's capacity is back after the call


@pytest.mark.parametrize("name", CONFIGS)
def test_fixed_shape_decode_steps_equal_growing_ones(name):
    """The steps a CUDA graph replays (all slots attended, the slot, positions and mask moved on by the
    step itself) give the growing steps' logits and fill the cache alike, here eagerly."""
    tp, _ = tp_and_reference()
    model, new = _model(name, tp), 5
    follow = np.random.default_rng(2).integers(0, V, (len(PROMPTS), new))
    lens = np.array([len(p) for p in PROMPTS])
    runs = {}
    for stepper in (GrowingStep, FixedStep):
        tokens, key_mask, positions = left_pad(PROMPTS, new, pad_id=0)
        cache = KVCache.for_model(model, len(PROMPTS), tokens.shape[1] + new)
        model.infer(tokens, positions, key_mask[:, : tokens.shape[1]], cache)
        step = stepper(model, cache, key_mask, lens)
        runs[stepper] = [step.step(follow[:, s]) for s in range(new)], cache
    (growing, cache), (fixed, fixed_cache) = runs[GrowingStep], runs[FixedStep]
    assert max(max_rel_err(f, g) for f, g in zip(fixed, growing)) <= 1e-12
    assert fixed_cache.length == cache.length and max_rel_err(fixed_cache.v, cache.v) <= 1e-12
    assert decode_stepper(model, cache, None, lens).__class__ is GrowingStep  # graphs are for a GPU


@pytest.mark.parametrize("name", CONFIGS)
def test_a_fixed_step_makes_only_collectives_a_graph_holds(name):
    """What a capture of the step records at tp > 1 over NCCL: array collectives on the stream, no
    host call (a scalar, an object, a barrier), which would run once at the capture and never again."""
    probe = CaptureProbe(tp_and_reference()[0])
    model, lens = _model(name, probe), np.array([len(p) for p in PROMPTS])
    tokens, key_mask, positions = left_pad(PROMPTS, 2, pad_id=0)
    cache = KVCache.for_model(model, len(PROMPTS), tokens.shape[1] + 2)
    model.infer(tokens, positions, key_mask[:, : tokens.shape[1]], cache)
    step = FixedStep(model, cache, key_mask, lens)
    step.step(np.arange(len(PROMPTS)))  # the eager first step
    probe.capturing = True
    step.step(np.arange(len(PROMPTS)))
    assert probe.calls or probe.size == 1  # each layer's all-reduces, the head's gather


def test_decoding_captures_a_graph_only_on_a_gpu_over_nccl_or_one_rank_with_steps_to_replay(monkeypatch):
    from hpc_tp import backend

    tp, one = tp_and_reference()
    monkeypatch.setattr(backend, "device", "cuda")  # only the choice is made here; nothing runs on it
    lens = np.array([len(p) for p in PROMPTS])

    def chosen(comm, slots_left, graphs=None):
        model = _model("gpt2", comm)
        cache = KVCache.for_model(model, len(PROMPTS), 7 + slots_left)
        cache.advance(7)
        return type(decode_stepper(model, cache, np.zeros((len(PROMPTS), 7 + slots_left), bool), lens, graphs))

    assert chosen(one, 4) is FixedStep and chosen(one, 3) is GrowingStep  # GRAPH_MIN_STEPS
    assert chosen(one, 4, graphs=False) is GrowingStep
    monkeypatch.setenv("HPC_TP_CUDA_GRAPHS", "0")
    assert chosen(one, 4) is GrowingStep
    monkeypatch.delenv("HPC_TP_CUDA_GRAPHS")
    assert chosen(tp, 4) is (FixedStep if tp.size == 1 else GrowingStep)  # MPI collectives are not captured
    nccl_like = CaptureProbe(tp)
    nccl_like.stream_ordered = True  # as NCCLCommunicator: its collectives are captured with the kernels
    assert chosen(nccl_like, 4) is FixedStep


def test_kv_cache_holds_only_this_ranks_heads():
    tp, _ = tp_and_reference()
    cfg = ModelConfig(**CONFIGS["llama-gqa"])
    cache = KVCache.for_model(_model("llama-gqa", tp), batch=3, max_len=10)
    kv_local = max(cfg.n_kv_heads // tp.size, 1)  # a kv head is replicated when tp > kv heads
    assert cache.k.shape == (cfg.n_layers, 3, kv_local, 10, cfg.head_dim)
    assert cache.nbytes == 2 * cfg.n_layers * 3 * kv_local * 10 * cfg.head_dim * 8


def _greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(model.logits(np.array(ids)[None])[0, -1])))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_same_at_every_tp(name):
    tp, one = tp_and_reference()
    params = [SamplingParams(max_new_tokens=n) for n in (6, 3, 6, 5)]
    results = {}
    for label, comm in (("tp", tp), ("one", one)):
        out = Engine(_model(name, comm), ByteTokenizer()).generate(
            PROMPTS if comm.rank == 0 else None, params if comm.rank == 0 else None
        )
        results[label] = None if out is None else [c.ids for c in out[0]]
    gathered = tp.allgather_object(results["tp"])[0]  # tp rank 0's answer, on every rank
    assert gathered == results["one"]
    reference = _model(name, one)
    for prompt, p, ids in zip(PROMPTS, params, gathered):
        assert ids == _greedy_without_cache(reference, prompt, p.max_new_tokens)


def test_sampled_tokens_same_at_every_tp_and_follow_the_seed():
    tp, one = tp_and_reference()
    params = [SamplingParams(max_new_tokens=6, temperature=1.3, top_k=50, top_p=0.9, seed=s) for s in (1, 2, 1, 3)]
    out_tp = Engine(_model("llama-gqa", tp), ByteTokenizer()).generate(PROMPTS, params)
    out_one = Engine(_model("llama-gqa", one), ByteTokenizer()).generate([PROMPTS[0]] * 4, params)
    ids_tp = tp.allgather_object(None if out_tp is None else [c.ids for c in out_tp[0]])[0]
    ids_one = [c.ids for c in out_one[0]]
    assert ids_tp[0] == _solo(PROMPTS[0], params[0])  # a row does not depend on its batch
    assert ids_one[0] == ids_one[2] and ids_one[0] != ids_one[1]  # same seed, same prompt: same tokens


def _solo(prompt, params):
    out = Engine(_model("llama-gqa", self_comm()), ByteTokenizer()).generate([prompt], [params])
    return out[0][0].ids


def test_top_k_and_top_p_limit_the_choices():
    logits = np.array([0.0, 3.0, 2.9, 1.0, -5.0, 2.95])
    rng = np.random.default_rng(0)
    picks = {next_token(logits, SamplingParams(temperature=1.0, top_k=2), rng) for _ in range(300)}
    assert picks == {1, 5}
    probs = np.exp(logits) / np.exp(logits).sum()  # sorted: 1 (0.38), 5 (0.36), 2 (0.34) ... cumulative
    p = probs[1] + probs[5] * 0.5  # inside the second token's mass: the first two stay
    picks = {next_token(logits, SamplingParams(temperature=1.0, top_p=p), rng) for _ in range(300)}
    assert picks == {1, 5}
    assert next_token(logits, SamplingParams(), rng) == 1
    assert {next_token(logits, SamplingParams(temperature=1.0, top_p=1e-9), rng) for _ in range(50)} == {1}
    # a temperature so small that logits / T overflows acts as greedy (it gave the last id, NaN odds)
    assert {next_token(logits, SamplingParams(temperature=1e-310, top_k=3), rng) for _ in range(20)} == {1}


@pytest.mark.parametrize("model", ["gpt2", "llama-gqa"])
def test_a_request_past_the_context_is_refused_before_any_cache_is_sized(model):
    """RoPE included: 10**15 new tokens once asked the KV cache for petabytes and took the server down."""
    from hpc_tp.serve.generate import check_request

    cfg = ModelConfig(**CONFIGS[model])
    check_request([1] * 30, SamplingParams(max_new_tokens=3), cfg)  # 32 positions: fits
    for prompt, new in ((30, 4), (2, 10**15), (40, 1)):
        with pytest.raises(ConfigError, match="positions; the model has max_seq_len 32"):
            check_request([1] * prompt, SamplingParams(max_new_tokens=new), cfg)
    # a server's own bound below the model's (serve --max-model-len, what its KV cache rows hold)
    check_request([1] * 10, SamplingParams(max_new_tokens=3), cfg, max_model_len=12)
    with pytest.raises(ConfigError, match=r"needs 13 positions; this server takes 12 \(--max-model-len\)"):
        check_request([1] * 10, SamplingParams(max_new_tokens=4), cfg, max_model_len=12)


def test_decoding_never_drops():
    """A checkpoint trained with dropout decodes as the same weights without it (the model's
    dropout switch, on by default for training, is off inside every inference call)."""
    plain = _model("llama-gqa", self_comm())
    dropped = GPTModel(
        ModelConfig(**dict(CONFIGS["llama-gqa"], dropout=0.5, attn_dropout=0.5)), self_comm(), dtype="float64", seed=0
    )
    for name, p in dropped.state().items():
        p.data[...] = plain.state()[name].data
    assert dropped.rng.training
    prompts, params = [list(b"same weights")], [SamplingParams(max_new_tokens=6)]
    want, _ = Engine(plain, ByteTokenizer()).generate(prompts, params)
    got, _ = Engine(dropped, ByteTokenizer()).generate(prompts, params)
    assert got[0].ids == want[0].ids and dropped.rng.training  # switched back after each call


def test_a_cancelled_row_stops_and_the_batch_ends_with_the_others():
    engine = Engine(_model("llama-gqa", self_comm()), ByteTokenizer())
    prompts, params = (
        [list(b"abandoned"), list(b"kept")],
        [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=4)],
    )
    alone, _ = engine.generate([prompts[1]], [params[1]])
    infer, calls = engine.model.infer, []
    engine.model.infer = lambda *args: calls.append(1) or infer(*args)
    got, _ = engine.generate(prompts, params, cancelled=lambda row: row == 0)
    assert got[0].finish_reason == "cancelled" and got[0].ids == []
    assert (got[1].ids, got[1].finish_reason) == (alone[0].ids, alone[0].finish_reason)
    assert len(calls) <= 4  # prefill and 3 decode steps for the kept row's 4 tokens, not 20 steps


def test_stop_string_eos_and_streamed_text():
    _, one = tp_and_reference()
    engine = Engine(_model("gpt2", one), ByteTokenizer())
    plain, _ = engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=12)])
    text = plain[0].text
    stop = text[3:5]
    assert plain[0].finish_reason == "length" and len(plain[0].ids) == 12 and len(stop) == 2
    pieces = []
    out, metrics = engine.generate(
        [PROMPTS[0]] * 2,
        [SamplingParams(max_new_tokens=12, stop=[stop])] * 2,
        on_text=lambda row, piece, finish: pieces.append((row, piece, finish)),
    )
    assert out[0].text == text[: text.find(stop)] and out[0].finish_reason == "stop"
    assert "".join(p for r, p, _ in pieces if r == 0) == out[0].text
    assert [f for r, _, f in pieces if r == 0][-1] == "stop"
    assert metrics.new_tokens == 2 * len(out[0].ids) and metrics.kv_cache_bytes_per_rank[0] > 0
    # A stop id: make the model's first greedy pick one
    eos_first = ByteTokenizer()
    eos_first.stop_ids = frozenset({plain[0].ids[0]})
    out, _ = Engine(engine.model, eos_first).generate([PROMPTS[0]], [SamplingParams(max_new_tokens=5)])
    assert out[0].ids == [] and out[0].text == "" and out[0].finish_reason == "stop"


def _hf_llama3_inv_freq(dim, base, factor, low, high, original):
    """The llama3 rule written as Hugging Face's three cases."""
    inv = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            s = (original / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def test_rope_scaling_inverse_frequencies():
    scaling = CONFIGS["llama-gqa"]["rope_scaling"]
    got = rope_inv_freq(64, 500.0, scaling)
    want = _hf_llama3_inv_freq(64, 500.0, 4.0, 1.0, 4.0, 32)
    assert np.allclose(got, want, rtol=1e-14, atol=0)
    ratio = got / rope_inv_freq(64, 500.0)
    kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, 0.25)
    assert kept.any() and divided.any() and not (kept | divided).all()  # all three bands are exercised
    assert np.allclose(rope_inv_freq(8, 100.0, {"type": "linear", "factor": 2.0}), rope_inv_freq(8, 100.0) / 2)


# -- an independent Llama forward in plain numpy -------------------------------------------------------
def _numpy_llama(w, cfg, ids):
    h, nh, nkv, d = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    t = len(ids)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * g

    inv = _hf_llama3_inv_freq(d, cfg.rope_theta, 4.0, 1.0, 4.0, 32)
    ang = np.outer(np.arange(t), inv)
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))

    def rotate(x):  # x [heads, T, d]; HF's rotate_half
        return x * cos + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    x = w["embed.weight"][ids]
    for layer in range(cfg.n_layers):
        p = lambda name: w[f"layers.{layer}.{name}"]  # noqa: E731
        a = rms(x, p("norm1.weight"))
        q = (a @ p("attn.qkv.q.weight")).reshape(t, nh, d).transpose(1, 0, 2)
        k = (a @ p("attn.qkv.k.weight")).reshape(t, nkv, d).transpose(1, 0, 2)
        v = (a @ p("attn.qkv.v.weight")).reshape(t, nkv, d).transpose(1, 0, 2)
        q, k = rotate(q), rotate(k)
        k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)  # query head j uses kv head j // group
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(1, 0, 2).reshape(t, h) @ p("attn.out.weight")
        m = rms(x, p("norm2.weight"))
        gate, up = m @ p("mlp.fc1.gate.weight"), m @ p("mlp.fc1.up.weight")
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p("mlp.fc2.weight")
    return rms(x, w["final_norm.weight"]) @ w["head.weight"].T


def test_llama_matches_numpy_reference():
    tp, _ = tp_and_reference()
    model = _model("llama-gqa", tp)
    cfg = model.cfg
    weights = {name: gather_full(p.data, p.partition, tp) for name, p in model.named_parameters()}
    prompt = PROMPTS[2]
    want = _numpy_llama(weights, cfg, np.array(prompt))
    cache = KVCache.for_model(model, 1, len(prompt))
    got = np.concatenate(
        [model.infer(np.array([prompt[:3]]), np.arange(3)[None], np.ones((1, 3), bool), cache, all_positions=True)[0]]
        + [
            model.infer(np.array([[tok]]), np.array([[i]]), np.ones((1, i + 1), bool), cache, all_positions=True)[0]
            for i, tok in enumerate(prompt[3:], start=3)
        ]
    )
    assert max_rel_err(got, want) <= 1e-6
    assert max_rel_err(model.logits(np.array([prompt]))[0], want) <= 1e-6


# -- hpc-tp generate -----------------------------------------------------------------------------------
def write_checkpoint(folder, name, grid, tokenizer=None):
    """A checkpoint of the random model ``name`` as the trainer writes one: meta["config"] and the tokenizer."""
    from hpc_tp.checkpoint import save_checkpoint
    from hpc_tp.tokenizer import saved_files

    model = _model(name, grid.tp)
    files = saved_files(tokenizer) if tokenizer is not None else {}
    return save_checkpoint(folder, 1, model.state(), {"step": 1, "config": model.cfg.to_dict()}, grid, files=files)


@pytest.mark.parametrize("batching", ["continuous", "static"])
@pytest.mark.parametrize("tp_flag", [None, "1"])
def test_generate_command_serves_a_jsonl_batch(tmp_path, tp_flag, batching):
    from hpc_tp.cli import main
    from hpc_tp.comm.mpi import world
    from hpc_tp.grid import ProcessGrid

    comm = world()
    folder = comm.bcast_object(tmp_path if comm.rank == 0 else None)  # one folder for every rank
    grid = ProcessGrid(tp=comm.size, world=comm)
    ckpt = write_checkpoint(folder / "ckpt", "llama-gqa", grid, ByteTokenizer())
    texts = ["Hello", "tensor parallel", "x", "a longer prompt than others", "ok"]  # within max_seq_len 32
    lines = [{"prompt": t, "id": f"p{i}"} for i, t in enumerate(texts)]
    lines[1]["max_new_tokens"] = 3
    lines[2].update(temperature=0.8, seed=5)
    if comm.rank == 0:
        (folder / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    comm.barrier()
    flags = [
        "generate",
        "--ckpt",
        str(ckpt),
        "--prompts",
        str(folder / "in.jsonl"),
        "--out",
        str(folder / "out.jsonl"),
        "--max-new-tokens",
        "5",
        "--batch-size",
        "2",
        "--dtype",
        "float64",
        "--batching",
        batching,
    ]
    assert main(flags + (["--tp", tp_flag] if tp_flag else [])) == 0
    comm.barrier()
    got = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    assert [g["id"] for g in got] == [line["id"] for line in lines]
    engine = Engine(_model("llama-gqa", self_comm()), ByteTokenizer())
    params = [
        SamplingParams(
            max_new_tokens=line.get("max_new_tokens", 5),
            temperature=line.get("temperature", 0.0),
            seed=line.get("seed", 0),
        )
        for line in lines
    ]
    want, _ = engine.generate([list(t.encode()) for t in texts], params)
    assert [g["completion"] for g in got] == [w.text for w in want]
    assert [g["completion_tokens"] for g in got] == [len(w.ids) for w in want]
    batch = got[0]["batch"]
    assert len(batch["kv_cache_bytes_per_rank"]) == (comm.size if tp_flag is None else 1)
    assert all(1 <= g["batch"]["batch"] <= 2 for g in got)  # --batch-size rows at most, either way
    assert got[0]["ttft_s"] > 0 and any(g["decode_tokens_per_s"] > 0 for g in got)


def test_generate_command_refuses_bad_input_on_every_rank(tmp_path):
    from hpc_tp.cli import main
    from hpc_tp.comm.mpi import world
    from hpc_tp.grid import ProcessGrid

    comm = world()
    folder = comm.bcast_object(tmp_path if comm.rank == 0 else None)
    ckpt = write_checkpoint(folder / "ckpt", "gpt2", ProcessGrid(tp=comm.size, world=comm))
    if comm.rank == 0:
        (folder / "in.jsonl").write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    comm.barrier()
    assert main(["generate", "--ckpt", str(ckpt), "--prompts", str(folder / "in.jsonl")]) == 2
    # learned positions: 30 prompt tokens + 8 new ones do not fit max_seq_len 32
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "x" * 30, "--max-new-tokens", "8"]) == 2


def test_decode_benchmark_splits_token_time():
    from hpc_tp.bench.decode import benchmark_decode

    tp, _ = tp_and_reference()
    cfg = ModelConfig(**CONFIGS["llama-gqa"])
    r = benchmark_decode(tp, cfg, batch=2, prompt_len=5, new_tokens=3, dtype="float64", warmup=1)
    assert r["tp"] == tp.size and abs(r["compute_s"] + r["comm_s"] - r["token_s"]) <= 1e-12
    assert (r["comm_s"] > 0) == (tp.size > 1) and r["tokens_per_s"] == 2 / r["token_s"] and r["first_step_s"] > 0
    assert not r["cuda_graph"]  # graphs are for a GPU
    kv_local = max(cfg.n_kv_heads // tp.size, 1)
    assert r["kv_cache_bytes_per_rank"] == [2 * cfg.n_layers * 2 * kv_local * 9 * cfg.head_dim * 8] * tp.size
