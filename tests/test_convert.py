"""Importers and export: Hugging Face folders (GPT-2, Llama with GQA, Qwen2 biases) and GGUF files the
tests write themselves with random weights, checked against a forward pass written here in plain numpy;
the converted checkpoint gives the same logits at every tp; convert -> export -> convert is exact;
bad inputs are one-line errors naming the file and the tensor, and nothing is overwritten."""

import argparse
import dataclasses
import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from test_model import CONFIGS
from tp_helpers import lm_batch, max_rel_err

from hpc_tp.checkpoint import convert, export, load_checkpoint, save_checkpoint
from hpc_tp.checkpoint.importers.source import open_source
from hpc_tp.cli import main
from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.models.config import ModelConfig
from hpc_tp.models.gpt import GPTModel

mpi = pytest.mark.mpi(min_size=1)
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 50, 16, 2, 4, 2, 24, 32
IDS = np.array([[1, 7, 3, 49, 0, 12], [5, 5, 9, 2, 48, 30]])


# -- sources the tests write -------------------------------------------------------------------------------
def gpt2_source(seed=0):
    rng = np.random.default_rng(seed)
    h, f = HIDDEN, 4 * HIDDEN
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": VOCAB,
        "n_embd": h,
        "n_layer": LAYERS,
        "n_head": HEADS,
        "n_positions": CONTEXT,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
    }
    t = {
        "wte.weight": rng.normal(0, 0.5, (VOCAB, h)),
        "wpe.weight": rng.normal(0, 0.5, (CONTEXT, h)),
        "ln_f.weight": 1 + rng.normal(0, 0.1, h),
        "ln_f.bias": rng.normal(0, 0.1, h),
    }
    for i in range(LAYERS):
        p = f"h.{i}."
        for name, shape in (("ln_1.weight", h), ("ln_2.weight", h)):
            t[p + name] = 1 + rng.normal(0, 0.1, shape)
        for name, shape in (
            ("ln_1.bias", (h,)),
            ("ln_2.bias", (h,)),
            ("attn.c_attn.weight", (h, 3 * h)),
            ("attn.c_attn.bias", (3 * h,)),
            ("attn.c_proj.weight", (h, h)),
            ("attn.c_proj.bias", (h,)),
            ("mlp.c_fc.weight", (h, f)),
            ("mlp.c_fc.bias", (f,)),
            ("mlp.c_proj.weight", (f, h)),
            ("mlp.c_proj.bias", (h,)),
        ):
            t[p + name] = rng.normal(0, 0.3, shape)
    return config, t


def llama_source(seed=0, tie=False, qwen=False, hidden=HIDDEN, ffn=FFN, rope_scaling=None):
    rng = np.random.default_rng(seed)
    h, d = hidden, hidden // HEADS
    config = {
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": VOCAB,
        "hidden_size": h,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": ffn,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500.0,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "rope_scaling": rope_scaling,
    }
    t = {"model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, h)), "model.norm.weight": 1 + rng.normal(0, 0.1, h)}
    if not tie:
        t["lm_head.weight"] = rng.normal(0, 0.3, (VOCAB, h))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, h)
        t[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, h)
        for name, shape in (
            ("self_attn.q_proj", (HEADS * d, h)),
            ("self_attn.k_proj", (KV_HEADS * d, h)),
            ("self_attn.v_proj", (KV_HEADS * d, h)),
            ("self_attn.o_proj", (h, HEADS * d)),
            ("mlp.gate_proj", (ffn, h)),
            ("mlp.up_proj", (ffn, h)),
            ("mlp.down_proj", (h, ffn)),
        ):
            t[p + name + ".weight"] = rng.normal(0, 0.3, shape)
            if qwen and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                t[p + name + ".bias"] = rng.normal(0, 0.3, shape[0])
    return config, t


