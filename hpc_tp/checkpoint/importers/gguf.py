"""GGUF files (llama.cpp) of the llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3 and gemma3 architectures.

The reader memory-maps the file; a tensor is read (and dequantized with ``gguf.quants`` when it
is quantized: BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K, the IQ types) only when the checkpoint writer asks
for it; a type the package cannot dequantize is an error naming the tensor. GGUF stores a weight
as ggml dims [in, out], which numpy sees as [out, in], the nn.Linear layout; and llama.cpp's
converter interleaves each head's q/k rows for its rope (llama only: qwen2, qwen3 and phi3 rotate halves
as Hugging Face does), which is undone here. ``hpc-tp convert --quantize`` keeps Q8_0 (int8), Q4_0 and
Q4_1 (int4) weights as they are stored (``read_quantized``: the same numbers, transposed). The rules are
the Hugging Face rules of the family (Phi-3's
fused qkv and gate-up projections included) with GGUF's tensor names. The tokenizer, when the file has one, becomes
a Hugging Face tokenizer.json (``gguf_tokenizer``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy

from ...errors import ConfigError
from ...models.config import ModelConfig
from . import Imported, Rule, lazy_tensors
from .huggingface import ARCHITECTURES, ConfigFile, tokenizer_files

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma3")
# The Hugging Face model_type of each architecture whose name differs (the rules are written in its names).
_HF_TYPE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
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
}
# Gemma 3's four norms a block, under llama.cpp's names (its norm weights hold Gemma's 1 + w already).
_GEMMA3_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# Architectures whose attention normalises each query and key head (RMSNorm over head_dim).
QK_NORMED = ("qwen3", "qwen3moe")
# MoE in llama.cpp: the router, and each projection of all experts stacked in one [experts, out, in]
# tensor (Mixtral's w1, w3, w2; Qwen-MoE's gate, up, down), the shared expert's own (Qwen2-MoE).
_EXPERT_NAME = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)")
_STACKED = {
    name: f"ffn_{part}_exps"
    for part, names in (("gate", ("w1", "gate_proj")), ("up", ("w3", "up_proj")), ("down", ("w2", "down_proj")))
    for name in names
}
_ROUTERS = {"block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp"}
_SHARED = {
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


class GGUFTensors:
    def __init__(self, path: Path, reader):
        self.label, self._path = str(path), path
        self._tensors = {t.name: t for t in reader.tensors}

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple:
        return tuple(int(n) for n in reversed(self._tensors[name].shape))  # ggml dims run fastest-first

    def dtype(self, name: str):
        from gguf import GGMLQuantizationType as Q

        kind = self._tensors[name].tensor_type
        return numpy.dtype({Q.F64: "float64", Q.F32: "float32", Q.F16: "float16"}.get(kind, "float32"))

    def where(self, name: str) -> str:
        return self.label

    def read_quantized(self, name: str, bits: int):
        """A Q8_0 (``bits`` 8), Q4_0 or Q4_1 (``bits`` 4) tensor's own numbers (``_kept_blocks``),
        without a float copy; None for any other type."""
        from gguf import GGMLQuantizationType as Q

        t = self._tensors[name]
        kind = Q(t.tensor_type).name
        if kind not in _KEPT or _KEPT[kind][0] != bits:
            return None
        return _kept_blocks(kind, t.data, self.shape(name))

    def read(self, name: str) -> numpy.ndarray:
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        t = self._tensors[name]
        if t.tensor_type in (Q.F64, Q.F32, Q.F16):
            return numpy.array(t.data).reshape(self.shape(name))
        try:  # gguf's own routines: BF16, the legacy quants, the K-quants and the IQ types
            return dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        except NotImplementedError:
            raise ConfigError(
                f"{self.label}: tensor {name} is {Q(t.tensor_type).name}, a type the gguf package "
                "cannot dequantize (F32, F16, BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K and IQ types "
                "can be read)"
            ) from None


# GGUF's blocks kept as ``kernels.quantized`` numbers (``read_quantized``): type -> (bits, bytes a block,
# whether a float16 minimum follows the scale). Each block is 32 weights along a row ``in``.
_KEPT = {"Q8_0": (8, 34, False), "Q4_0": (4, 18, False), "Q4_1": (4, 20, True)}


def _kept_blocks(kind: str, data, shape: tuple):
    """(codes, scales, minimums) of a Q8_0 / Q4_0 / Q4_1 tensor ``shape`` [..., in]: codes [..., in] as
    integers (-127..127, or 0..15 with Q4_0's offset of 8 in its minimum, -8 scale: exact), scales and
    minimums [..., in / 32] as float32 (float16 widened: exact); minimums None for Q8_0."""
    _, size, has_min = _KEPT[kind]
    blocks = numpy.asarray(data).reshape(-1, size)
    groups = shape[:-1] + (shape[-1] // 32,)
    scale = numpy.ascontiguousarray(blocks[:, :2]).view(numpy.float16).astype(numpy.float32).reshape(groups)
    if kind == "Q8_0":
        return blocks[:, 2:].view(numpy.int8).reshape(shape), scale, None
    packed = blocks[:, 4 if has_min else 2 :]
    codes = numpy.concatenate([packed & 15, packed >> 4], axis=1).reshape(shape)  # element j, then j + 16
    low = numpy.ascontiguousarray(blocks[:, 2:4]).view(numpy.float16).astype(numpy.float32) if has_min else None
    return codes, scale, -8 * scale if low is None else low.reshape(groups)


class _Fields:
    """GGUF metadata with errors naming the file and the key."""

    def __init__(self, reader, path: Path):
        self._fields, self.path = reader.fields, path

    def get(self, key, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        # GGUF keeps float32 values: 1e-6 comes back as 9.99999997e-07; take the shortest float32 spelling.
        return float(str(numpy.float32(value))) if isinstance(value, float) else value

    def __getitem__(self, key):
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.path}: missing metadata key {key!r}")
        return value


def _config(meta: _Fields, tensors: GGUFTensors, architecture: str) -> ModelConfig:
    a = architecture + "."
    heads = meta[a + "attention.head_count"]
    hidden = meta[a + "embedding_length"]
    head_dim = meta.get(a + "attention.key_length", hidden // heads)
    if meta.get(a + "attention.value_length", head_dim) != head_dim:
        raise ConfigError(
            f"{meta.path}: attention.value_length={meta.get(a + 'attention.value_length')} != "
            f"attention.key_length={head_dim} (keys and values of one head size are supported)"
        )
    rope_dims = meta.get(a + "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ConfigError(
            f"{meta.path}: rope.dimension_count={rope_dims} != head size {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    factors = sorted(n for n in tensors.names() if n.startswith(("rope_freqs", "rope_factors")))
    if factors:
        raise ConfigError(f"{meta.path}: tensor {factors[0]!r} (per-frequency rope factors) is not supported")
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ConfigError(f"{meta.path}: rope.scaling.type={scaling!r} is not supported (expected none or linear)")
    vocab = meta.get(a + "vocab_size")
    if vocab is None:  # older files: the embedding says it (lazy_tensors reports a missing embedding)
        vocab = tensors.shape("token_embd.weight")[0] if "token_embd.weight" in tensors.names() else 1
    moe = _mixture(meta, tensors, architecture)
    cfg = ModelConfig(
        **moe,
        vocab_size=int(vocab),
        hidden=hidden,
        n_layers=meta[a + "block_count"],
        n_heads=heads,
        n_kv_heads=meta.get(a + "attention.head_count_kv", heads),
        head_dim=head_dim,
        qk_norm=architecture in QK_NORMED,
        # A file whose every layer is MoE may give only its experts' width.
        ffn_hidden=meta.get(a + "feed_forward_length")
        or moe.get("expert_ffn_hidden")
        or meta[a + "feed_forward_length"],
        max_seq_len=meta[a + "context_length"],
        norm="rmsnorm",
        norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        activation="swiglu",
        position="rope",
        rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
        rope_scaling={"rope_type": "linear", "factor": float(meta[a + "rope.scaling.factor"])}
        if scaling == "linear"
        else None,
        tie_embeddings="output.weight" not in tensors.names(),
        bias=architecture in ("qwen2", "qwen2moe"),
        causal=True,
        sliding_window=meta.get(a + "attention.sliding_window", 0),
    )
    return _gemma3(cfg, meta, a) if architecture == "gemma3" else cfg


def _gemma3(cfg: ModelConfig, meta: _Fields, a: str) -> ModelConfig:
    """Gemma 3's block on top of the common fields, as llama.cpp runs it: the sliding-window layers
    from ``attention.sliding_window_pattern`` (a flag per layer, or every n-th layer global; 6 when
    absent), their rope base ``rope.freq_base_swa`` (10000 when absent), and queries scaled by
    head_dim^-1/2, hidden/heads^-1/2 for the 62-layer 27B model (the file has no query_pre_attn_scalar)."""
    pattern = meta.get(a + "attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        kinds = ["sliding_attention" if local else "full_attention" for local in pattern]
    else:
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg.n_layers)]
    scalar = cfg.hidden // cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim
    return dataclasses.replace(
        cfg,
        activation="geglu",
        qk_norm=True,
        post_norms=True,
        scale_embeddings=True,
        layer_types=kinds,
        rope_local_theta=float(meta.get(a + "rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=float(scalar),
        logit_softcap=float(meta.get(a + "final_logit_softcapping", 0.0) or 0.0),
    )


def _mixture(meta: _Fields, tensors: GGUFTensors, architecture: str) -> dict:
    """The MoE fields of the config ({} for a dense model). Which layers are sparse, the file's tensors
    say (a router ``ffn_gate_inp`` or not); llama.cpp renormalises the top k for all but qwen2moe
    unless the file says otherwise (``expert_weights_norm``)."""
    a = architecture + "."
    experts, top_k = meta.get(a + "expert_count", 0), meta.get(a + "expert_used_count", 2)
    if not experts:
        return {}
    layers = meta[a + "block_count"]
    names = tensors.names()
    return dict(
        num_experts=experts,
        top_k=top_k,
        moe_every=1,
        dense_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
        expert_ffn_hidden=meta.get(a + "expert_feed_forward_length") or meta[a + "feed_forward_length"],
        shared_expert_ffn_hidden=meta.get(a + "expert_shared_feed_forward_length", 0),
        normalize_top_k=bool(meta.get(a + "expert_weights_norm", architecture != "qwen2moe")),
        capacity_factor=experts / top_k,
    )


def _gguf_rule(rule: Rule, cfg: ModelConfig, architecture: str) -> Rule:
    if rule.theirs is None:  # a bias the family omits (Qwen2's output and MLP): zeros, no tensor to name
        return rule
    if rule.theirs in _TOP:
        return dataclasses.replace(rule, theirs=_TOP[rule.theirs])
    layer, module, kind = _LAYER_NAME.fullmatch(rule.theirs).groups()
    if module in _ROUTERS:
        return dataclasses.replace(rule, theirs=f"blk.{layer}.{_ROUTERS[module]}.{kind}")
    if module in _SHARED:
        return dataclasses.replace(rule, theirs=f"blk.{layer}.{_SHARED[module]}.{kind}")
    if module == "mlp.shared_expert_gate":  # a vector [hidden] here, Hugging Face's [1, hidden]
        return dataclasses.replace(
            rule, theirs=f"blk.{layer}.ffn_gate_inp_shexp.{kind}", shape=(cfg.hidden,), expert=None
        )
    if expert := _EXPERT_NAME.fullmatch(module):
        e, part = expert.groups()
        return dataclasses.replace(
            rule, theirs=f"blk.{layer}.{_STACKED[part]}.{kind}", expert=int(e), shape=(cfg.num_experts, *rule.shape)
        )
    heads = {"self_attn.q_proj": cfg.n_heads, "self_attn.k_proj": cfg.n_kv_heads}.get(module)
    names = {**_LAYER, **_GEMMA3_LAYER} if architecture == "gemma3" else _LAYER
    return dataclasses.replace(
        rule, theirs=f"blk.{layer}.{names[module]}.{kind}", rope_heads=heads if architecture == "llama" else None
    )


def import_gguf(path: Path) -> Imported:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on a damaged file
        raise ConfigError(
            f"{path}: not a readable GGUF file, truncated or corrupted ({type(e).__name__}: {e})"
        ) from None
    meta = _Fields(reader, path)
    architecture = meta.get("general.architecture")
    if architecture not in SUPPORTED:
        raise ConfigError(
            f"{path}: unknown architecture {architecture!r}; supported GGUF architectures: "
            f"{', '.join(SUPPORTED)} (and Hugging Face folders of gpt2, llama, qwen2, qwen3, phi3, mistral, mixtral, gemma3_text, bert)"
        )
    tensors = GGUFTensors(path, reader)
    cfg = _config(meta, tensors, architecture)
    # The Hugging Face family whose rules name the tensors (llama.cpp files Mixtral under llama).
    model_type = "mixtral" if architecture == "llama" and cfg.num_experts else _HF_TYPE.get(architecture, architecture)
    rules = ARCHITECTURES[model_type][1](cfg, ConfigFile({"model_type": model_type}, path), "model.")
    if architecture == "gemma3":  # llama.cpp stores Gemma's norms as 1 + w already: no shift on import
        rules = [dataclasses.replace(r, shift=0.0) for r in rules]
    rules = [_gguf_rule(r, cfg, architecture) for r in rules]
    lazy, ignored = lazy_tensors(rules, tensors, f"{path.name}'s metadata")
    from .gguf_tokenizer import tokenizer_json

    tokenizer = tokenizer_json(meta)
    files = tokenizer_files(tokenizer, _chat_settings(meta), _eos_ids(meta)) if tokenizer is not None else {}
    return Imported(cfg, lazy, files, {"format": "gguf", "architecture": architecture, "path": path.name}, ignored)


def _eos_ids(meta) -> list[int]:
    """The ids the file says end a generation: end of sequence, of turn and of message (Llama 3's
    ``<|eot_id|>`` and ``<|eom_id|>``)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [int(meta.get(key)) for key in keys if meta.get(key) is not None]


def _chat_settings(meta) -> dict:
    """The file's chat template (``tokenizer.chat_template``) and the special tokens it names, {} if none."""
    template = meta.get("tokenizer.chat_template")
    if not isinstance(template, str):
        return {}
    tokens, chat = meta.get("tokenizer.ggml.tokens"), {"chat_template": template}
    for key in ("bos_token", "eos_token"):
        index = meta.get(f"tokenizer.ggml.{key}_id")
        if index is not None and 0 <= int(index) < len(tokens):
            chat[key] = tokens[int(index)]
    return chat
