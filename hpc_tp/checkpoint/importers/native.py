"""An hpc_tp checkpoint as a source for ``hpc-tp convert`` (to quantize it): its model tensors, read
whole (each index checked against its crc32) when the writer asks for them, and its extra files (the
tokenizer). Optimizer states and anything else the model does not name are left out."""

from __future__ import annotations

from pathlib import Path

import h5py

from ...errors import ConfigError
from ...models.config import ModelConfig
from ..format import MASTER, resolve_checkpoint
from ..read import describe_checkpoint, read_verified
from . import Imported, SourceTensor


def import_checkpoint(path: Path, model_tensors) -> Imported:
    """The checkpoint at ``path`` (a step folder, or a root holding them); ``model_tensors(cfg)`` names
    the tensors of a model of ``cfg``."""
    folder = resolve_checkpoint(path)
    described = describe_checkpoint(folder)
    config = described["meta"].get("config")
    if not isinstance(config, dict):
        raise ConfigError(f"checkpoint {folder} has no model config (meta['config']); was it written by hpc-tp?")
    cfg = ModelConfig.from_dict(config)
    if cfg.quantize is not None:
        raise ConfigError(f"checkpoint {folder} is quantized already ({cfg.quantize}): convert its source instead")
    stored = {t["name"]: t for t in described["tensors"]}
    names = list(model_tensors(cfg))
    missing = sorted(set(names) - set(stored))
    if missing:
        raise ConfigError(f"checkpoint {folder}: tensor {missing[0]!r} of its model is missing")

    def read(name: str):
        with h5py.File(folder / MASTER, "r") as f:
            ds = f[f"tensors/{name}"]
            return read_verified(f, name, 0, ds.shape[int(ds.attrs["checksum_axis"])])

    tensors = {
        name: SourceTensor(tuple(stored[name]["shape"]), stored[name]["dtype"], lambda name=name: read(name))
        for name in names
    }
    files = {name: (folder / name).read_bytes() for name in described["files"]}
    source = {"format": "hpc_tp", "architecture": cfg.family, "path": folder.name}
    return Imported(cfg, tensors, files, source, sorted(set(stored) - set(names)))