def write_hf(folder: Path, config: dict, tensors: dict, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def llama_cpp_permute(w, heads):
    """What llama.cpp's converter does to q/k rows (the importer must undo it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Experts (Mixtral's block_sparse_moe, Qwen-MoE's mlp), stacked per projection in one [experts, out, in] tensor.
EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight")
GGUF_STACKED = {
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def mixtral_source(seed=0, experts=4, top_k=2) -> tuple[dict, dict]:
    """A Llama source whose MLPs are Mixtral's block_sparse_moe: a router and ``experts`` SwiGLU experts."""
    config, tensors = llama_source(seed)
    rng = np.random.default_rng(seed + 1)
    t = {k: v for k, v in tensors.items() if ".mlp." not in k}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.block_sparse_moe."
        t[p + "gate.weight"] = rng.normal(0, 1.0, (experts, HIDDEN))
        for e in range(experts):
            for name, shape in (("w1", (FFN, HIDDEN)), ("w3", (FFN, HIDDEN)), ("w2", (HIDDEN, FFN))):
                t[f"{p}experts.{e}.{name}.weight"] = rng.normal(0, 0.3, shape)
    return {
        **config,
        "model_type": "mixtral",
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "sliding_window": None,
    }, t


def mixtral_mlp(config, t, layer, m):
    """Mixtral's MoE: softmax over the router's logits, the top k renormalised, their experts summed."""
    p = f"model.layers.{layer}.block_sparse_moe."
    logits = m @ t[p + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[..., : config["num_experts_per_tok"]]
    out = np.zeros_like(m)
    for idx in np.ndindex(m.shape[:-1]):
        chosen = top[idx]
        weights = probs[idx][chosen] / probs[idx][chosen].sum()
        for e, w in zip(chosen, weights):
            gate, up = m[idx] @ t[f"{p}experts.{e}.w1.weight"].T, m[idx] @ t[f"{p}experts.{e}.w3.weight"].T
            out[idx] += w * ((gate / (1 + np.exp(-gate)) * up) @ t[f"{p}experts.{e}.w2.weight"].T)
    return out


def phi3_source(config: dict, tensors: dict) -> tuple[dict, dict]:
    """A Llama source as Phi-3 stores it: q, k, v fused by rows into qkv_proj, gate and up into
    gate_up_proj; a sliding window of 4 positions (shorter than the test's sequences)."""
    fused = {
        k: v
        for k, v in tensors.items()
        if not k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"))
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        fused[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        )
        fused[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]
        )
    return {**config, "model_type": "phi3", "sliding_window": 4}, fused


def unfused(config: dict, tensors: dict) -> dict:
    """Phi-3's tensors back under Llama's names (for the reference forward pass)."""
    q = config["num_attention_heads"] * (config["hidden_size"] // config["num_attention_heads"])
    kv = config["num_key_value_heads"] * (config["hidden_size"] // config["num_attention_heads"])
    out = dict(tensors)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv, gate_up = out.pop(p + "self_attn.qkv_proj.weight"), out.pop(p + "mlp.gate_up_proj.weight")
        out.update(
            {
                p + "self_attn.q_proj.weight": qkv[:q],
                p + "self_attn.k_proj.weight": qkv[q : q + kv],
                p + "self_attn.v_proj.weight": qkv[q + kv :],
                p + "mlp.gate_proj.weight": gate_up[: len(gate_up) // 2],
                p + "mlp.up_proj.weight": gate_up[len(gate_up) // 2 :],
            }
        )
    return out


def quantized_blocks(data: np.ndarray, kind) -> np.ndarray:
    """``data`` [rows, n] as GGML ``kind`` blocks: quantized by the gguf package where it can, else (the
    K-quants) blocks of random bytes, every byte's bit 6 clear so that each float16 scale in a block is
    finite (its top exponent bit clear): what matters is that reader and package see the same bytes."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    try:
        return quantize(data, kind)
    except NotImplementedError:
        block, nbytes = GGML_QUANT_SIZES[kind]
        raw = np.random.default_rng(int(kind)).integers(0, 256, (data.shape[0], data.shape[1] // block * nbytes))
        return (raw & 0xBF).astype(np.uint8)


def write_gguf(
    path: Path,
    config: dict,
    tensors: dict,
    quantized=("model.layers.0.mlp.gate_proj.weight",),
    arch="llama",
    tokenizer=None,
) -> dict:
    """A llama GGUF of ``tensors`` (HF names): float32, except ``quantized`` (names in Q8_0, or a dict
    name -> GGML type). Returns the weights it really holds (dequantized, in HF layout) for the reference."""
    import gguf
    from gguf.quants import dequantize

    kinds = quantized if isinstance(quantized, dict) else dict.fromkeys(quantized, gguf.GGMLQuantizationType.Q8_0)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if tokenizer:
        tokenizer(w)
    experts = config.get("num_local_experts") or config.get("num_experts")  # Mixtral's or Qwen-MoE's key
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    held, stacks = {}, {}
    for name, value in tensors.items():
        if expert := EXPERT_NAME.fullmatch(name):  # written below, all of a layer's experts stacked per projection
            layer, e, part = expert.groups()
            stacks.setdefault(f"blk.{layer}.{GGUF_STACKED[part]}.weight", {})[int(e)] = value.astype(np.float32)
            held[name] = value.astype(np.float32).astype(np.float64)
            continue
        data = value.astype(np.float32)
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp keeps Hugging Face's [1, hidden] as a vector
            data = data[0]
        order = np.arange(value.shape[0])  # stored row j holds row order[j] of the HF weight
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            data, order = llama_cpp_permute(data, heads), llama_cpp_permute(order, heads)
        if name in kinds:
            data = quantized_blocks(data, kinds[name])
            try:
                stored = dequantize(data, kinds[name])
            except NotImplementedError:  # a type the reader must refuse: no reference values
                stored = np.full(value.shape, np.nan)
        else:
            stored = data
        held[name] = np.empty(value.shape)
        held[name][order] = stored
        gguf_name = {
            "model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight",
        }.get(name)
        if gguf_name is None:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
        if name in kinds:
            w.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=kinds[name])
        else:
            w.add_tensor(gguf_name, data)
    for gguf_name, stack in stacks.items():
        w.add_tensor(gguf_name, np.stack([stack[e] for e in sorted(stack)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


# -- the reference forward pass (plain numpy, float64) --------------------------------------------------
def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attention(q, k, v, heads, kv_heads, causal=True, key_mask=None, window=None):
    """q [B, T, heads*d], k/v [B, T, kv_heads*d]: query head j uses kv head j // (heads/kv_heads);
    with a sliding ``window`` query i sees keys i - window < j <= i."""
    b, t, _ = q.shape
    d = q.shape[-1] // heads
    q = q.reshape(b, t, heads, d).transpose(0, 2, 1, 3)
    k = np.repeat(k.reshape(b, t, kv_heads, d).transpose(0, 2, 1, 3), heads // kv_heads, axis=1)
    v = np.repeat(v.reshape(b, t, kv_heads, d).transpose(0, 2, 1, 3), heads // kv_heads, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    if causal:
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    if window:
        scores = np.where(np.triu(np.ones((t, t), bool), 1 - window), scores, -np.inf)
    if key_mask is not None:
        scores = np.where(key_mask[:, None, None, :].astype(bool), scores, -np.inf)
    return (softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, t, heads * d)


def rope(x, heads, theta, factor=1.0):
    """Rotate-half RoPE on [B, T, heads*d] at positions 0..T-1."""
    b, t, _ = x.shape
    d = x.shape[-1] // heads
    x = x.reshape(b, t, heads, d)
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d) / factor
    angles = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return (x * cos[None, :, None] + rotated * sin[None, :, None]).reshape(b, t, heads * d)


def gpt2_reference(config, t, ids):
    h, eps = config["n_embd"], config["layer_norm_epsilon"]
    x = t["wte.weight"][ids] + t["wpe.weight"][: ids.shape[1]]
    gelu = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))  # noqa: E731
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        a = layer_norm(x, t[p + "ln_1.weight"], t[p + "ln_1.bias"], eps)
        qkv = a @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]
        o = attention(qkv[..., :h], qkv[..., h : 2 * h], qkv[..., 2 * h :], config["n_head"], config["n_head"])
        x = x + o @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        m = layer_norm(x, t[p + "ln_2.weight"], t[p + "ln_2.bias"], eps)
        x = (
            x
            + gelu(m @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"]) @ t[p + "mlp.c_proj.weight"]
            + t[p + "mlp.c_proj.bias"]
        )
    return layer_norm(x, t["ln_f.weight"], t["ln_f.bias"], eps) @ t["wte.weight"].T


def llama_reference(config, t, ids):
    heads, kv, eps, theta = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["rms_norm_eps"],
        config["rope_theta"],
    )
    factor = (config.get("rope_scaling") or {}).get("factor", 1.0)
    linear = lambda z, name: z @ t[name + ".weight"].T + t.get(name + ".bias", 0.0)  # noqa: E731
    x = t["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q = rope(linear(a, p + "self_attn.q_proj"), heads, theta, factor)
        k = rope(linear(a, p + "self_attn.k_proj"), kv, theta, factor)
        o = attention(q, k, linear(a, p + "self_attn.v_proj"), heads, kv, window=config.get("sliding_window"))
        x = x + linear(o, p + "self_attn.o_proj")
        m = rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        if config.get("num_local_experts"):
            x = x + mixtral_mlp(config, t, i, m)
            continue
        gate = linear(m, p + "mlp.gate_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(m, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = t["model.embed_tokens.weight"] if config["tie_word_embeddings"] else t["lm_head.weight"]
    return rms_norm(x, t["model.norm.weight"], eps) @ head.T


# -- helpers ---------------------------------------------------------------------------------------------
def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def convert_on_rank0(write_source, output, comm):
    """Rank 0 writes the source (``write_source()`` returns its path) and converts it in one
    process; the other ranks wait."""
    if comm.rank == 0:
        source = write_source()
        convert.replace_folder(output, False, lambda temp: convert.write_checkpoint(open_source(source), temp))
    comm.barrier()


def tp_logits(ckpt, comm, ids=IDS, tp=None):
    """Logits at tp (default: the world size), with the experts of a MoE model spread over world / tp."""
    tp = comm.size if tp is None else tp
    grid = ProcessGrid(tp=tp, dp=comm.size // tp, ep=comm.size // tp, world=comm)
    meta = load_checkpoint(ckpt, {}, grid)
    model = GPTModel(ModelConfig.from_dict(meta["config"]), grid.tp, ep_comm=grid.ep)
    load_checkpoint(ckpt, model.state(), grid)
    return model.logits(ids)


def cli_args(**values):
    """A command's parsed arguments; ``convert``'s --quantize off unless given."""
    return argparse.Namespace(**{"quantize": None, **values})


# -- logits against the reference, at every tp ----------------------------------------------------------
@mpi
def test_gpt2_logits_match_reference_at_every_tp(shared_dir, comm_world):
    config, tensors = gpt2_source()
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors), shared_dir / "ckpt", comm_world)
    logits = tp_logits(shared_dir / "ckpt", comm_world)
    assert rel_err(logits, gpt2_reference(config, tensors, IDS)) < 1e-10


@mpi
@pytest.mark.parametrize(
    "tie,qwen,shards,scaling",
    [(False, False, 1, None), (True, False, 3, None), (True, True, 1, None), (False, True, 2, 2.0)],
)
def test_llama_family_logits_match_reference_at_every_tp(shared_dir, comm_world, tie, qwen, shards, scaling):
    """GQA (4 heads, 2 kv heads: replicated kv heads at tp=4), tied and untied heads, Qwen2 q/k/v
    biases, sharded safetensors, linear rope scaling carried from config.json."""
    config, tensors = llama_source(
        tie=tie, qwen=qwen, rope_scaling=scaling and {"rope_type": "linear", "factor": scaling}
    )
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors, shards), shared_dir / "ckpt", comm_world)
    logits = tp_logits(shared_dir / "ckpt", comm_world)
    assert rel_err(logits, llama_reference(config, tensors, IDS)) < 1e-10


@mpi
def test_phi3_fused_projections_split_on_import_logits_match_reference_at_every_tp(shared_dir, comm_world):
    """Phi-3 = the Llama block with qkv_proj and gate_up_proj fused by rows: a Hugging Face folder and a
    GGUF file of it give the reference's logits at every tp (GQA replicated at tp = 4), and export
    joins the blocks again."""
    config, tensors = phi3_source(*llama_source())
    reference = llama_reference(config, unfused(config, tensors), IDS)
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors), shared_dir / "ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "ckpt", comm_world), reference) < 1e-10
    path = shared_dir / "phi3.gguf"
    held = comm_world.bcast_object(
        write_gguf(path, config, tensors, quantized=(), arch="phi3") if comm_world.rank == 0 else None
    )
    convert_on_rank0(lambda: path, shared_dir / "gguf-ckpt", comm_world)
    assert (
        rel_err(tp_logits(shared_dir / "gguf-ckpt", comm_world), llama_reference(config, unfused(config, held), IDS))
        < 1e-10
    )
    if comm_world.rank == 0:
        assert main(["export", str(shared_dir / "ckpt"), "-o", str(shared_dir / "out")]) == 0
        assert json.loads((shared_dir / "out" / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
        with safe_open(str(shared_dir / "out" / "model.safetensors"), "np") as f:
            for name, value in tensors.items():
                assert np.array_equal(f.get_tensor(name), value.astype(f.get_tensor(name).dtype)), name
    comm_world.barrier()


@mpi
def test_mistral_sliding_window_logits_match_reference_at_every_tp(shared_dir, comm_world):
    """Mistral's sliding window (3 positions over a sequence of 6) is attention's own window, not a
    shorter context: the reference's logits at every tp, the context kept, and export writes it back."""
    config, tensors = llama_source()
    config = {**config, "model_type": "mistral", "sliding_window": 3}
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors), shared_dir / "ckpt", comm_world)
    logits = tp_logits(shared_dir / "ckpt", comm_world)
    assert rel_err(logits, llama_reference(config, tensors, IDS)) < 1e-10
    assert rel_err(logits, llama_reference({**config, "sliding_window": None}, tensors, IDS)) > 1e-3
    if comm_world.rank == 0:
        assert main(["export", str(shared_dir / "ckpt"), "-o", str(shared_dir / "out")]) == 0
        written = json.loads((shared_dir / "out" / "config.json").read_text())
        assert (written["model_type"], written["sliding_window"]) == ("mistral", 3)
        assert written["max_position_embeddings"] == CONTEXT
        with pytest.raises(ConfigError, match="sliding window of 3 on every layer"):
            export.run(
                cli_args(
                    checkpoint=str(shared_dir / "ckpt"),
                    output=str(shared_dir / "as-llama"),
                    arch="llama",
                    dtype="stored",
                    force=False,
                )
            )
    comm_world.barrier()


@mpi
def test_mixtral_experts_logits_match_reference_at_every_tp(shared_dir, comm_world):
    """Mixtral's router and experts (Hugging Face names, and GGUF's stacked [experts, out, in] tensors)
    become the engine's MoE layers: the reference's logits at tp = 1, 2, 4, dropless."""
    config, tensors = mixtral_source()
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors), shared_dir / "ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "ckpt", comm_world), llama_reference(config, tensors, IDS)) < 1e-10
    if comm_world.rank == 0:  # and back: the same tensors under the same names
        assert main(["export", str(shared_dir / "ckpt"), "-o", str(shared_dir / "out")]) == 0
        assert json.loads((shared_dir / "out" / "config.json").read_text())["num_local_experts"] == 4
        with safe_open(str(shared_dir / "out" / "model.safetensors"), "np") as f:
            assert sorted(f.keys()) == sorted(tensors)
            assert all(np.array_equal(f.get_tensor(n), v) for n, v in tensors.items())
    comm_world.barrier()
    path = shared_dir / "mixtral.gguf"
    held = comm_world.bcast_object(write_gguf(path, config, tensors, quantized=()) if comm_world.rank == 0 else None)
    convert_on_rank0(lambda: path, shared_dir / "gguf-ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "gguf-ckpt", comm_world), llama_reference(config, held, IDS)) < 1e-10


@mpi
def test_qwen2_gguf_biases_and_halves_rope_logits_match_reference_at_every_tp(shared_dir, comm_world):
    """llama.cpp keeps Qwen2's q/k rows as Hugging Face does (no interleaving), with q/k/v biases."""
    config, tensors = llama_source(qwen=True)
    path = shared_dir / "qwen2.gguf"
    held = comm_world.bcast_object(
        write_gguf(path, config, tensors, quantized=(), arch="qwen2") if comm_world.rank == 0 else None
    )
    convert_on_rank0(lambda: path, shared_dir / "ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "ckpt", comm_world), llama_reference(config, held, IDS)) < 1e-10


@mpi
def test_gguf_llama_dequantized_logits_match_reference_at_every_tp(shared_dir, comm_world):
    """float32 tensors, one Q8_0 tensor, llama.cpp's q/k row permutation undone, tied output."""
    config, tensors = llama_source(hidden=32, ffn=64, tie=True)
    path = shared_dir / "model.gguf"
    held = comm_world.bcast_object(write_gguf(path, config, tensors) if comm_world.rank == 0 else None)
    convert_on_rank0(lambda: path, shared_dir / "ckpt", comm_world)
    logits = tp_logits(shared_dir / "ckpt", comm_world)
    assert rel_err(logits, llama_reference(config, held, IDS)) < 1e-10
    gate = "model.layers.0.mlp.gate_proj.weight"
    assert np.abs(held[gate] - tensors[gate]).max() > 0  # the reference really used the quantized weight


GGUF_TYPES = (
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
)


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_every_gguf_type_a_user_downloads_reads_as_the_gguf_package_dequantizes_it(tmp_path, kind):
    """A projection (q: llama.cpp's row order undone) and an MLP weight stored as ``kind``, 256 columns
    (a K-quant block), read back as gguf's own dequantization of the same bytes."""
    import gguf

    config, tensors = llama_source(hidden=256, ffn=256)
    names = {
        "model.layers.0.self_attn.q_proj.weight": "layers.0.attn.qkv.q.weight",
        "model.layers.1.mlp.down_proj.weight": "layers.1.mlp.fc2.weight",
    }
    kinds = dict.fromkeys(names, gguf.GGMLQuantizationType[kind])
    held = write_gguf(tmp_path / "m.gguf", config, tensors, quantized=kinds)
    imported = open_source(tmp_path / "m.gguf")
    for name, ours in names.items():
        assert np.array_equal(imported.tensors[ours][...], held[name].T.astype(np.float32)), name
        assert np.isfinite(held[name]).all() and held[name].std() > 0


def test_a_gguf_type_the_package_cannot_dequantize_is_one_line_naming_the_tensor(tmp_path, capsys):
    import gguf

    config, tensors = llama_source(hidden=256, ffn=256)
    write_gguf(
        tmp_path / "m.gguf",
        config,
        tensors,
        quantized={"model.layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.Q8_1},
    )
    assert main(["convert", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor blk.1.ffn_down.weight is Q8_1" in err[0], err
    assert not (tmp_path / "ckpt").exists()


def test_gguf_quantized_tensor_is_the_dequantized_weight(tmp_path):
    config, tensors = llama_source(hidden=32, ffn=64)
    held = write_gguf(
        tmp_path / "m.gguf",
        config,
        tensors,
        quantized=("model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    )
    imported = open_source(tmp_path / "m.gguf")
    for name, ours in (
        ("model.layers.1.mlp.up_proj.weight", "layers.1.mlp.fc1.up.weight"),
        ("model.layers.0.self_attn.q_proj.weight", "layers.0.attn.qkv.q.weight"),
        ("model.layers.0.self_attn.k_proj.weight", "layers.0.attn.qkv.k.weight"),
    ):
        assert np.array_equal(imported.tensors[ours][...], held[name].T.astype(np.float32))


# -- tokenizers are kept ---------------------------------------------------------------------------------
def test_gguf_tokenizers_become_tokenizer_json(tmp_path):
    from hpc_tp.tokenizer import load_tokenizer_dir

    def gpt2_vocab(w):
        tokens = ["a", "b", "c", "ab", "abc", "\u0120", "\u0120a", "<|endoftext|>"] + [f"t{i}" for i in range(42)]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * 7 + [3] + [1] * 42)
        w.add_token_merges(["a b", "ab c", "\u0120 a"])

    def spm_vocab(w):
        tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
        tokens += [f"t{i}" for i in range(41)]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(3, 50)])
        w.add_token_types([2, 3, 3] + [1] * 47)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(TEMPLATE)

    config, tensors = llama_source(hidden=32, ffn=64)
    for name, vocab, text, ids in (("gpt2", gpt2_vocab, "abc a", [4, 6]), ("spm", spm_vocab, "ab", [8])):
        write_gguf(tmp_path / f"{name}.gguf", config, tensors, quantized=(), tokenizer=vocab)
        main(["convert", str(tmp_path / f"{name}.gguf"), "-o", str(tmp_path / name)])
        tokenizer = load_tokenizer_dir(tmp_path / name / "step-000000")
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == text
        assert tokenizer.eos_id == (7 if name == "gpt2" else 2)
        # a chat template in the file is kept, with the special tokens it names
        assert tokenizer.chat == (
            {} if name == "gpt2" else {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
        )


TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"


def test_hf_tokenizer_json_is_kept_and_round_trips_through_export(tmp_path):
    from tokenizers import Tokenizer, models

    from hpc_tp.tokenizer import load_tokenizer_dir

    config, tensors = gpt2_source()
    source = write_hf(tmp_path / "hf", config, tensors)
    Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(source / "tokenizer.json"))
    # Hugging Face's own tokenizer_config.json: named templates, the eos token as an added-token object
    (source / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [{"name": "tool_use", "template": "no"}, {"name": "default", "template": TEMPLATE}],
                "bos_token": "<s>",
                "eos_token": {"content": "</s>", "special": True},
                "model_max_length": 1024,
            }
        )
    )
    assert main(["convert", str(source), "-o", str(tmp_path / "ckpt")]) == 0
    step = tmp_path / "ckpt" / "step-000000"
    assert (step / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert json.loads((step / "tokenizer_config.json").read_text())["kind"] == "huggingface"
    chat = {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    assert load_tokenizer_dir(step).chat == chat
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == chat
    # a folder's chat_template.jinja wins over the config's, as in Hugging Face's loader
    (source / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert main(["convert", str(source), "-o", str(tmp_path / "ckpt2")]) == 0
    assert (
        load_tokenizer_dir(tmp_path / "ckpt2" / "step-000000").chat["chat_template"] == "{{ messages[0]['content'] }}"
    )


# -- export ----------------------------------------------------------------------------------------------
def read_checkpoint(ckpt) -> tuple[dict, dict]:
    with h5py.File(Path(ckpt) / "step-000000" / "master.h5", "r") as f:
        return {name: ds[...] for name, ds in f["tensors"].items()}, json.loads(f.attrs["meta"])["config"]


@pytest.mark.parametrize("source", ["gpt2", "llama", "qwen2-tied"])
def test_convert_export_convert_is_exact(tmp_path, source):
    config, tensors = gpt2_source() if source == "gpt2" else llama_source(tie="tied" in source, qwen="qwen" in source)
    write_hf(tmp_path / "hf", config, tensors)
    assert main(["convert", str(tmp_path / "hf"), "-o", str(tmp_path / "a")]) == 0
    assert main(["export", str(tmp_path / "a"), "-o", str(tmp_path / "back")]) == 0
    assert main(["convert", str(tmp_path / "back"), "-o", str(tmp_path / "b")]) == 0
    (first, cfg_a), (second, cfg_b) = read_checkpoint(tmp_path / "a"), read_checkpoint(tmp_path / "b")
    assert cfg_a == cfg_b and sorted(first) == sorted(second)
    for name in first:
        assert np.array_equal(first[name], second[name]), name
    with safe_open(str(tmp_path / "back" / "model.safetensors"), "numpy") as f:  # the very same HF tensors
        assert sorted(f.keys()) == sorted(tensors)
        for name, value in tensors.items():
            assert np.array_equal(f.get_tensor(name), value), name


def test_export_refuses_what_the_format_cannot_hold(tmp_path):
    config, tensors = llama_source()
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e5  # beyond float16's 65504
    write_hf(tmp_path / "hf", config, tensors)
    main(["convert", str(tmp_path / "hf"), "-o", str(tmp_path / "ckpt")])
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: values up to 1e\+05 overflow F16"):
        export.run(
            cli_args(
                checkpoint=str(tmp_path / "ckpt"), output=str(tmp_path / "out"), arch=None, dtype="float16", force=False
            )
        )
    assert not (tmp_path / "out").exists()
    moe = ModelConfig(vocab_size=37, hidden=16, n_layers=1, n_heads=2, max_seq_len=8, num_experts=2)
    grid = ProcessGrid(tp=1, world=self_comm())
    save_checkpoint(tmp_path / "moe", 0, GPTModel(moe, grid.tp).state(), {"config": moe.to_dict()}, grid)
    with pytest.raises(ConfigError, match=r"num_experts=2; Mixture-of-Experts models export as mixtral"):
        export.run(
            cli_args(
                checkpoint=str(tmp_path / "moe"), output=str(tmp_path / "out"), arch=None, dtype="stored", force=False
            )
        )


def test_export_refuses_a_nonzero_bias_qwen2_has_no_place_for(tmp_path):
    config, tensors = llama_source(qwen=True)
    write_hf(tmp_path / "hf", config, tensors)
    main(["convert", str(tmp_path / "hf"), "-o", str(tmp_path / "ckpt")])
    with h5py.File(tmp_path / "ckpt" / "step-000000" / "shards" / "rank-00000.h5", "r+") as f:
        f["tensors/layers.0.attn.out.bias"][0] = 1.0  # (the checksum would catch it too: make it agree)
    from hpc_tp.checkpoint.format import unit_checksums

    with h5py.File(tmp_path / "ckpt" / "step-000000" / "master.h5", "r+") as f:
        f["checksums/layers.0.attn.out.bias"][...] = unit_checksums(f["tensors/layers.0.attn.out.bias"][...], 0)
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.out\.bias.*not zero"):
        export.run(
            cli_args(
                checkpoint=str(tmp_path / "ckpt"), output=str(tmp_path / "out"), arch=None, dtype="stored", force=False
            )
        )
    assert not (tmp_path / "out").exists()
    export.run(
        cli_args(
            checkpoint=str(tmp_path / "ckpt"), output=str(tmp_path / "out"), arch="llama", dtype="float32", force=False
        )
    )
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["attention_bias"] and cfg["torch_dtype"] == "float32"


def test_bfloat16_source_is_widened_exactly(tmp_path):
    """numpy has no bfloat16: the file is written by hand, each value cut to its upper 16 bits."""
    config, tensors = llama_source()
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        halves = (value.astype("<f4").view("<u4") >> 16).astype("<u2")
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + halves.nbytes]}
        blobs.append(halves.tobytes())
        offset += halves.nbytes
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    text = json.dumps(header).encode()
    (tmp_path / "hf" / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    got = open_source(tmp_path / "hf").tensors["layers.1.attn.qkv.k.weight"][...]
    k = tensors["model.layers.1.self_attn.k_proj.weight"].astype("<f4")
    assert got.dtype == np.float32
    assert np.array_equal(got, ((k.view("<u4") >> 16) << 16).view("<f4").T)
    assert np.abs(got - k.T).max() <= np.abs(k).max() / 128  # bfloat16 keeps 8 significant bits


def test_narrowing_to_bfloat16_rounds_to_nearest_even_and_keeps_nan_inf():
    from hpc_tp.checkpoint.importers.bfloat16 import bfloat16_to_float32, float32_to_bfloat16_bytes

    bits = np.array(
        [
            0x3F808000,
            0x3F818000,
            0x3F808001,
            0x7F7FFFFF,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x7FFFFFFF,
            0xFFFFFFFF,
            0x7F800001,
        ],
        dtype="<u4",
    )
    halves = np.frombuffer(float32_to_bfloat16_bytes(bits.view("<f4")), "<u2")
    # ties to even (down, up), above the tie, overflow to inf, +-inf, then four NaNs (the last three
    # would wrap or carry into the exponent if rounded as numbers)
    assert halves[:6].tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7F80, 0xFF80]
    back = bfloat16_to_float32(halves.tobytes(), halves.shape)
    assert np.isnan(back[6:]).all() and np.signbit(back[6:]).tolist() == [False, False, True, False]


def test_conversion_reads_one_tensor_at_a_time(tmp_path, monkeypatch):
    """When a source tensor is read, at most the previous one is still alive: the model is never in memory."""
    import gc
    import weakref

    from hpc_tp.checkpoint.importers.huggingface import SafetensorsFolder

    config, tensors = llama_source()
    write_hf(tmp_path / "hf", config, tensors)
    alive, most = [], []
    original = SafetensorsFolder.read

    def tracked(self, name):
        gc.collect()
        most.append(sum(ref() is not None for ref in alive))
        values = original(self, name)
        alive.append(weakref.ref(values))
        return values

    monkeypatch.setattr(SafetensorsFolder, "read", tracked)
    assert main(["convert", str(tmp_path / "hf"), "-o", str(tmp_path / "ckpt")]) == 0
    assert len(most) == len(tensors) and max(most) <= 1


# -- bad inputs: one line naming the file and the tensor, nothing overwritten ------------------------------
def convert_error(source, output) -> str:
    with pytest.raises(ConfigError) as e:
        convert.run(cli_args(source=str(source), output=str(output), force=False))
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "key, value, expected",
    [("hidden_size", "16", "an integer"), ("num_hidden_layers", 2.5, "an integer"), ("rope_theta", "1e4", "a number")],
)
def test_a_config_value_of_the_wrong_type_is_named(tmp_path, key, value, expected):
    config, tensors = llama_source()
    write_hf(tmp_path / "hf", {**config, key: value}, tensors)
    message = convert_error(tmp_path / "hf", tmp_path / "ckpt")
    assert f"{key}={value!r}: expected {expected}" in message and "config.json" in message
    assert not (tmp_path / "ckpt").exists()


def test_unknown_architecture(tmp_path):
    config, tensors = gpt2_source()
    write_hf(tmp_path / "hf", {**config, "model_type": "mamba"}, tensors)
    message = convert_error(tmp_path / "hf", tmp_path / "ckpt")
    assert "mamba" in message and "config.json" in message and "gpt2" in message and "llama" in message
    gguf_config, gguf_tensors = llama_source(hidden=32, ffn=64)
    write_gguf(tmp_path / "f.gguf", gguf_config, gguf_tensors, quantized=(), arch="falcon")
    message = convert_error(tmp_path / "f.gguf", tmp_path / "ckpt")
    assert "falcon" in message and "f.gguf" in message and "llama" in message
    assert not (tmp_path / "ckpt").exists()


def test_missing_tensor_and_wrong_shape(tmp_path):
    config, tensors = llama_source()
    gone = "model.layers.1.mlp.up_proj.weight"
    write_hf(tmp_path / "missing", config, {n: v for n, v in tensors.items() if n != gone})
    message = convert_error(tmp_path / "missing", tmp_path / "ckpt")
    assert gone in message and "missing" in message and str(tmp_path / "missing") in message
    bad = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((HIDDEN, HIDDEN))})
    write_hf(tmp_path / "shape", config, bad, shards=2)
    message = convert_error(tmp_path / "shape", tmp_path / "ckpt")
    assert "model.layers.0.self_attn.k_proj.weight" in message and "(16, 16)" in message and "(8, 16)" in message
    assert ".safetensors" in message
    assert not (tmp_path / "ckpt").exists()


def test_truncated_safetensors_file(tmp_path):
    config, tensors = gpt2_source()
    source = write_hf(tmp_path / "hf", config, tensors)
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = convert_error(source, tmp_path / "ckpt")
    assert "model.safetensors" in message and "truncated" in message


def test_existing_output_is_never_overwritten_and_force_replaces_it(tmp_path):
    config, tensors = gpt2_source()
    source = write_hf(tmp_path / "hf", config, tensors)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "precious.txt").write_text("keep me")
    message = convert_error(source, tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in message and "--force" in message
    assert (tmp_path / "ckpt" / "precious.txt").read_text() == "keep me"
    # --force with a source that fails: the old output is still there, untouched.
    broken = write_hf(tmp_path / "broken", {**config, "n_layer": 3}, tensors)
    with pytest.raises(ConfigError):
        convert.run(cli_args(source=str(broken), output=str(tmp_path / "ckpt"), force=True))
    assert (tmp_path / "ckpt" / "precious.txt").read_text() == "keep me"
    convert.run(cli_args(source=str(source), output=str(tmp_path / "ckpt"), force=True))
    assert not (tmp_path / "ckpt" / "precious.txt").exists()
    assert (tmp_path / "ckpt" / "step-000000" / "master.h5").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "ckpt", "hf"]  # no temp folders left


def test_export_writes_the_folded_model(tmp_path):
    """A LoRA checkpoint exported to a Hugging Face folder and converted back gives the adapted
    model's logits from a model without adapters."""
    one = self_comm()
    cfg = ModelConfig(**dict(CONFIGS["llama-gqa"], lora_rank=3, lora_alpha=5.0))
    adapted = GPTModel(cfg, one, seed=3)
    for name, p in adapted.named_parameters():  # B is zero at initialisation: the update would be too
        if name.endswith("lora_b"):
            p.load_full(np.random.default_rng(len(name)).normal(0.0, 0.3, p.partition.full_shape))
    grid = ProcessGrid(tp=1, world=one)
    save_checkpoint(tmp_path / "lora", 0, adapted.state(), {"config": cfg.to_dict()}, grid)
    assert main(["export", str(tmp_path / "lora"), "-o", str(tmp_path / "hf"), "--arch", "llama"]) == 0
    assert main(["convert", str(tmp_path / "hf"), "-o", str(tmp_path / "back")]) == 0
    plain = GPTModel(dataclasses.replace(cfg, lora_rank=0, lora_alpha=None), one)
    load_checkpoint(tmp_path / "back", plain.state(), grid)
    ids, _ = lm_batch()
    assert max_rel_err(plain.logits(ids), adapted.logits(ids)) <= 1e-10
