"""A checkpoint opened for inference: the start every inference command shares (``generate``,
``serve``, ``embed``, ``eval``). Collective over the world: every rank calls it."""

from __future__ import annotations

from dataclasses import replace

from .. import backend
from ..backend import resolve_dtype
from ..checkpoint import load_checkpoint
from ..checkpoint.format import resolve_checkpoint
from ..comm.mpi import world
from ..errors import ConfigError
from ..grid import ProcessGrid
from ..launch import check_launch, install_abort_on_exception
from ..models import GPTModel, ModelConfig
from ..nn.attention import heads_fit
from ..tokenizer import CONFIG_FILE, ByteTokenizer, load_tokenizer_dir


def open_checkpoint(args):
    """(grid, checkpoint folder, ModelConfig) for ``args.ckpt`` at ``--tp`` (default: the world) on
    ``--device``."""
    if args.tp is not None and args.tp < 1:
        raise ConfigError(f"--tp {args.tp}: expected a positive integer (default: the world size)")
    check_launch()
    install_abort_on_exception()
    grid = ProcessGrid(tp=args.tp or world().size, pp=1)
    backend.use(args.device, grid.local_rank)
    folder = resolve_checkpoint(args.ckpt)
    meta = load_checkpoint(folder, {}, grid)
    if not isinstance(meta.get("config"), dict):
        raise ConfigError(f"checkpoint {folder} has no model config (meta['config']); was it written by hpc-tp?")
    # Sequence parallelism is a training layout of the same weights; the KV-cache path runs without it.
    cfg = replace(ModelConfig.from_dict(meta["config"]), sequence_parallel=False)
    check_layout(cfg, grid.tp.size, world().size)
    return grid, folder, cfg


def check_layout(cfg: ModelConfig, tp: int, ranks: int):
    """ConfigError unless ``cfg``'s heads split over ``tp``, naming the layouts of ``ranks`` ranks that
    fit: a tp the heads allow, the world cut into that many replicas."""
    if heads_fit(cfg.n_heads, cfg.n_kv_heads, tp):
        return
    fits = [t for t in range(1, ranks + 1) if ranks % t == 0 and heads_fit(cfg.n_heads, cfg.n_kv_heads, t)]
    layouts = ", ".join(f"--tp {t} ({ranks // t} replica{'s' if ranks // t > 1 else ''})" for t in fits)
    raise ConfigError(
        f"{cfg.n_heads} attention heads with {cfg.n_kv_heads} kv heads cannot be split over --tp {tp}; "
        f"on {ranks} rank{'s' if ranks > 1 else ''}: {layouts}"
    )


def load_for_inference(args, opened=None):
    """(grid, model, tokenizer) from ``args.ckpt``, or from ``opened`` (``open_checkpoint``'s answer,
    where the caller looked at the config first): a decoder, and the tokenizer saved with it (bytes
    when it has none)."""
    grid, folder, cfg = opened or open_checkpoint(args)
    if not cfg.causal:
        raise ConfigError(f"checkpoint {folder} holds an encoder (causal=false): use `hpc-tp embed` for it")
    model = GPTModel(cfg, grid.tp, dtype=resolve_dtype(args.dtype))
    load_checkpoint(folder, model.state(), grid)
    tokenizer = load_tokenizer_dir(folder) if (folder / CONFIG_FILE).is_file() else ByteTokenizer()
    return grid, model, tokenizer
