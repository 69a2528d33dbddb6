"""Hugging Face model folders: config.json + model.safetensors (or shards listed in
model.safetensors.index.json), for GPT-2, the Llama family (Llama, SmolLM, Qwen2) and BERT.

Layouts: GPT-2's Conv1D weights are already [in, out] like ours, and c_attn fuses q, k, v as
column blocks; torch nn.Linear weights ([out, in]: Llama, Qwen2, BERT) are transposed. A bias
the source family omits while another of its linears has one (Qwen2: q/k/v biases, none on the
output or MLP projections) becomes a zero bias here, which computes the same; export checks it
is still zero. The same rule tables serve import and export (``export_layout``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy

from ...errors import ConfigError
from ...models.config import ModelConfig
from . import Imported, Rule, lazy_tensors
from .bfloat16 import bfloat16_to_float32

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
# Read back by hpc_tp.tokenizer.load_tokenizer_dir: which kind of tokenizer the folder holds.
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"

# numpy dtypes of the safetensors dtypes; BF16 (no numpy type) is widened to float32.
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "float32",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


class SafetensorsFolder:
    """The tensors of one model folder across its safetensors files, read one at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder, self.label = folder, str(folder)
        self._safe_open = safe_open
        if (folder / INDEX).is_file():
            weight_map = _json(folder / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{folder / INDEX}: no 'weight_map' object (tensor name -> shard file)")
            files = sorted(set(weight_map.values()))
        elif (folder / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise ConfigError(f"{folder}: no {SINGLE} or {INDEX} (only safetensors weights are supported)")
        self._file_of, self._info = {}, {}
        for name in files:
            path = folder / name
            if not path.is_file():
                raise ConfigError(f"{path}: shard listed in {INDEX} is missing")
            try:
                with safe_open(str(path), framework="numpy") as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        self._file_of[key] = path
                        self._info[key] = (tuple(piece.get_shape()), piece.get_dtype())
            except Exception as e:  # the Rust library raises SafetensorError with its parser message
                raise ConfigError(f"{path}: not a valid safetensors file, truncated or corrupted ({e})") from None

    def names(self) -> set[str]:
        return set(self._info)

    def shape(self, name: str) -> tuple:
        return self._info[name][0]

    def dtype(self, name: str):
        kind = self._info[name][1]
        if kind not in _DTYPES:
            raise ConfigError(f"{self.where(name)}: tensor {name!r} has dtype {kind}, which numpy cannot hold")
        return numpy.dtype(_DTYPES[kind])

    def where(self, name: str) -> str:
        return str(self._file_of[name])

    def read(self, name: str) -> numpy.ndarray:
        path = self._file_of[name]
        if self._info[name][1] == "BF16":
            return bfloat16_to_float32(_raw_bytes(path, name), self.shape(name))
        with self._safe_open(str(path), framework="numpy") as f:
            return f.get_tensor(name)


def _raw_bytes(path: Path, name: str) -> numpy.ndarray:
    """A tensor's bytes by the header's offsets (numpy has no bfloat16 for safetensors to return)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        start, stop = json.loads(f.read(header_len))[name]["data_offsets"]
    return numpy.memmap(path, dtype=numpy.uint8, mode="r", offset=8 + header_len + start, shape=(stop - start,))


def _json(path: Path) -> dict:
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return values


# Sizes and constants the importers compute with: a value of another JSON type is the file's error.
_INTEGER_KEYS = {
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
    "type_vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "sliding_window",
}
_NUMBER_KEYS = {"rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "rope_theta"}


class ConfigFile:
    """config.json with errors that name the file and the key."""

    def __init__(self, values: dict, path):
        self.values, self.path = values, path

    def __getitem__(self, key):
        if self.values.get(key) is None:
            raise ConfigError(f"{self.path}: missing key {key!r}")
        return self._checked(key, self.values[key])

    def get(self, key, default=None):
        value = self.values.get(key)
        return default if value is None else self._checked(key, value)

    def _checked(self, key, value):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in _INTEGER_KEYS and not (number and math.isfinite(value) and value == int(value)):
            raise ConfigError(f"{self.path}: {key}={value!r}: expected an integer")
        if key in _NUMBER_KEYS and not number:
            raise ConfigError(f"{self.path}: {key}={value!r}: expected a number")
        return int(value) if key in _INTEGER_KEYS else value


# -- configs ------------------------------------------------------------------------------------------
def _activation(hf: ConfigFile, key: str, default: str) -> str:
    name = hf.get(key, default)
    if name not in _ACTIVATIONS:
        raise ConfigError(f"{hf.path}: {key}={name!r} is not supported; expected one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def gpt2_config(hf: ConfigFile) -> ModelConfig:
    hidden = hf["n_embd"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden=hidden,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        ffn_hidden=hf.get("n_inner", 4 * hidden),
        max_seq_len=hf["n_positions"],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=_activation(hf, "activation_function", "gelu_new"),
        position="learned",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bias=True,
        causal=True,
    )


def _llama_biases(hf: ConfigFile) -> tuple[bool, bool, bool]:
    """Which linears the source has biases on: (q/k/v, output projection, MLP)."""
    attention, model_type = bool(hf.get("attention_bias", False)), hf.get("model_type")
    qkv = attention or model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
    return qkv, attention, bool(hf.get("mlp_bias", False))


def _rope(hf: ConfigFile) -> dict:
    """rope_theta and rope_scaling, from the keys of those names or from newer transformers'
    ``rope_parameters`` (the base and the scaling in one object)."""
    parameters = hf.get("rope_parameters", {})
    if not isinstance(parameters, dict):
        raise ConfigError(f"{hf.path}: rope_parameters={parameters!r}: expected an object")
    theta = hf.get("rope_theta", parameters.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{hf.path}: rope_theta={theta!r}: expected a number")
    scaling = hf.get("rope_scaling")
    if scaling is None and parameters.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    return {"rope_theta": float(theta), "rope_scaling": scaling}


# Families whose attention normalises each query and key head (RMSNorm over head_dim) before RoPE.
QK_NORMED = ("qwen3", "qwen3_moe", "gemma3_text")


def llama_config(hf: ConfigFile) -> ModelConfig:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{hf.path}: hidden_act={hf['hidden_act']!r}; the Llama family needs 'silu' (SwiGLU)")
    if hf.get("use_sliding_window", False):
        raise ConfigError(f"{hf.path}: use_sliding_window=true is not supported (full attention only)")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden=hidden,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim"),
        qk_norm=hf.get("model_type") in QK_NORMED,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        position="rope",
        **_rope(hf),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=any(_llama_biases(hf)),
        causal=True,
    )


def windowed_config(hf: ConfigFile) -> ModelConfig:
    """Mistral and Phi-3: the Llama block, whose config may declare a sliding window (every layer's:
    a query sees itself and the window - 1 positions before it)."""
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("linear", "llama3"):
        raise ConfigError(f"{hf.path}: rope_scaling={scaling!r} (a long-context variant) is not supported")
    return dataclasses.replace(llama_config(hf), sliding_window=hf.get("sliding_window", 0))


def gemma3_config(hf: ConfigFile) -> ModelConfig:
    """Gemma 3 (text): the Llama block with GeGLU, a norm on each branch's output too, query/key norms,
    head_dim apart from hidden / heads, embeddings times sqrt(hidden), local layers with a sliding
    window and their own unscaled rope base between global ones, queries scaled by
    query_pre_attn_scalar^-1/2 and logits soft-capped where the config says so. Tied head."""
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(
            f"{hf.path}: hidden_activation={hf['hidden_activation']!r}; Gemma 3 needs 'gelu_pytorch_tanh'"
        )
    if hf.get("attn_logit_softcapping") is not None:
        raise ConfigError(f"{hf.path}: attn_logit_softcapping is not supported (Gemma 3 has none)")
    if hf.get("use_bidirectional_attention", False):
        raise ConfigError(f"{hf.path}: use_bidirectional_attention=true (an embedding model) is not supported")
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = hf.get("sliding_window_pattern", 6)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    theta, scaling, local_theta = _gemma3_rope(hf)
    return dataclasses.replace(
        llama_config(hf),
        head_dim=hf.get("head_dim", 256),
        qk_norm=True,
        activation="geglu",
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=list(kinds),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        post_norms=True,
        scale_embeddings=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def mixtral_config(hf: ConfigFile) -> ModelConfig:
    """Mixtral: Mistral's attention, and a Mixture-of-Experts MLP in every layer whose router takes the
    softmax over all experts, keeps the top k and renormalises them (the engine's MoE layer). The
    capacity factor is set so that no token is ever dropped (capacity = tokens), as in the source."""
    experts, top_k = hf["num_local_experts"], hf["num_experts_per_tok"]
    return dataclasses.replace(
        windowed_config(hf),
        num_experts=experts,
        top_k=top_k,
        moe_every=1,
        capacity_factor=experts / top_k,
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
    )


def qwen_moe_config(hf: ConfigFile) -> ModelConfig:
    """Qwen2-MoE and Qwen3-MoE: a router over ``num_experts`` experts of ``moe_intermediate_size`` in the
    layers ``decoder_sparse_step`` picks, except ``mlp_only_layers`` (dense, of ``intermediate_size``); the
    top-k softmax probabilities renormalised only with ``norm_topk_prob``; Qwen2-MoE adds to every token a
    shared expert of ``shared_expert_intermediate_size`` scaled by sigmoid(shared_expert_gate x). Imported
    dropless (capacity factor experts / k), as the source computes."""
    # Released configs say num_experts; newer transformers writes Qwen3-MoE's as num_local_experts.
    experts, top_k = hf.get("num_experts") or hf["num_local_experts"], hf["num_experts_per_tok"]
    dense = hf.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"{hf.path}: mlp_only_layers={dense!r}: expected a list of layer indices")
    shared = hf.get("shared_expert_intermediate_size", 0) if hf.get("model_type") == "qwen2_moe" else 0
    return dataclasses.replace(
        llama_config(hf),
        num_experts=experts,
        top_k=top_k,
        moe_every=hf.get("decoder_sparse_step", 1),
        dense_layers=dense,
        expert_ffn_hidden=hf["moe_intermediate_size"],
        shared_expert_ffn_hidden=shared,
        normalize_top_k=bool(hf.get("norm_topk_prob", False)),
        capacity_factor=experts / top_k,
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def bert_config(hf: ConfigFile) -> ModelConfig:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(
            f"{hf.path}: position_embedding_type={hf['position_embedding_type']!r}; "
            "only 'absolute' (learned positions) is supported"
        )
    if hf.get("is_decoder", False):
        raise ConfigError(f"{hf.path}: is_decoder=true; only BERT encoders are supported")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        activation=_activation(hf, "hidden_act", "gelu"),
        position="learned",
        tie_embeddings=False,
        bias=True,
        causal=False,
        family="bert",
        type_vocab_size=hf.get("type_vocab_size", 2),
    )


# -- rules --------------------------------------------------------------------------------------------
def _linear(ours: str, theirs: str, n_in: int, n_out: int, torch_layout: bool, bias: str | None) -> list[Rule]:
    """A linear's weight (and bias: "source", "zeros" or None for none)."""
    shape = (n_out, n_in) if torch_layout else (n_in, n_out)
    rules = [Rule(f"{ours}.weight", f"{theirs}.weight", shape, transpose=torch_layout)]
    if bias:
        rules.append(Rule(f"{ours}.bias", f"{theirs}.bias" if bias == "source" else None, (n_out,)))
    return rules


def _norm(ours: str, theirs: str, cfg: ModelConfig) -> list[Rule]:
    rules = [Rule(f"{ours}.weight", f"{theirs}.weight", (cfg.hidden,))]
    if cfg.norm == "layernorm" and cfg.bias:
        rules.append(Rule(f"{ours}.bias", f"{theirs}.bias", (cfg.hidden,)))
    return rules


def _head(cfg: ModelConfig) -> list[Rule]:
    return [] if cfg.tie_embeddings else [Rule("head.weight", "lm_head.weight", (cfg.vocab_size, cfg.hidden))]


def gpt2_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str) -> list[Rule]:
    h, p = cfg.hidden, prefix
    rules = [
        Rule("embed.weight", f"{p}wte.weight", (cfg.vocab_size, h)),
        Rule("pos", f"{p}wpe.weight", (cfg.max_seq_len, h)),
    ]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"{p}h.{i}."
        rules += _norm(ours + "norm1", theirs + "ln_1", cfg)
        for j, name in enumerate("qkv"):
            columns = (j * h, (j + 1) * h)
            rules += [
                Rule(f"{ours}attn.qkv.{name}.weight", theirs + "attn.c_attn.weight", (h, 3 * h), columns=columns),
                Rule(f"{ours}attn.qkv.{name}.bias", theirs + "attn.c_attn.bias", (3 * h,), columns=columns),
            ]
        rules += _linear(ours + "attn.out", theirs + "attn.c_proj", h, h, False, "source")
        rules += _norm(ours + "norm2", theirs + "ln_2", cfg)
        rules += _linear(ours + "mlp.fc1", theirs + "mlp.c_fc", h, cfg.ffn_hidden, False, "source")
        rules += _linear(ours + "mlp.fc2", theirs + "mlp.c_proj", cfg.ffn_hidden, h, False, "source")
    return rules + _norm("final_norm", f"{p}ln_f", cfg) + _head(cfg)


def llama_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str) -> list[Rule]:
    h, f, p = cfg.hidden, cfg.ffn_hidden, prefix
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    qkv_bias, out_bias, mlp_bias = ("source" if has else "zeros" if cfg.bias else None for has in _llama_biases(hf))
    rules = [Rule("embed.weight", f"{p}embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        rules += _norm(ours + "norm1", theirs + "input_layernorm", cfg)
        rules += _linear(ours + "attn.qkv.q", theirs + "self_attn.q_proj", h, q, True, qkv_bias)
        rules += _linear(ours + "attn.qkv.k", theirs + "self_attn.k_proj", h, kv, True, qkv_bias)
        rules += _linear(ours + "attn.qkv.v", theirs + "self_attn.v_proj", h, kv, True, qkv_bias)
        rules += _linear(ours + "attn.out", theirs + "self_attn.o_proj", q, h, True, out_bias)
        if cfg.qk_norm:
            rules += [
                Rule(f"{ours}attn.{name}.weight", f"{theirs}self_attn.{name}.weight", (cfg.head_dim,))
                for name in ("q_norm", "k_norm")
            ]
        rules += _norm(ours + "norm2", theirs + "post_attention_layernorm", cfg)
        rules += _linear(ours + "mlp.fc1.gate", theirs + "mlp.gate_proj", h, f, True, mlp_bias)
        rules += _linear(ours + "mlp.fc1.up", theirs + "mlp.up_proj", h, f, True, mlp_bias)
        rules += _linear(ours + "mlp.fc2", theirs + "mlp.down_proj", f, h, True, mlp_bias)
    return rules + _norm("final_norm", f"{p}norm", cfg) + _head(cfg)


# Phi-3's fused torch-layout projections: a part of ours -> (the fused tensor, which block of its rows).
_PHI3_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def phi3_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str) -> list[Rule]:
    """Llama's tensors, where q, k and v are row blocks of one ``qkv_proj`` and gate and up of one
    ``gate_up_proj``, split on import and joined again on export."""
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    blocks = {"qkv_proj": [0, q, q + kv, q + 2 * kv], "gate_up_proj": [0, f, 2 * f]}
    rules = []
    for rule in llama_rules(cfg, hf, prefix):
        part = rule.theirs.rsplit(".", 2)[-2] if rule.theirs else None
        if part in _PHI3_FUSED and rule.theirs.endswith(".weight"):
            fused, k = _PHI3_FUSED[part]
            edges = blocks[fused]
            rule = Rule(
                rule.ours,
                rule.theirs.replace(part, fused),
                (edges[-1], cfg.hidden),
                transpose=True,
                rows=(edges[k], edges[k + 1]),
            )
        rules.append(rule)
    return rules


# Gemma3TextConfig's sizes by default: a multimodal folder's text_config lists only what differs from them.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
}


def gemma3_multimodal_config(hf: ConfigFile) -> ModelConfig:
    """A multimodal Gemma 3 folder (``gemma3``: the 4B model and up): its language model, described by
    ``text_config``; the vision tower and its projector are left out."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{hf.path}: text_config={text!r}; a gemma3 config describes its language model there")
    return gemma3_config(ConfigFile({**_GEMMA3_TEXT_DEFAULTS, **text}, hf.path))


def _gemma3_rope(hf: ConfigFile) -> tuple[float, dict | None, float]:
    """(global base, global scaling, local base): from ``rope_parameters`` per layer type, as
    transformers 5 writes them, or from rope_theta, rope_scaling and rope_local_base_freq before it."""
    params = hf.get("rope_parameters")
    if not isinstance(params, dict) or "full_attention" not in params:
        return (
            float(hf.get("rope_theta", 1_000_000.0)),
            hf.get("rope_scaling"),
            float(hf.get("rope_local_base_freq", 10_000.0)),
        )
    full, local = params["full_attention"], params.get("sliding_attention", {})
    if local.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{hf.path}: rope_parameters.sliding_attention={local!r}: local layers' rope must be unscaled"
        )
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    return (
        float(full.get("rope_theta", 1_000_000.0)),
        None if scaling.get("rope_type", "default") == "default" else scaling,
        float(local.get("rope_theta", 10_000.0)),
    )


# Gemma 3's four norms a block: ours -> theirs.
_GEMMA_NORMS = {
    "norm1": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "norm2": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def gemma3_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str) -> list[Rule]:
    """Llama's projections and query/key norms and the four norms a block under Gemma's names; every
    norm gain stored as 1 + Gemma's weight (its RMSNorm multiplies by 1 + weight, ours by the gain)."""
    rules = [r for r in llama_rules(cfg, hf, prefix) if not r.ours.endswith(("norm1.weight", "norm2.weight"))]
    for i in range(cfg.n_layers):
        rules += [
            Rule(f"layers.{i}.{ours}.weight", f"{prefix}layers.{i}.{theirs}.weight", (cfg.hidden,))
            for ours, theirs in _GEMMA_NORMS.items()
        ]
    return [dataclasses.replace(r, shift=1.0) if "norm" in r.ours else r for r in rules]


def _swiglu(ours: str, theirs: str, names: tuple[str, str, str], f: int, cfg: ModelConfig) -> list[Rule]:
    """A SwiGLU MLP of width ``f`` whose gate, up and down projections the source calls ``names``; zero
    biases where the model has biases elsewhere (Qwen2-MoE's q/k/v)."""
    bias = "zeros" if cfg.bias else None
    gate, up, down = names
    return (
        _linear(ours + "fc1.gate", theirs + gate, cfg.hidden, f, True, bias)
        + _linear(ours + "fc1.up", theirs + up, cfg.hidden, f, True, bias)
        + _linear(ours + "fc2", theirs + down, f, cfg.hidden, True, bias)
    )


def _moe_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str, block: str, expert_names: tuple) -> list[Rule]:
    """Llama's tensors, with the MLP of every MoE layer a ``block``: the router ``gate`` [experts, hidden]
    and experts whose projections are ``expert_names``; a shared expert and its gate where the config has one."""
    h, f, p = cfg.hidden, cfg.expert_ffn_hidden, prefix
    rules = [r for r in llama_rules(cfg, hf, prefix) if not (".mlp." in r.ours and cfg.is_moe_layer(_layer_of(r)))]
    for i in filter(cfg.is_moe_layer, range(cfg.n_layers)):
        ours, theirs = f"layers.{i}.mlp.", f"{p}layers.{i}.{block}."
        rules.append(Rule(ours + "router", theirs + "gate.weight", (cfg.num_experts, h), transpose=True))
        for e in range(cfg.num_experts):
            rules += _swiglu(f"{ours}experts.{e}.", f"{theirs}experts.{e}.", expert_names, f, cfg)
        if cfg.shared_expert_ffn_hidden:
            names = ("gate_proj", "up_proj", "down_proj")
            rules += _swiglu(
                ours + "shared_expert.", theirs + "shared_expert.", names, cfg.shared_expert_ffn_hidden, cfg
            )
            # Its gate is a Linear(hidden, 1): our vector is that one row.
            rules.append(Rule(ours + "shared_expert_gate", theirs + "shared_expert_gate.weight", (1, h), expert=0))
    return rules


