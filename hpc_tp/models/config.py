"""ModelConfig: one description of a decoder (GPT-2, Llama family) or encoder (BERT-style) transformer."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..kernels.quantized import bits_of
from ..tensor_parallel.lora import LoRA

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu_tanh", "gelu", "silu", "swiglu", "geglu")  # geglu: gated GELU, tanh approximation (Gemma)
GATED = ("swiglu", "geglu")  # MLPs whose first projection is gate and up: act(gate) * up
POSITIONS = ("learned", "rope")
FAMILIES = ("gpt", "bert")  # decoder LM (models/gpt.py) or post-LN encoder (models/bert.py)
LAYER_TYPES = ("sliding_attention", "full_attention")  # Hugging Face's names for local and global layers
SWITCHES = (
    "tie_embeddings",
    "bias",
    "causal",
    "sequence_parallel",
    "qk_norm",
    "normalize_top_k",
    "post_norms",
    "scale_embeddings",
)


@dataclass
class ModelConfig:
    vocab_size: int = 258
    hidden: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouped-query attention)
    head_dim: int | None = None  # None: hidden // n_heads (Qwen3, Gemma 3: set apart from hidden)
    ffn_hidden: int | None = None  # None: 4 * hidden
    max_seq_len: int = 128
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    activation: str = "gelu_tanh"
    position: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Hugging Face style, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    sliding_window: int = 0  # > 0: local layers attend to their last this-many positions (self included)
    layer_types: list | None = None  # per layer "sliding_attention" or "full_attention"; None: all sliding
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head, before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # a norm on attention's and the MLP's outputs too, before each residual (Gemma)
    scale_embeddings: bool = False  # token embeddings times sqrt(hidden) (Gemma)
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers, unscaled (None: rope_theta)
    query_pre_attn_scalar: float | None = None  # queries scaled by its -1/2 power (None: head_dim's)
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap) (0: none)
    tie_embeddings: bool = True
    bias: bool = True
    causal: bool = True
    dropout: float = 0.0
    attn_dropout: float = 0.0
    init_std: float = 0.02
    family: str = "gpt"
    type_vocab_size: int = 0  # token-type (segment) embeddings of a BERT encoder; 0: none
    sequence_parallel: bool = False  # norms, dropout and residuals on 1/tp of the sequence (training)
    num_experts: int = 0  # > 0: Mixture-of-Experts MLPs (nn/moe.py) of ffn_hidden each
    top_k: int = 2  # experts per token
    moe_every: int = 1  # layer i is MoE when (i + 1) % moe_every == 0 and i is not in dense_layers
    dense_layers: list[int] = dataclasses.field(default_factory=list)  # layers kept dense (Qwen's mlp_only_layers)
    expert_ffn_hidden: int | None = None  # each expert's MLP width; None: ffn_hidden (ffn_hidden sizes dense layers)
    shared_expert_ffn_hidden: int = 0  # > 0: a shared expert every token passes, scaled by sigmoid(x w) (Qwen2-MoE)
    normalize_top_k: bool = True  # the top-k probabilities renormalised to sum 1 (Mixtral, Qwen3-MoE); else kept
    capacity_factor: float = 1.25  # expert capacity = ceil(factor * tokens * top_k / num_experts)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss
    # "int8" / "int4": the linear layers' weights are kept quantized (kernels/quantized.py), for inference
    quantize: str | None = None
    # > 0: LoRA adapters of this rank on every block's QKV, attention output, fc1 and fc2, and every other
    # weight frozen (tensor_parallel/lora.py); lora_alpha / lora_rank scales them (None: alpha = 2 x rank)
    lora_rank: int = 0
    lora_alpha: float | None = None

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden
        if self.expert_ffn_hidden is None:
            self.expert_ffn_hidden = self.ffn_hidden
        sizes = (self.hidden, self.n_heads)
        if self.head_dim is None and all(isinstance(n, int) and n > 0 for n in sizes):  # else validate names them
            if self.hidden % self.n_heads:
                raise ConfigError(
                    f"model config hidden={self.hidden} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim to size the heads apart from hidden"
                )
            self.head_dim = self.hidden // self.n_heads
        self.validate()

    def validate(self):
        for name in (
            "vocab_size",
            "hidden",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_hidden",
            "expert_ffn_hidden",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model config {name}={value!r}: expected a positive integer")
        for name, allowed in (
            ("norm", NORMS),
            ("activation", ACTIVATIONS),
            ("position", POSITIONS),
            ("family", FAMILIES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model config {name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise ConfigError(f"model config type_vocab_size={self.type_vocab_size!r}: expected an integer >= 0")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model config n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"rope needs an even head size, got {self.head_dim}")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model config {name}={getattr(self, name)!r}: expected true or false")
        self._check_number("norm_eps", lambda v: v > 0, "a number > 0")
        self._check_number("rope_theta", lambda v: v > 0, "a number > 0")
        self._check_number("logit_softcap", lambda v: v >= 0, "a number >= 0 (0: no soft-capping)")
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            if getattr(self, name) is not None:
                self._check_number(name, lambda v: v > 0, "a number > 0 or null")
        self._check_number("init_std", lambda v: v > 0, "a number > 0")
        for name in ("dropout", "attn_dropout"):
            self._check_number(name, lambda v: 0 <= v < 1, "a probability 0 <= p < 1")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"model config rope_scaling={self.rope_scaling!r}: expected an object or null")
        self._validate_moe()
        self._validate_window()
        if self.quantize is not None:
            bits_of(self.quantize, "model config quantize")
            if self.num_experts or self.family != "gpt":
                raise ConfigError(
                    f"model config quantize={self.quantize!r}: quantized weights are for dense decoders "
                    f"(family gpt, num_experts 0), not family={self.family!r} with num_experts={self.num_experts}"
                )
        self._validate_lora()

    def _validate_lora(self):
        rank = self.lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ConfigError(f"model config lora_rank={rank!r}: expected an integer >= 0 (0: no LoRA)")
        if self.lora_alpha is not None:
            self._check_number("lora_alpha", lambda v: v > 0, "a number > 0 or null (null: 2 x lora_rank)")
        if not rank:
            return
        refused = {
            "num_experts": self.num_experts,
            "sequence_parallel": self.sequence_parallel,
            "quantize": self.quantize,
            "family": self.family if self.family != "gpt" else None,
        }
        for name, value in refused.items():
            if value:
                raise ConfigError(
                    f"model config lora_rank={rank} with {name}={value!r}: LoRA adapts dense decoders "
                    "(family gpt, num_experts 0) in float weights without sequence parallelism"
                )

    def lora(self) -> LoRA | None:
        """The blocks' adapters (None: no LoRA)."""
        if not self.lora_rank:
            return None
        alpha = 2 * self.lora_rank if self.lora_alpha is None else self.lora_alpha
        return LoRA(self.lora_rank, alpha / self.lora_rank)

    def lora_parameters(self) -> int:
        """Elements of every block's adapters (A [in, r] and B [r, out] per adapted weight)."""
        h, f = self.hidden, self.ffn_hidden * (2 if self.gated_mlp else 1)
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.n_layers * self.lora_rank * ((h + q + 2 * kv) + (q + h) + (h + f) + (self.ffn_hidden + h))

    def _check_number(self, name: str, allowed, expected: str):
        value = getattr(self, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not allowed(value)
        ):
            raise ConfigError(f"model config {name}={value!r}: expected {expected}")

    def _validate_moe(self):
        if not isinstance(self.num_experts, int) or isinstance(self.num_experts, bool) or self.num_experts < 0:
            raise ConfigError(
                f"model config num_experts={self.num_experts!r}: expected an integer >= 0 (0: dense MLPs)"
            )
        if not self.num_experts:
            return
        for name in ("top_k", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model config {name}={value!r}: expected a positive integer")
        if self.top_k > self.num_experts:
            raise ConfigError(f"model config top_k={self.top_k} exceeds num_experts={self.num_experts}")
        shared = self.shared_expert_ffn_hidden
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ConfigError(
                f"model config shared_expert_ffn_hidden={shared!r}: expected an integer >= 0 (0: no shared expert)"
            )
        layers = self.dense_layers
        if not isinstance(layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layers for i in layers
        ):
            raise ConfigError(
                f"model config dense_layers={layers!r}: expected a list of layer indices 0 .. {self.n_layers - 1}"
            )
        self._check_number("capacity_factor", lambda v: v > 0, "a number > 0")
        self._check_number("aux_loss_coef", lambda v: v >= 0, "a number >= 0")

    def _validate_window(self):
        window = self.sliding_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise ConfigError(f"model config sliding_window={window!r}: expected an integer >= 0 (0: none)")
        if window and not self.causal:
            raise ConfigError(f"model config sliding_window={window}: needs causal attention (causal=true)")
        if self.layer_types is None:
            return
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.n_layers:
            raise ConfigError(
                f"model config layer_types={self.layer_types!r}: expected a list of {self.n_layers} layer types"
            )
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise ConfigError(f"model config layer_types entry {kind!r}: expected one of {', '.join(LAYER_TYPES)}")

    def window_of(self, layer: int) -> int:
        """The sliding window of layer ``layer`` (0: it attends to every earlier position)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    def rope_of(self, layer: int) -> tuple[float, dict | None]:
        """RoPE base and scaling of layer ``layer``: a sliding-window layer's own base (unscaled)
        where ``rope_local_theta`` is set, else the model's."""
        if self.rope_local_theta is not None and self.window_of(layer):
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def gated_mlp(self) -> bool:
        return self.activation in GATED

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0 and layer not in self.dense_layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown model config keys: {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
            )
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"model config: {e}") from None

    def mlp_parameters(self, width: int) -> int:
        """Elements of one MLP of ``width`` (dense, an expert or the shared expert); 0 for width 0."""
        if not width:
            return 0
        b = 1 if self.bias else 0
        return (2 if self.gated_mlp else 1) * (self.hidden * width + b * width) + width * self.hidden + b * self.hidden

    def parameter_count(self) -> int:
        h, f, v, L = self.hidden, self.ffn_hidden, self.vocab_size, self.n_layers
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        b = 1 if self.bias else 0
        mlp = self.mlp_parameters(f)
        attn = h * (q + 2 * kv) + b * (q + 2 * kv) + q * h + b * h + (2 * self.head_dim if self.qk_norm else 0)
        norms = (4 if self.post_norms else 2) * h * (2 if self.norm == "layernorm" and self.bias else 1)
        moe_layers = sum(self.is_moe_layer(i) for i in range(L))
        expert, shared = (
            self.mlp_parameters(width) for width in (self.expert_ffn_hidden, self.shared_expert_ffn_hidden)
        )
        shared += h if self.shared_expert_ffn_hidden else 0  # its gate
        moe_extra = moe_layers * (self.num_experts * expert + shared - mlp + h * self.num_experts)  # router too
        embed = v * h * (1 if self.tie_embeddings else 2) + (self.max_seq_len * h if self.position == "learned" else 0)
        final_norm = h * (2 if self.norm == "layernorm" and self.bias else 1)
        return L * (attn + mlp + norms) + moe_extra + embed + final_norm + self.lora_parameters()


