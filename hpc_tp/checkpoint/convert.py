"""``hpc-tp convert SRC -o CKPT``: a Hugging Face model folder or a GGUF file as an hpc_tp checkpoint;
with ``--quantize int8|int4`` (any of those, or an hpc_tp checkpoint) one whose linear layers' weights
stay quantized for inference (``importers/quantize.py``).

The importer (``importers/``) maps every source tensor to this project's name and layout and
checks its shape; the checkpoint writer then pulls the tensors through one at a time (read,
dequantize, transpose, write, forget), so memory holds one tensor, never the model. Each tensor
gets the split axis the model's layers give it, so any tp loads its own slice later. One process
writes (a grid of one rank); the result is CKPT/step-000000 with the tokenizer files beside
master.h5 and the model config in the meta. An existing CKPT is never touched unless --force,
and then replaced only once the new checkpoint is complete.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path

from ..errors import ConfigError
from ..paths import check_output_folder


def add_arguments(parser):
    parser.add_argument(
        "source",
        help="a Hugging Face model folder (config.json + safetensors), a .gguf file, or an hpc_tp checkpoint "
        "(to quantize it)",
    )
    parser.add_argument("-o", "--output", required=True, metavar="CKPT", help="checkpoint folder to create")
    parser.add_argument("--force", action="store_true", help="replace CKPT if it exists (atomically, when done)")
    parser.add_argument(
        "--quantize",
        metavar="FORMAT",
        help="keep the linear layers' weights quantized: int8 or int4, in groups of 32 inputs (GGUF Q8_0, "
        "Q4_0 and Q4_1 weights are kept as stored); the embedding and LM head stay float",
    )


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..comm.mpi import world
    from ..kernels.quantized import bits_of
    from .importers.quantize import quantize_imported
    from .importers.source import open_source

    if world().size > 1:
        raise ConfigError(
            f"hpc-tp convert runs as one process (started with {world().size} ranks); "
            "the checkpoint it writes loads at any tp"
        )
    if args.quantize is not None:
        bits_of(args.quantize)
    check_output_folder(args.output, "--output")
    imported = open_source(args.source, split_axes)
    if args.quantize is not None:
        imported = quantize_imported(imported, args.quantize, split_axes)
    folder = replace_folder(args.output, args.force, lambda temp: write_checkpoint(imported, temp))
    cfg = imported.config
    print(
        f"converted {args.source} ({imported.source['format']}, {imported.source['architecture']}): "
        f"{cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), "
        f"vocab {cfg.vocab_size}, {len(imported.tensors)} tensors"
        + (f", linear weights {cfg.quantize}" if cfg.quantize else "")
        + f" -> {folder}"
        + ("" if imported.files else " (no tokenizer found)")
    )
    if imported.ignored:
        print(f"source tensors not used: {', '.join(imported.ignored)}")
    return 0


def write_checkpoint(imported, root: Path) -> Path:
    """Save ``imported`` as step 0 under ``root`` with one process; returns the step folder."""
    # loaded when the command runs, not by hpc-tp --help
    from ..comm.mpi import self_comm
    from ..grid import ProcessGrid
    from ..module import Partition
    from .write import save_checkpoint

    axes = split_axes(imported.config)
    if set(axes) != set(imported.tensors):  # an importer rule out of step with the model: a bug, not user input
        raise AssertionError(f"importer and model disagree on tensors: {sorted(set(axes) ^ set(imported.tensors))}")
    staged = {name: _Staged(tensor, Partition(tensor.shape, axes[name])) for name, tensor in imported.tensors.items()}
    meta = {"step": 0, "config": imported.config.to_dict(), "source": imported.source}
    return save_checkpoint(root, 0, staged, meta, ProcessGrid(1, 1, 1, world=self_comm()), keep=1, files=imported.files)


class _Staged:
    """What save_checkpoint takes: ``data`` (here a tensor still in the source file) and its partition."""

    def __init__(self, data, partition):
        self.data, self.partition = data, partition


def split_axes(cfg) -> dict:
    """Parameter name -> the axis the model splits it along over tp (None: replicated), from a
    model of ``cfg``'s structure at toy width: names and axes do not depend on the sizes (quantized
    weights need whole groups of rows: the toy has them)."""
    # loaded when the command runs, not by hpc-tp --help
    from ..comm.mpi import self_comm
    from ..kernels.quantized import GROUP_ROWS
    from ..models.bert import BertModel
    from ..models.gpt import GPTModel

    group = GROUP_ROWS if cfg.quantize else 1
    toy = dataclasses.replace(
        cfg,
        hidden=math.lcm(2 * cfg.n_heads, group),
        ffn_hidden=group,
        vocab_size=1,
        max_seq_len=1,
        type_vocab_size=min(cfg.type_vocab_size, 1),
    )
    model = (BertModel if cfg.family == "bert" else GPTModel)(toy, self_comm())
    return {name: p.partition.axis for name, p in model.named_parameters()}


def replace_folder(dest, force: bool, fill) -> Path:
    """Create folder ``dest`` by ``fill(temp)`` in a temporary sibling, renamed into place only
    when complete. An existing ``dest`` is an error unless ``force``; then it is set aside and
    deleted only after the new one is in place."""
    dest = Path(dest)
    if dest.exists() and not force:
        raise ConfigError(f"output {dest} already exists: choose another path, or pass --force to replace it")
    temp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    set_aside = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    try:
        fill(temp)
        if dest.exists():
            os.rename(dest, set_aside)
        try:
            os.rename(temp, dest)
        except OSError:
            if set_aside.exists():
                os.rename(set_aside, dest)
            raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    if set_aside.is_dir():
        shutil.rmtree(set_aside, ignore_errors=True)
    else:
        set_aside.unlink(missing_ok=True)
    return dest
