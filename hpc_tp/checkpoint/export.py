"""``hpc-tp export CKPT -o DIR``: a checkpoint back to a Hugging Face folder (config.json +
model.safetensors, and tokenizer.json when the checkpoint has one, with a tokenizer_config.json holding
its chat template where it has one) for GPT-2 and the Llama family.

The import rules run backwards: each Hugging Face tensor is assembled from our tensors
(transposed back, GPT-2's q/k/v concatenated into c_attn), read one at a time from the
checkpoint with every checksum verified, and streamed into the safetensors file, whose header
is written first from the shapes alone. A zero bias the import added (Qwen2's output and MLP
projections) is checked to be still zero, since the target format has nowhere to put it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy

from ..errors import ConfigError
from ..paths import check_output_folder

_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def add_arguments(parser):
    parser.add_argument("checkpoint", help="a checkpoint folder, or a folder of checkpoints (its latest is exported)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="Hugging Face folder to create")
    parser.add_argument(
        "--arch",
        choices=(
            "gpt2",
            "llama",
            "qwen2",
            "qwen3",
            "mistral",
            "phi3",
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
            "gemma3_text",
        ),
        default=None,
        help="target architecture (default: the one it was imported from, else gpt2 for learned "
        "positions and llama for rope)",
    )
    parser.add_argument(
        "--dtype",
        choices=("stored", *_CODES),
        default="stored",
        help="dtype of the written tensors (default: as stored in the checkpoint)",
    )
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists (atomically, when done)")


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from .convert import replace_folder
    from .read import describe_checkpoint

    check_output_folder(args.output, "--output")
    info = describe_checkpoint(args.checkpoint)
    folder = replace_folder(args.output, args.force, lambda temp: export(info, temp, args.arch, args.dtype))
    print(f"exported {info['path']} -> {folder}")
    return 0


def export(info: dict, dest: Path, architecture: str | None, dtype: str):
    """Write the Hugging Face folder of the checkpoint ``info`` (describe_checkpoint) into ``dest``."""
    # loaded when the command runs, not by hpc-tp --help
    import h5py

    from ..models.config import ModelConfig
    from ..tokenizer import load_tokenizer_dir
    from .format import MASTER, SourceCheck
    from .importers.huggingface import (
        CONFIG,
        EXPORTABLE,
        GENERATION_CONFIG,
        SINGLE,
        TOKENIZER,
        TOKENIZER_CONFIG,
        default_export,
        export_layout,
    )

    meta = info["meta"]
    if "config" not in meta:
        raise ConfigError(f"checkpoint {info['path']}: its meta holds no model config")
    cfg = ModelConfig.from_dict(meta["config"])
    if cfg.family != "gpt":
        raise ConfigError(f"checkpoint {info['path']} is a {cfg.family} model; export supports {', '.join(EXPORTABLE)}")
    if cfg.quantize is not None:
        raise ConfigError(f"checkpoint {info['path']} holds {cfg.quantize} weights; export writes float checkpoints")
    architecture = architecture or meta.get("source", {}).get("architecture")
    if architecture not in EXPORTABLE:
        architecture = default_export(cfg)
    hf_config, rules = export_layout(cfg, architecture)
    folder = Path(info["path"])
    stored = {t["name"]: t["dtype"] for t in info["tensors"]}
    for rule in rules:
        if rule.ours not in stored:
            raise ConfigError(f"checkpoint {folder}: tensor {rule.ours!r} is missing (needed for {rule.theirs})")
    dest.mkdir(parents=True)
    with h5py.File(folder / MASTER, "r") as f:
        read = _Reader(f, folder, SourceCheck(folder))
        if cfg.lora_rank:
            read = _Folded(read, stored, cfg.lora().scale)
        for rule in rules:
            if rule.theirs is None and read(rule.ours).any():
                raise ConfigError(
                    f"checkpoint {folder}: tensor {rule.ours!r} is not zero, but {architecture} has no "
                    "such parameter; export with --arch llama (it has attention_bias and mlp_bias)"
                )
        entries = _entries([r for r in rules if r.theirs is not None], read, stored, dtype)
        write_safetensors(dest / SINGLE, entries)
    hf_config["torch_dtype"] = {code: name for name, code in _CODES.items()}[entries[0][2]]
    (dest / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
    if (folder / TOKENIZER).is_file():
        (dest / TOKENIZER).write_bytes((folder / TOKENIZER).read_bytes())
        tokenizer = load_tokenizer_dir(folder)
        if tokenizer.chat:  # the chat template and its special tokens, where Hugging Face's tools look for them
            (dest / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer.chat, indent=2) + "\n")
        if tokenizer.eos_token_ids:  # where transformers' generate and vLLM read the ids that end a reply
            (dest / GENERATION_CONFIG).write_text(
                json.dumps({"eos_token_id": tokenizer.eos_token_ids}, indent=2) + "\n"
            )


class _Reader:
    """Whole tensors from the master file, every shard source and checksum verified."""

    def __init__(self, f, folder: Path, sources):
        self.f, self.folder, self.sources = f, folder, sources

    def __call__(self, name: str):
        # loaded when the command runs, not by hpc-tp --help
        from .read import read_verified

        ds = self.f[f"tensors/{name}"]
        problems = self.sources.problems(name, ds)
        if problems:
            raise ConfigError(f"checkpoint {self.folder}: {'; '.join(problems)}")
        try:
            return read_verified(self.f, name, 0, ds.shape[int(ds.attrs["checksum_axis"])])
        except ConfigError as e:
            raise ConfigError(f"checkpoint {self.folder}: {e}") from None


class _Folded:
    """``read`` with each LoRA adapter folded into its weight, W + s A B: the model a LoRA checkpoint
    holds, as a Hugging Face checkpoint without adapters. A segment's weight (``qkv.q.weight``) takes
    its own B (``qkv.q.lora_b``) and its layer's A (``qkv.lora_a``)."""

    def __init__(self, read, stored: dict, scale: float):
        self.read, self.stored, self.scale = read, stored, scale

    def __call__(self, name: str):
        value = self.read(name)
        base = name.removesuffix("weight")
        if base == name or base + "lora_b" not in self.stored:
            return value
        a = base + "lora_a" if base + "lora_a" in self.stored else base.rsplit(".", 2)[0] + ".lora_a"
        update = self.read(a).astype(numpy.float64) @ self.read(base + "lora_b").astype(numpy.float64)
        return (value.astype(numpy.float64) + self.scale * update).astype(value.dtype)