def _layer_of(rule: Rule) -> int:
    return int(rule.ours.split(".")[1])


def mixtral_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str) -> list[Rule]:
    """Each MLP a ``block_sparse_moe`` whose experts' w1, w3, w2 are gate, up and down."""
    return _moe_rules(cfg, hf, prefix, "block_sparse_moe", ("w1", "w3", "w2"))


def qwen_moe_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str) -> list[Rule]:
    """The MLP of each sparse layer (``mlp``) holds the router, the experts and Qwen2-MoE's shared expert."""
    return _moe_rules(cfg, hf, prefix, "mlp", ("gate_proj", "up_proj", "down_proj"))


def bert_rules(cfg: ModelConfig, hf: ConfigFile, prefix: str) -> list[Rule]:
    h, f, p = cfg.hidden, cfg.ffn_hidden, prefix
    rules = [
        Rule("embed.weight", f"{p}embeddings.word_embeddings.weight", (cfg.vocab_size, h)),
        Rule("pos", f"{p}embeddings.position_embeddings.weight", (cfg.max_seq_len, h)),
    ]
    if cfg.type_vocab_size:
        rules.append(Rule("type_embed", f"{p}embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, h)))
    rules += _norm("embed_norm", f"{p}embeddings.LayerNorm", cfg)
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"{p}encoder.layer.{i}."
        for name, module in (("q", "query"), ("k", "key"), ("v", "value")):
            rules += _linear(f"{ours}attn.qkv.{name}", f"{theirs}attention.self.{module}", h, h, True, "source")
        rules += _linear(ours + "attn.out", theirs + "attention.output.dense", h, h, True, "source")
        rules += _norm(ours + "norm1", theirs + "attention.output.LayerNorm", cfg)
        rules += _linear(ours + "mlp.fc1", theirs + "intermediate.dense", h, f, True, "source")
        rules += _linear(ours + "mlp.fc2", theirs + "output.dense", f, h, True, "source")
        rules += _norm(ours + "norm2", theirs + "output.LayerNorm", cfg)
    return rules


# model_type -> (config, rules, a tensor every such model has, prefixes its names may carry)
ARCHITECTURES = {
    "gpt2": (gpt2_config, gpt2_rules, "wte.weight", ("", "transformer.")),
    "llama": (llama_config, llama_rules, "embed_tokens.weight", ("model.", "")),
    "qwen2": (llama_config, llama_rules, "embed_tokens.weight", ("model.", "")),
    "qwen3": (llama_config, llama_rules, "embed_tokens.weight", ("model.", "")),
    "mistral": (windowed_config, llama_rules, "embed_tokens.weight", ("model.", "")),
    "phi3": (windowed_config, phi3_rules, "embed_tokens.weight", ("model.", "")),
    "mixtral": (mixtral_config, mixtral_rules, "embed_tokens.weight", ("model.", "")),
    "gemma3_text": (gemma3_config, gemma3_rules, "embed_tokens.weight", ("model.", "")),
    # the language model of a multimodal folder, as transformers 4 and 5 name it
    "gemma3": (
        gemma3_multimodal_config,
        gemma3_rules,
        "embed_tokens.weight",
        ("language_model.model.", "model.language_model."),
    ),
    "qwen2_moe": (qwen_moe_config, qwen_moe_rules, "embed_tokens.weight", ("model.", "")),
    "qwen3_moe": (qwen_moe_config, qwen_moe_rules, "embed_tokens.weight", ("model.", "")),
    "bert": (bert_config, bert_rules, "embeddings.word_embeddings.weight", ("", "bert.")),
}


def import_folder(folder: Path) -> Imported:
    if not (folder / CONFIG).is_file():
        raise ConfigError(f"{folder}: no {CONFIG} (expected a Hugging Face model folder)")
    hf = ConfigFile(_json(folder / CONFIG), folder / CONFIG)
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        named = model_type or ", ".join(hf.get("architectures", [])) or "none given"
        raise ConfigError(
            f"{folder / CONFIG}: unknown architecture {named!r}; supported model_type values: "
            f"{', '.join(ARCHITECTURES)} (and GGUF files of the llama, qwen2, qwen3, phi3 and gemma3 architectures)"
        )
    make_config, make_rules, anchor, prefixes = ARCHITECTURES[model_type]
    cfg = make_config(hf)
    reader = SafetensorsFolder(folder)
    names = reader.names()
    prefix = next((p for p in prefixes if p + anchor in names), prefixes[0])
    tensors, ignored = lazy_tensors(make_rules(cfg, hf, prefix), reader, str(folder / CONFIG))
    files = {}
    if (folder / TOKENIZER).is_file():
        tokenizer_json = (folder / TOKENIZER).read_bytes()
        files = tokenizer_files(tokenizer_json, chat_settings(folder), eos_token_ids(folder, tokenizer_json))
    return Imported(
        cfg, tensors, files, {"format": "huggingface", "architecture": model_type, "path": folder.name}, ignored
    )


def tokenizer_files(tokenizer_json: bytes, chat: dict | None = None, eos_ids=()) -> dict[str, bytes]:
    """A Hugging Face tokenizer.json, with the note that says what kind of tokenizer it is, the ids
    that end a generation (``eos_token_ids``) and, for a chat model, its chat template and the special
    tokens that names (``serve.chat``)."""
    note = {"kind": "huggingface", "file": TOKENIZER, **(chat or {})}
    if eos_ids:
        note["eos_token_ids"] = list(dict.fromkeys(eos_ids))  # the first is the eos training appends
    return {TOKENIZER: tokenizer_json, TOKENIZER_CONFIG: (json.dumps(note, indent=1) + "\n").encode()}


def eos_token_ids(folder: Path, tokenizer_json: bytes) -> list[int]:
    """The ids that end a generation by the folder's own files: the id of ``tokenizer_config.json``'s
    ``eos_token`` first, then ``generation_config.json``'s ``eos_token_id`` (an id or a list: instruct
    models list their end-of-turn token there)."""
    from tokenizers import Tokenizer

    ids = []
    token = _json_object(folder / TOKENIZER_CONFIG).get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str):
        token_id = Tokenizer.from_str(tokenizer_json.decode()).token_to_id(token)
        if token_id is not None:
            ids.append(token_id)
    generation = _json_object(folder / GENERATION_CONFIG).get("eos_token_id")
    for i in generation if isinstance(generation, list) else [generation]:
        if isinstance(i, int) and not isinstance(i, bool):
            ids.append(i)
    return list(dict.fromkeys(ids))


def _json_object(path: Path) -> dict:
    """A JSON file's top-level object; {} where the file is missing or holds no object."""
    try:
        value = json.loads(path.read_text()) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return value if isinstance(value, dict) else {}


def chat_settings(folder: Path) -> dict:
    """A Hugging Face folder's chat template (``chat_template.jinja``, or ``tokenizer_config.json``'s
    ``chat_template``: a string, or named templates of which the "default") and its ``bos_token`` and
    ``eos_token`` (strings, or added-token objects with a ``content``); {} for a model without one."""
    config = _json_object(folder / TOKENIZER_CONFIG)
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if (folder / CHAT_TEMPLATE).is_file():  # newer folders keep it apart, and it wins there too
        template = (folder / CHAT_TEMPLATE).read_text()
    if not isinstance(template, str):
        return {}
    chat = {"chat_template": template}
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            chat[key] = token
    return chat


# -- export -------------------------------------------------------------------------------------------
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
EXPORTABLE = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3", *MIXTURES, "gemma3_text")
WINDOWED = ("mistral", "phi3", "mixtral")  # the exportable families whose config.json has a sliding_window
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def default_export(cfg: ModelConfig) -> str:
    """The architecture that holds ``cfg`` when the checkpoint does not say where it came from."""
    if cfg.position == "learned":
        return "gpt2"
    if cfg.num_experts:
        return "qwen3_moe" if cfg.qk_norm else "qwen2_moe" if cfg.shared_expert_ffn_hidden else "mixtral"
    if cfg.post_norms:
        return "gemma3_text"
    if cfg.sliding_window:
        return "mistral"
    return "qwen3" if cfg.qk_norm else "llama"


def _mixture_mismatch(cfg: ModelConfig, architecture: str) -> str | None:
    """What of ``cfg``'s Mixture-of-Experts layout ``architecture`` has no place for, or None."""
    if architecture == "mixtral":
        if cfg.moe_every != 1 or cfg.dense_layers:
            return "dense layers among its MoE ones (mixtral's every layer is MoE; qwen2_moe and qwen3_moe have them)"
        if cfg.expert_ffn_hidden != cfg.ffn_hidden or not cfg.normalize_top_k:
            return "experts narrower than ffn_hidden or unnormalised top-k weights (export as qwen3_moe)"
    if (architecture == "qwen2_moe") != bool(cfg.shared_expert_ffn_hidden):
        return f"shared_expert_ffn_hidden={cfg.shared_expert_ffn_hidden} (qwen2_moe always has a shared expert, the others none)"
    return None


def export_layout(cfg: ModelConfig, architecture: str) -> tuple[dict, list[Rule]]:
    """config.json and the rules for writing ``cfg``'s tensors as a Hugging Face ``architecture``."""
    if (architecture in MIXTURES) != bool(cfg.num_experts):
        raise ConfigError(
            f"export as {architecture}: the checkpoint has num_experts={cfg.num_experts}; Mixture-of-Experts "
            f"models export as {', '.join(MIXTURES)}, dense ones as gpt2, llama, qwen2, qwen3 or phi3"
        )
    if cfg.num_experts and (mismatch := _mixture_mismatch(cfg, architecture)):
        raise ConfigError(f"export as {architecture}: the checkpoint has {mismatch}")
    if (architecture in QK_NORMED) != cfg.qk_norm:
        raise ConfigError(
            f"export as {architecture}: the checkpoint has qk_norm={cfg.qk_norm}; models with query/key "
            f"norms export as {' or '.join(QK_NORMED)}, others as gpt2, llama, qwen2, qwen2_moe, phi3 or mixtral"
        )
    if architecture == "gpt2":
        if (cfg.position, cfg.norm, cfg.activation, cfg.bias) != ("learned", "layernorm", "gelu_tanh", True):
            raise ConfigError(
                "export as gpt2 needs learned positions, layernorm, gelu_tanh and biases; "
                f"the checkpoint has {cfg.position}, {cfg.norm}, {cfg.activation}, bias={cfg.bias}"
            )
        if cfg.n_kv_heads != cfg.n_heads:
            raise ConfigError(
                f"export as gpt2: n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads} "
                "(GPT-2 has no grouped-query attention)"
            )
        values = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_hidden,
            "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": cfg.tie_embeddings,
        }
        prefix = ""
    elif architecture == "gemma3_text":
        values, prefix = _gemma3_values(cfg), "model."
    elif architecture in _CLASSES:
        if (cfg.position, cfg.norm, cfg.activation) != ("rope", "rmsnorm", "swiglu"):
            raise ConfigError(
                f"export as {architecture} needs rope, rmsnorm and swiglu; "
                f"the checkpoint has {cfg.position}, {cfg.norm}, {cfg.activation}"
            )
        if cfg.sliding_window and (architecture not in WINDOWED or cfg.layer_types is not None):
            raise ConfigError(
                f"export as {architecture}: the checkpoint has a sliding window of {cfg.sliding_window} "
                f"{'on some layers' if cfg.layer_types else 'on every layer'}; "
                f"{' and '.join(WINDOWED)} have one on every layer"
            )
        if architecture in WINDOWED and cfg.bias:
            raise ConfigError(
                f"export as {architecture}: the checkpoint has biases, which {architecture} has not; "
                "export with --arch llama"
            )
        values = {
            "architectures": [_CLASSES[architecture]],
            "model_type": architecture,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_hidden,
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": "silu",
            "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling,
            "tie_word_embeddings": cfg.tie_embeddings,
        }
        if architecture == "llama":
            values.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
        if architecture in WINDOWED:
            values["sliding_window"] = cfg.sliding_window or None
        if architecture in ("qwen3", "qwen3_moe"):  # q/k/v and output biases or none; an MLP bias must be zero
            values.update(attention_bias=cfg.bias)
        if architecture == "qwen2_moe":  # q/k/v biases or none; the others must be zero
            values.update(qkv_bias=cfg.bias)
        if architecture in ("qwen2_moe", "qwen3_moe"):
            values.update(
                num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.top_k,
                moe_intermediate_size=cfg.expert_ffn_hidden,
                norm_topk_prob=cfg.normalize_top_k,
                decoder_sparse_step=cfg.moe_every,
                mlp_only_layers=cfg.dense_layers,
                router_aux_loss_coef=cfg.aux_loss_coef,
            )
        if architecture == "qwen2_moe":
            values.update(shared_expert_intermediate_size=cfg.shared_expert_ffn_hidden)
        if architecture == "mixtral":
            values.update(
                num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.aux_loss_coef
            )
        prefix = "model."
    else:
        raise ConfigError(f"cannot export architecture {architecture!r}; exportable: {', '.join(EXPORTABLE)}")
    rules = ARCHITECTURES[architecture][1](cfg, ConfigFile(values, CONFIG), prefix)
    return values, rules


def _gemma3_values(cfg: ModelConfig) -> dict:
    """Gemma 3's config.json for ``cfg``, which must have Gemma's block."""
    block = (cfg.position, cfg.norm, cfg.activation, cfg.post_norms, cfg.scale_embeddings, cfg.tie_embeddings)
    if block != ("rope", "rmsnorm", "geglu", True, True, True):
        raise ConfigError(
            "export as gemma3_text needs rope, rmsnorm, geglu, post_norms, scale_embeddings and tied embeddings; "
            f"the checkpoint has {cfg.position}, {cfg.norm}, {cfg.activation}, post_norms={cfg.post_norms}, "
            f"scale_embeddings={cfg.scale_embeddings}, tie_embeddings={cfg.tie_embeddings}"
        )
    kinds = cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.n_layers
    scalar = cfg.head_dim if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_local_base_freq": cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta,
        "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        "layer_types": kinds,
        "query_pre_attn_scalar": int(scalar) if scalar == int(scalar) else scalar,  # transformers 5 wants an int
        "final_logit_softcapping": cfg.logit_softcap or None,
        "attn_logit_softcapping": None,
        "attention_bias": cfg.bias,
        "tie_word_embeddings": True,
    }
