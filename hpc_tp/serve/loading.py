"""A checkpoint opened for inference: the start every inference command shares (``generate``,
``serve``, ``embed``, ``eval``). Collective over the world: every rank calls it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from ..backend import resolve_dtype
from ..checkpoint import load_checkpoint
from ..checkpoint.format import resolve_checkpoint
from ..comm import use_device
from ..comm.mpi import world
from ..errors import ConfigError
from ..grid import ProcessGrid
from ..launch import check_launch, install_abort_on_exception
from ..models import ModelConfig
from ..nn.attention import heads_fit
from ..pipeline import build_stage, parse_pp_layers
from ..tensor_parallel.packing import fold_adapters, pack_for_inference
from ..tokenizer import CONFIG_FILE, ByteTokenizer, load_tokenizer_dir
from .sampling import SamplingParams
from .stages import PipelineStages


def open_checkpoint(args):
    """(grid, checkpoint folder, ModelConfig) for ``args.ckpt`` at ``--tp`` x ``--pp`` (tp default: the
    ranks of a stage, the world over pp) on ``--device``; the rest of the world: replicas."""
    pp = getattr(args, "pp", 1)  # `hpc-tp embed` has no --pp: an encoder runs in one piece
    if args.tp is not None and args.tp < 1:
        raise ConfigError(f"--tp {args.tp}: expected a positive integer (default: the world size over --pp)")
    if pp < 1:
        raise ConfigError(f"--pp {pp}: expected a positive integer (default 1)")
    check_launch()
    install_abort_on_exception()
    ranks = world().size
    tp = args.tp or max(ranks // pp, 1)
    folder = resolve_checkpoint(args.ckpt)
    # the header alone needs no grid but the world's ranks: the layout is checked against its config
    # before a grid is cut, so a world the layout does not divide gets the layouts that fit the model
    meta = load_checkpoint(folder, {}, SimpleNamespace(world=world()))
    if not isinstance(meta.get("config"), dict):
        raise ConfigError(f"checkpoint {folder} has no model config (meta['config']); was it written by hpc-tp?")
    # Sequence parallelism is a training layout of the same weights; the KV-cache path runs without it.
    cfg = replace(ModelConfig.from_dict(meta["config"]), sequence_parallel=False)
    check_layout(cfg, tp, pp, ranks)
    grid = ProcessGrid(tp=tp, pp=pp)
    use_device(args.device, grid)  # on GPUs each group's transport: NCCL for tp inside a node
    return grid, folder, cfg


def check_layout(cfg: ModelConfig, tp: int, pp: int, ranks: int):
    """ConfigError unless ``cfg``'s heads split over ``tp``, its layers over ``pp`` stages (one at least
    each) and ``ranks`` into groups of tp x pp (the replicas), naming the layouts of ``ranks`` ranks that
    fit: those that keep the one of ``tp`` and ``pp`` that was not at fault, where there are any."""
    heads, stages = heads_fit(cfg.n_heads, cfg.n_kv_heads, tp), pp <= cfg.n_layers
    if heads and stages and ranks % (tp * pp) == 0:
        return
    fits = [
        (t, p)
        for p in range(1, min(ranks, cfg.n_layers) + 1)
        for t in range(1, ranks // p + 1)
        if ranks % (t * p) == 0 and heads_fit(cfg.n_heads, cfg.n_kv_heads, t)
    ]
    if not heads:
        problem = f"{cfg.n_heads} attention heads with {cfg.n_kv_heads} kv heads cannot be split over --tp {tp}"
        near = [(t, p) for t, p in fits if p == pp]
    elif not stages:
        problem = f"--pp {pp} is more pipeline stages than the model's {cfg.n_layers} layers"
        near = [(t, p) for t, p in fits if t == tp]
    else:
        problem = f"{ranks} ranks do not split into replicas of --tp {tp} x --pp {pp} = {tp * pp} ranks"
        near = []
    layouts = ", ".join(_layout(t, p, ranks) for t, p in near or fits)
    raise ConfigError(f"{problem}; on {ranks} rank{'s' if ranks > 1 else ''}: {layouts}")


def _layout(tp: int, pp: int, ranks: int) -> str:
    replicas = ranks // (tp * pp)
    stages = f" --pp {pp}" if pp > 1 else ""
    return f"--tp {tp}{stages} ({replicas} replica{'s' if replicas > 1 else ''})"


def load_for_inference(args, opened=None):
    """(grid, model, tokenizer) from ``args.ckpt``, or from ``opened`` (``open_checkpoint``'s answer,
    where the caller looked at the config first): a decoder (a ``GPTModel``, or at pp > 1 this rank's
    stage as ``serve.stages.PipelineStages``), its quantized and bfloat16 weights packed (``tensor_parallel.packing``),
    and the tokenizer saved with it (bytes when it has none)."""
    grid, folder, cfg = opened or open_checkpoint(args)
    if not cfg.causal:
        raise ConfigError(f"checkpoint {folder} holds an encoder (causal=false): use `hpc-tp embed` for it")
    spec = getattr(args, "pp_layers", None)  # None (or no such flag): balanced by cost, as training splits
    layers = None if spec is None else parse_pp_layers(spec, cfg.n_layers, grid.pp_size)
    stage = build_stage(cfg, grid, resolve_dtype(args.dtype), layers_per_stage=layers)  # the whole model at pp = 1
    load_checkpoint(folder, stage.state(), grid)
    fold_adapters(stage)  # a LoRA checkpoint's adapters into its weights, before any packing
    pack_for_inference(stage)  # weights in their products' layouts now, not at the first request
    model = PipelineStages(stage, grid) if grid.pp_size > 1 else stage
    tokenizer = load_tokenizer_dir(folder) if (folder / CONFIG_FILE).is_file() else ByteTokenizer()
    return grid, model, tokenizer


WARM_UP_SLOTS = 3  # the warm-up request's: two prompt tokens, then two new (the last never fed back)


def warm_up(model, batcher):
    """The decode kernels of ``model``'s dtype compiled or loaded from numba's cache, then one tiny
    request through a continuous ``batcher`` (collective over its group: the prefill's and the step's
    kernels at one row), its blocks given back after: a server's first request, and the times
    ``generate`` reports, do not wait for them."""
    from ..kernels import bf16_dot, f32_dot, paged_attention, quantized, small_m  # numba's, for decoding only

    for kernels in (small_m, paged_attention, bf16_dot, f32_dot, *((quantized,) if model.cfg.quantize else ())):
        kernels.warm_up(model.dtype)
    # static batches decode through the same Engine kernels; a row shorter than the request cannot take it
    if not hasattr(batcher, "generate") or getattr(batcher, "max_len", WARM_UP_SLOTS) < WARM_UP_SLOTS:
        return
    leader = batcher.comm.rank == 0
    params = [SamplingParams(max_new_tokens=2, ignore_eos=True)]
    batcher.generate([[0, 0]] if leader else None, params if leader else None)