def _entries(rules, read, stored: dict, dtype: str) -> list[tuple]:
    """(name, shape, dtype code, produce) per Hugging Face tensor, in rule order; the rules that
    share a source tensor are its column blocks (GPT-2's c_attn) or row blocks (Phi-3's qkv_proj),
    concatenated in their order."""
    groups: dict[str, list] = {}
    for rule in rules:
        groups.setdefault(rule.theirs, []).append(rule)
    entries = []
    for name, parts in groups.items():
        parts.sort(key=lambda r: r.columns or r.rows or (0, 0))
        code = _CODES[stored[parts[0].ours] if dtype == "stored" else dtype]

        def produce(parts=parts):
            pieces = [r.to_theirs(read(r.ours)) for r in parts]
            return pieces[0] if len(pieces) == 1 else numpy.concatenate(pieces, axis=0 if parts[0].rows else -1)

        entries.append((name, parts[0].shape, code, produce))
    return entries


def write_safetensors(path: Path, entries: list[tuple]):
    """A safetensors file written tensor by tensor: the header (names, dtypes, shapes, offsets)
    comes from the shapes alone, then each tensor's little-endian bytes in header order."""
    # loaded when the command runs, not by hpc-tp --help
    from .importers.bfloat16 import float32_to_bfloat16_bytes

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, code, _ in entries:
        size = math.prod(shape) * _ITEMSIZE[code]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape, code, produce in entries:
            values = produce()
            if values.shape != tuple(shape):
                raise AssertionError(f"{name}: produced {values.shape}, header says {shape}")
            if code == "BF16":
                out.write(float32_to_bfloat16_bytes(values))
                continue
            with numpy.errstate(over="ignore"):  # checked just below, with the tensor's name
                narrowed = numpy.ascontiguousarray(values, dtype=f"<f{_ITEMSIZE[code]}")
            if numpy.isinf(narrowed).any() and numpy.isfinite(values).all():
                raise ConfigError(
                    f"tensor {name}: values up to {numpy.abs(values).max():.4g} overflow {code} "
                    f"(largest {numpy.finfo(narrowed.dtype).max:.4g}); export with --dtype float32 or bfloat16"
                )
            out.write(narrowed.tobytes())
        out.flush()
        os.fsync(out.fileno())
