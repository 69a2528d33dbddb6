"""A model saved by another tool, opened by what it is: a Hugging Face folder or a GGUF file; or an
hpc_tp checkpoint (to quantize it)."""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError
from ..format import MASTER, latest_checkpoint
from . import Imported
from .gguf import import_gguf
from .huggingface import import_folder
from .native import import_checkpoint


def open_source(path, model_tensors=None) -> Imported:
    """A Hugging Face model folder, a GGUF file or, where ``model_tensors(cfg)`` names a model's tensors
    (``convert.split_axes``), an hpc_tp checkpoint folder (or a root holding checkpoints), by what it is."""
    path = Path(path)
    if model_tensors is not None and path.is_dir() and ((path / MASTER).is_file() or latest_checkpoint(path)):
        return import_checkpoint(path, model_tensors)
    if path.is_dir():
        return import_folder(path)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return import_gguf(path)
        raise ConfigError(
            f"{path}: not a GGUF file (no GGUF magic); expected a GGUF file or a Hugging Face "
            "model folder (config.json + model.safetensors)"
        )
    raise ConfigError(f"{path} does not exist: expected a Hugging Face model folder or a GGUF file")