PRESETS = {
    # Tiny shapes for tests and the embedded demo (byte-level vocab of 258).
    "tiny": dict(hidden=32, n_layers=2, n_heads=4, max_seq_len=64),
    "demo": dict(hidden=128, n_layers=2, n_heads=4, max_seq_len=32),
    "llama-tiny": dict(
        hidden=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        norm="rmsnorm",
        norm_eps=1e-6,
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
        max_seq_len=128,
    ),
    # The W1 benchmark workload (issue 8): 4 GPT blocks of hidden 768.
    "w1": dict(vocab_size=50304, hidden=768, n_layers=4, n_heads=12, ffn_hidden=3072, max_seq_len=256),
    "gpt2": dict(vocab_size=50257, hidden=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "gpt2-medium": dict(vocab_size=50257, hidden=1024, n_layers=24, n_heads=16, max_seq_len=1024),
    # A 1B-class GPT (0.9B parameters): what one GPU trains at seq 2048 (gpu-check's MFU row).
    "gpt-1b": dict(vocab_size=50304, hidden=2048, n_layers=16, n_heads=16, max_seq_len=2048),
    "gpt3-175b": dict(vocab_size=50257, hidden=12288, n_layers=96, n_heads=96, max_seq_len=2048),
    "llama2-7b": dict(
        vocab_size=32000,
        hidden=4096,
        n_layers=32,
        n_heads=32,
        ffn_hidden=11008,
        norm="rmsnorm",
        norm_eps=1e-5,
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
        max_seq_len=4096,
    ),
    "llama3-70b": dict(
        vocab_size=128256,
        hidden=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        norm="rmsnorm",
        norm_eps=1e-5,
        activation="swiglu",
        position="rope",
        rope_theta=500000.0,
        bias=False,
        tie_embeddings=False,
        max_seq_len=8192,
    ),
}


def load_config(spec: str, **overrides) -> ModelConfig:
    """A preset name or a JSON file; ``overrides`` (e.g. vocab_size from the tokenizer) win."""
    if spec in PRESETS:
        values = dict(PRESETS[spec])
    else:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file")
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"model config {spec}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"model config {spec}: expected a JSON object")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig.from_dict(values)


def parse_overrides(items) -> dict:
    """``--set KEY=VALUE`` items as a dict of config fields; VALUE is read as JSON (True and False
    as Python spells them too), a bare word stays a string (``--set norm=rmsnorm``)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set dropout=0.1")
        try:
            overrides[key] = json.loads(value.lower() if value in ("True", "False") else value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides
