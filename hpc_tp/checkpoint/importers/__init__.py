"""Importers: a model saved by another tool, seen as this project's config and parameter names.

An importer reads the source's config into a ``ModelConfig`` and lists ``Rule``s: which source
tensor (and which columns of it, transposed or not) becomes which of our logical tensors. The
tensors stay on disk: each is a ``SourceTensor`` whose values are read (and dequantized,
transposed, ...) only when the checkpoint writer asks for them, one at a time, so converting
never holds the model in memory, let alone twice. Every name and shape is checked against the
source's config before anything is written.

    source.open_source(path) -> Imported(config, tensors, files, source)

Supported: Hugging Face folders (config.json + safetensors, sharded too) of GPT-2, Llama-family
(Llama, SmolLM, Qwen2, Qwen3, Mistral, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE), Gemma 3 and BERT encoders;
GGUF files of the llama (Mixtral's experts included), qwen2, qwen3, qwen2moe, qwen3moe, phi3 and gemma3
architectures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy

from ...errors import ConfigError
from ...kernels.quantized import from_codes
from ...models.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """Our tensor ``ours`` comes from the source tensor ``theirs`` of shape ``shape``.

    ``columns``: ours is ``theirs[..., a:b]`` (a fused projection such as GPT-2's c_attn);
    ``rows``: ours is ``theirs[a:b]`` (a fused torch-layout projection such as Phi-3's qkv_proj);
    ``expert``: ours is ``theirs[e]`` (one expert of GGUF's stacked [experts, out, in] tensors);
    ``rope_heads``: undo llama.cpp's interleaved rope layout of q/k rows over that many heads;
    ``transpose``: torch's nn.Linear stores [out, in], our linears [in, out];
    ``shift``: ours is theirs + shift (Gemma's norms multiply by 1 + weight, ours by the gain).
    ``theirs`` None: the source family has no such tensor (a bias it omits); ours is zeros of ``shape``.
    """

    ours: str
    theirs: str | None
    shape: tuple
    transpose: bool = False
    columns: tuple[int, int] | None = None
    rope_heads: int | None = None
    rows: tuple[int, int] | None = None
    expert: int | None = None
    shift: float = 0.0

    @property
    def ours_shape(self) -> tuple:
        shape = list(self.shape[1:] if self.expert is not None else self.shape)
        if self.columns:
            shape[-1] = self.columns[1] - self.columns[0]
        if self.rows:
            shape[0] = self.rows[1] - self.rows[0]
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def to_ours(self, x):
        if self.expert is not None:
            x = x[self.expert]
        if self.columns:
            x = x[..., self.columns[0] : self.columns[1]]
        if self.rows:
            x = x[self.rows[0] : self.rows[1]]
        if self.rope_heads:
            x = undo_rope_permutation(x, self.rope_heads)
        if self.shift:
            x = x + self.shift
        return numpy.ascontiguousarray(x.T if self.transpose else x)

    def to_theirs(self, x):
        """Our tensor back in the source layout (its columns of a fused tensor, if ``columns``; with
        ``expert``, the one slice of a stacked tensor that holds only it, as Qwen2-MoE's [1, hidden] gate)."""
        if self.shift:
            x = x - self.shift
        x = x.T if self.transpose else x
        return numpy.ascontiguousarray(x[None] if self.expert is not None else x)


def undo_rope_permutation(w, heads: int):
    """llama.cpp stores each head's q/k rows as interleaved pairs (its rope rotates adjacent
    elements); Hugging Face and this project rotate halves. Inverse of its ``permute``:
    rows (h, 2, d/2) were reordered as (h, d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class SourceTensor:
    """A logical tensor still in the source file: shape and dtype are known, values are read
    when it is indexed (the checkpoint writer takes ``data[partition.valid_local()]``).
    ``quantized(bits)``: the tensor as the source's own quantized numbers (``kernels.quantized``),
    where they are of that format; None where they are not (then the values are quantized)."""

    def __init__(self, shape: tuple, dtype, read: Callable[[], numpy.ndarray], quantized=None):
        self.shape, self.dtype, self._read = tuple(shape), numpy.dtype(dtype), read
        self.quantized = quantized or (lambda bits: None)

    def __getitem__(self, index):
        values = self._read()
        if values.shape != self.shape:  # a rule bug, never a user error: shapes were checked up front
            raise AssertionError(f"read shape {values.shape}, expected {self.shape}")
        return values.astype(self.dtype, copy=False)[index]


def _quantized_ours(rule: Rule, reader, bits: int):
    """Our weight as the source's quantized numbers (a reader's ``read_quantized``: codes, scales and
    minimums in the source's [out, in] layout, groups along ``in``), or None where the reader has no
    such tensor of ``bits`` bits. Rows, experts, rope order and the transpose move whole groups."""
    read = getattr(reader, "read_quantized", None)
    found = None if read is None or rule.columns else read(rule.theirs, bits)
    if found is None:
        return None
    codes, scale, low = (None if x is None else rule.to_ours(x) for x in found)
    return from_codes(codes, scale, low, bits)


@dataclass
class Imported:
    config: ModelConfig
    tensors: dict[str, SourceTensor]
    files: dict[str, bytes] = field(default_factory=dict)  # tokenizer files for the checkpoint folder
    source: dict = field(default_factory=dict)  # what was imported: format, architecture, path
    ignored: list[str] = field(default_factory=list)  # source tensors no rule uses (pooler, rotary caches)


def lazy_tensors(rules: list[Rule], reader, config_name: str) -> tuple[dict[str, SourceTensor], list[str]]:
    """Our tensors from ``reader`` (names, shape, dtype, read, where), checked against the
    shapes ``config_name`` implies; returns them and the source tensors left unused."""
    available = reader.names()
    tensors, used = {}, set()
    for rule in rules:
        if rule.theirs is None:
            continue
        if rule.theirs not in available:
            raise ConfigError(
                f"{reader.label}: tensor {rule.theirs!r} is missing (needed for {rule.ours}, "
                f"as {config_name} describes the model)"
            )
        shape = reader.shape(rule.theirs)
        if shape != rule.shape:
            raise ConfigError(
                f"{reader.where(rule.theirs)}: tensor {rule.theirs!r} has shape {shape}, "
                f"expected {rule.shape} from {config_name}"
            )
        used.add(rule.theirs)
        tensors[rule.ours] = SourceTensor(
            rule.ours_shape,
            reader.dtype(rule.theirs),
            lambda rule=rule: rule.to_ours(reader.read(rule.theirs)),
            lambda bits, rule=rule: _quantized_ours(rule, reader, bits),
        )
    dtype = next(iter(tensors.values())).dtype if tensors else numpy.float32
    for rule in rules:
        if rule.theirs is None:
            tensors[rule.ours] = SourceTensor(rule.shape, dtype, lambda rule=rule: numpy.zeros(rule.shape, dtype))
    return tensors, sorted(available - used)
