"""``hpc-tp train``: run under ``mpiexec -n N`` or ``srun`` (tp * pp * dp = N), or as one process."""

from __future__ import annotations

import argparse

from ..recompute import MODES
from .settings import TrainSettings


def add_arguments(parser: argparse.ArgumentParser):
    d = TrainSettings()
    model = parser.add_argument_group("model and layout")
    model.add_argument("--model", default=d.model, help=f"preset name or JSON config (default: {d.model})")
    model.add_argument(
        "--set",
        dest="model_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. --set dropout=0.1 (repeatable; VALUE is JSON)",
    )
    model.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (ranks inside a node)")
    model.add_argument("--pp", type=int, default=d.pp, help="pipeline stages")
    model.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp*pp))")
    model.add_argument(
        "--ep",
        type=int,
        default=d.ep,
        help="expert-parallel size for MoE models: experts spread over ep of the dp ranks "
        "(must divide dp and num_experts)",
    )
    model.add_argument(
        "--pp-layers",
        default=None,
        metavar="N,N,...",
        help="blocks per pipeline stage, or per chunk with --virtual-stages: pp*V counts "
        "(default: balanced by a cost estimate)",
    )
    model.add_argument(
        "--plan",
        choices=("auto",),
        default=None,
        help="choose tp/pp/dp, micro-batch, recompute, schedule and virtual stages (1-4) with the "
        "planner (hpc-tp plan); an explicit --virtual-stages V limits it to layouts running V",
    )
    model.add_argument(
        "--plan-cluster",
        default=d.plan_cluster,
        help="cluster preset the planner assumes (default %(default)s; see hpc-tp plan --help)",
    )
    model.add_argument(
        "--schedule",
        default=d.schedule,
        choices=("1f1b", "gpipe"),
        help="pipeline schedule (1f1b with --virtual-stages > 1: interleaved 1F1B)",
    )
    model.add_argument(
        "--virtual-stages",
        type=int,
        default=d.virtual_stages,
        metavar="V",
        help="model chunks per pipeline rank (default 1, or the planner's with --plan auto): V > 1 "
        "runs Megatron's interleaved 1F1B, rank r holding chunks r, r+pp, ... of pp*V; the "
        "bubble shrinks to (pp-1)/(V*m) for V times the messages; needs --schedule 1f1b, "
        "pp*V <= layers and the micro-batches per step a multiple of pp",
    )
    model.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default=d.recompute,
        choices=MODES,
        help="recompute activations in backward: full (the default when given alone) keeps "
        "each block's input only; selective drops attention's softmax and dropout masks "
        "and recomputes them (a few percent more FLOPs)",
    )
    model.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="norms, dropout and residuals on sequence shards (tp > 1; the same as --set sequence_parallel=true)",
    )
    model.add_argument(
        "--dtype",
        default=d.dtype,
        help="float32 (default), float64 (for checks), or float16/bfloat16 "
        "(mixed precision: float32 master weights, fp16 loss scaling)",
    )
    model.add_argument(
        "--device",
        default=d.device,
        choices=("cpu", "cuda"),
        help="cpu (numpy, default) or cuda (cupy, one GPU per node-local rank)",
    )
    model.add_argument(
        "--cuda-graph",
        action="store_true",
        help="with --device cuda: the step with its host values on the device, captured as a CUDA graph "
        "at its first step and replayed after (pp 1, NCCL groups, no dropout, no MoE, no ZeRO-1 at dp > 1)",
    )
    opt = parser.add_argument_group("optimisation")
    opt.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per forward pass (default: each dp rank's whole share at pp=1, 2*pp micro-batches at pp>1)",
    )
    opt.add_argument(
        "--global-batch",
        type=int,
        default=d.global_batch,
        help="sequences per optimizer step; gradient accumulation fills micro-batch x dp up to it",
    )
    opt.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: 16 for the demo task, else the model's max_seq_len)",
    )
    opt.add_argument("--steps", type=int, default=d.steps)
    opt.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    opt.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="linear warmup steps, then cosine decay (default: a tenth of --steps, at most 100)",
    )
    opt.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    opt.add_argument("--weight-decay", type=float, default=d.weight_decay)
    opt.add_argument("--clip-grad", type=float, default=d.clip_grad, help="global grad-norm clip (0: off)")
    opt.add_argument("--seed", type=int, default=d.seed)
    opt.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="ZeRO-1 at dp > 1: AdamW's states and float32 masters sharded over the dp ranks "
        "(gradients reduce-scattered, parameters all-gathered); the same numbers, 1/dp of "
        "the optimizer memory",
    )
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        default=d.data,
        help="'demo' (embedded 2-digit addition), a .txt file or a folder, or a .jsonl of chats "
        '({"messages": [...]} or {"prompt", "completion"} a line: the loss on the '
        "assistant's tokens only)",
    )
    data.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="Jinja chat template for a .jsonl of chats (default: the tokenizer's own, e.g. --init's)",
    )
    data.add_argument(
        "--eval-split",
        type=float,
        default=d.eval_split,
        metavar="FRACTION",
        help="chats held out of training; their assistant-token loss is logged as heldout_loss",
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        help="'bytes' or a Hugging Face tokenizer.json (default: bytes, or the --init checkpoint's)",
    )
    data.add_argument("--cache-dir", default=d.cache_dir, help="where a corpus is tokenized once (shared by ranks)")
    out = parser.add_argument_group("output and checkpoints")
    out.add_argument("--log", default=None, help="metrics as JSON lines, one per step")
    out.add_argument("--save", default=None, metavar="DIR", help="checkpoint folder")
    out.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints (0: at the end)")
    out.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept (0: all)")
    out.add_argument(
        "--init",
        default=None,
        metavar="CKPT",
        help="start from these weights (e.g. from hpc-tp convert): their config and tokenizer, step 0",
    )
    out.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    out.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="held-out evaluation interval (the demo's accuracy, the chats' --eval-split loss)",
    )
    out.add_argument("--eval-problems", type=int, default=d.eval_problems)
    out.add_argument("--samples", type=int, default=d.samples, help="sample completions printed at the end")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    faults = parser.add_argument_group("faults")
    faults.add_argument(
        "--comm-timeout",
        type=float,
        default=d.comm_timeout,
        metavar="SECONDS",
        help="abort the job, naming the missing rank, when a collective blocks this long "
        "(0: off; make it longer than a checkpoint save)",
    )
    faults.add_argument(
        "--debug-collectives",
        action="store_true",
        help="check that every rank issues the same collectives (op, shape, dtype); slow",
    )
    faults.add_argument(
        "--max-bad-steps",
        type=int,
        default=d.max_bad_steps,
        metavar="K",
        help="after K non-finite steps in a row, roll back to the last checkpoint (0: never)",
    )


def settings_from_args(args):
    # loaded when the command runs, not by hpc-tp --help
    from ..models.config import parse_overrides

    overrides = parse_overrides(args.model_overrides)
    if args.sequence_parallel:
        overrides["sequence_parallel"] = True
    fields = {k: v for k, v in vars(args).items() if k in TrainSettings.__dataclass_fields__}
    fields["model_overrides"] = overrides
    return TrainSettings(**fields)


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..launch import check_launch, install_abort_on_exception
    from .trainer import Trainer

    check_launch()
    install_abort_on_exception()
    result = Trainer(settings_from_args(args)).run()
    if result.stopped_by and result.checkpoint is None:
        return 1
    return 0
