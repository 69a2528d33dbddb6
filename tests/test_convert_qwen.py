"""Qwen3, Qwen2-MoE and Qwen3-MoE checkpoints: Hugging Face folders and GGUF files written here with random
weights give, once converted, the logits of a plain-numpy forward pass written from the published
architecture, at tp = 1, 2, 4 (and ep where there are experts); export writes the same tensors back."""

import argparse
import json
import re

import numpy as np
import pytest
from safetensors import safe_open
from test_convert import (
    CONTEXT,
    IDS,
    VOCAB,
    attention,
    convert_on_rank0,
    rel_err,
    rms_norm,
    rope,
    softmax,
    tp_logits,
    write_gguf,
    write_hf,
)

from hpc_tp.checkpoint import export
from hpc_tp.checkpoint.importers.source import open_source
from hpc_tp.cli import main
from hpc_tp.errors import ConfigError

mpi = pytest.mark.mpi(min_size=1)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 4, 2, 6, 3  # heads of 6: not hidden / heads


# -- sources -----------------------------------------------------------------------------------------------
def qwen_source(model_type: str, seed=0) -> tuple[dict, dict]:
    """A random Qwen3, Qwen2-MoE or Qwen3-MoE model in Hugging Face's names. The MoE ones have a dense
    layer (``mlp_only_layers``) among their sparse ones; Qwen2-MoE adds a shared expert to every token."""
    rng = np.random.default_rng(seed)
    h, d = HIDDEN, HEAD_DIM
    qwen3 = model_type in ("qwen3", "qwen3_moe")
    config = {
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": h,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": d if qwen3 else h // HEADS,
        "intermediate_size": 24,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500.0,
        "tie_word_embeddings": model_type == "qwen3",
        "hidden_act": "silu",
    }
    if model_type != "qwen3":
        config.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            norm_topk_prob=model_type == "qwen3_moe",
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = 12
    d = config["head_dim"]
    normal = lambda shape, scale=0.3: rng.normal(0, scale, shape)  # noqa: E731
    t = {"model.embed_tokens.weight": normal((VOCAB, h), 0.5), "model.norm.weight": 1 + normal(h, 0.1)}
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = normal((VOCAB, h))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + normal(h, 0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + normal(h, 0.1)
        for name, rows in (("q", HEADS * d), ("k", KV_HEADS * d), ("v", KV_HEADS * d)):
            t[f"{p}self_attn.{name}_proj.weight"] = normal((rows, h))
            if not qwen3:  # Qwen2's q/k/v biases
                t[f"{p}self_attn.{name}_proj.bias"] = normal(rows)
        t[p + "self_attn.o_proj.weight"] = normal((h, HEADS * d))
        if qwen3:
            t[p + "self_attn.q_norm.weight"] = 1 + normal(d, 0.2)
            t[p + "self_attn.k_norm.weight"] = 1 + normal(d, 0.2)
        mlps = {"mlp.": config["intermediate_size"]}
        if is_sparse(config, i):
            t[p + "mlp.gate.weight"] = normal((config["num_experts"], h), 1.0)
            mlps = {f"mlp.experts.{e}.": config["moe_intermediate_size"] for e in range(config["num_experts"])}
            if "shared_expert_intermediate_size" in config:
                mlps["mlp.shared_expert."] = config["shared_expert_intermediate_size"]
                t[p + "mlp.shared_expert_gate.weight"] = normal((1, h), 1.0)
        for m, f in mlps.items():
            t[p + m + "gate_proj.weight"] = normal((f, h))
            t[p + m + "up_proj.weight"] = normal((f, h))
            t[p + m + "down_proj.weight"] = normal((h, f))
    return config, t


def is_sparse(config: dict, layer: int) -> bool:
    """Transformers' rule for which of a Qwen-MoE model's layers are sparse."""
    return (
        config.get("num_experts", 0) > 0
        and layer not in config.get("mlp_only_layers", [])
        and (layer + 1) % config.get("decoder_sparse_step", 1) == 0
    )


# -- the reference forward pass ------------------------------------------------------------------------------
def swiglu(t, prefix, x):
    gate = x @ t[prefix + "gate_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * (x @ t[prefix + "up_proj.weight"].T)) @ t[prefix + "down_proj.weight"].T


def sparse_moe(config, t, prefix, x):
    """Softmax over the router's logits, the top k (renormalised only with ``norm_topk_prob``), their
    experts summed with those weights; plus the shared expert scaled by sigmoid(shared_expert_gate x)."""
    probs = softmax(x @ t[prefix + "gate.weight"].T)
    top = np.argsort(-probs, axis=-1, kind="stable")[..., : config["num_experts_per_tok"]]
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        weights = probs[idx][top[idx]]
        if config["norm_topk_prob"]:
            weights = weights / weights.sum()
        for e, w in zip(top[idx], weights):
            out[idx] += w * swiglu(t, f"{prefix}experts.{e}.", x[idx])
    if prefix + "shared_expert_gate.weight" in t:
        scale = 1 / (1 + np.exp(-(x @ t[prefix + "shared_expert_gate.weight"].T)))
        out += scale * swiglu(t, prefix + "shared_expert.", x)
    return out


def qwen_reference(config, t, ids):
    heads, kv, eps, theta = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["rms_norm_eps"],
        config["rope_theta"],
    )
    d = config["head_dim"]
    linear = lambda z, name: z @ t[name + ".weight"].T + t.get(name + ".bias", 0.0)  # noqa: E731

    def head_norm(z, n, name):  # Qwen3: RMSNorm over each head's d features, before RoPE
        if name not in t:
            return z
        return rms_norm(z.reshape(*z.shape[:-1], n, d), t[name], eps).reshape(z.shape)

    x = t["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q = rope(head_norm(linear(a, p + "self_attn.q_proj"), heads, p + "self_attn.q_norm.weight"), heads, theta)
        k = rope(head_norm(linear(a, p + "self_attn.k_proj"), kv, p + "self_attn.k_norm.weight"), kv, theta)
        x = x + linear(attention(q, k, linear(a, p + "self_attn.v_proj"), heads, kv), p + "self_attn.o_proj")
        m = rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        x = x + (sparse_moe(config, t, p + "mlp.", m) if is_sparse(config, i) else swiglu(t, p + "mlp.", m))
    head = t["model.embed_tokens.weight"] if config["tie_word_embeddings"] else t["lm_head.weight"]
    return rms_norm(x, t["model.norm.weight"], eps) @ head.T


# -- logits at every tp ----------------------------------------------------------------------------------------
def exported_tensors_equal(ckpt, out, tensors, architecture) -> bool:
    """``hpc-tp export`` of ``ckpt`` writes ``architecture``'s config and exactly ``tensors``."""
    assert main(["export", str(ckpt), "-o", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == architecture
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert sorted(f.keys()) == sorted(tensors)
        return all(np.array_equal(f.get_tensor(n), v) for n, v in tensors.items())


@mpi
def test_qwen3_head_dim_and_qk_norm_logits_match_reference_at_every_tp(shared_dir, comm_world):
    """Heads of head_dim (not hidden / heads), q/k RMSNorm per head before RoPE, GQA replicated at
    tp = 4, tied embeddings: from a Hugging Face folder and from GGUF, and exported back exactly."""
    config, tensors = qwen_source("qwen3")
    reference = qwen_reference(config, tensors, IDS)
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors), shared_dir / "ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "ckpt", comm_world), reference) < 1e-10
    if comm_world.rank == 0:
        assert exported_tensors_equal(shared_dir / "ckpt", shared_dir / "out", tensors, "qwen3")
    path = shared_dir / "qwen3.gguf"
    held = comm_world.bcast_object(
        write_gguf(path, config, tensors, quantized=(), arch="qwen3") if comm_world.rank == 0 else None
    )
    convert_on_rank0(lambda: path, shared_dir / "gguf-ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "gguf-ckpt", comm_world), qwen_reference(config, held, IDS)) < 1e-10


@mpi
@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_logits_match_reference_at_every_tp_and_ep(shared_dir, comm_world, model_type):
    """Router, experts of moe_intermediate_size, a dense layer among the sparse ones (mlp_only_layers),
    Qwen2-MoE's sigmoid-gated shared expert and unnormalised top k, Qwen3-MoE's q/k norms and renormalised
    top k: from a Hugging Face folder and from GGUF (stacked experts), at every tp x ep, exported back."""
    config, tensors = qwen_source(model_type)
    reference = qwen_reference(config, tensors, IDS)
    convert_on_rank0(lambda: write_hf(shared_dir / "hf", config, tensors), shared_dir / "ckpt", comm_world)
    for tp in (t for t in (1, 2, 4) if comm_world.size % t == 0):
        assert rel_err(tp_logits(shared_dir / "ckpt", comm_world, tp=tp), reference) < 1e-10, tp
    if comm_world.rank == 0:
        assert exported_tensors_equal(shared_dir / "ckpt", shared_dir / "out", tensors, model_type)
    path = shared_dir / "moe.gguf"
    arch = model_type.replace("_", "")
    held = comm_world.bcast_object(
        write_gguf(path, config, tensors, quantized=(), arch=arch) if comm_world.rank == 0 else None
    )
    convert_on_rank0(lambda: path, shared_dir / "gguf-ckpt", comm_world)
    assert rel_err(tp_logits(shared_dir / "gguf-ckpt", comm_world), qwen_reference(config, held, IDS)) < 1e-10


def test_export_refuses_a_layout_the_target_has_no_place_for(tmp_path):
    """A Qwen2-MoE checkpoint (shared expert, a dense layer, unnormalised top k) is not a Mixtral nor a
    Qwen3-MoE; a dense Qwen3 is not a Llama (no q/k norms there): one line each, nothing written."""
    for model_type, target, expected in (
        ("qwen2_moe", "mixtral", "dense layers among its MoE ones"),
        ("qwen2_moe", "qwen3_moe", "shared_expert_ffn_hidden=12"),
        ("qwen3", "llama", "qk_norm=True; models with query/key norms export as qwen3 or qwen3_moe"),
    ):
        write_hf(tmp_path / model_type, *qwen_source(model_type))
        if not (tmp_path / f"{model_type}-ckpt").exists():
            assert main(["convert", str(tmp_path / model_type), "-o", str(tmp_path / f"{model_type}-ckpt")]) == 0
        with pytest.raises(ConfigError, match=re.escape(expected)):
            export.run(
                argparse.Namespace(
                    checkpoint=str(tmp_path / f"{model_type}-ckpt"),
                    output=str(tmp_path / "out"),
                    arch=target,
                    dtype="stored",
                    force=False,
                )
            )
        assert not (tmp_path / "out").exists()


def test_a_bad_mlp_only_layers_is_one_line(tmp_path):
    config, tensors = qwen_source("qwen3_moe")
    write_hf(tmp_path / "hf", {**config, "mlp_only_layers": "1"}, tensors)
    with pytest.raises(ConfigError, match=r"config\.json: mlp_only_layers='1': expected a list of layer indices"):
        open_source(tmp_path / "hf")
