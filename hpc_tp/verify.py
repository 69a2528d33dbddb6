"""``hpc-tp verify``: prove on this install and launch that the tensor-parallel layout gives the
numbers of one process. Every rank builds the model twice, once split over the whole world
(tp = world size) and once alone, runs forward and backward on a batch of the embedded
arithmetic task (float64), and compares loss, logits and every gradient."""

from __future__ import annotations

import argparse

import numpy as np

from . import backend
from .backend import to_numpy
from .errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--model", default="tiny", help="preset name or JSON config (default: tiny)")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=12)
    parser.add_argument("--tolerance", type=float, default=1e-10)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (numpy, default) or cuda (cupy, one GPU per node-local rank)",
    )


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from .comm import select_device
    from .comm.mpi import self_comm, world
    from .comm.nccl import device_communicator
    from .launch import check_launch
    from .models import GPTModel, load_config
    from .tokenizer import ByteTokenizer
    from .train.data import build_dataset

    _check_arguments(args)
    check_launch()
    select_device(args.device, world())
    tp, alone = device_communicator(world()), self_comm()  # on GPUs: NCCL, or MPI as the node allows
    tokenizer = ByteTokenizer()
    cfg = load_config(args.model, vocab_size=tokenizer.vocab_size)
    batch = build_dataset("demo", args.seq_len, tokenizer).get(np.arange(args.batch))
    ids, targets = (backend.xp.asarray(a) for a in batch)
    errors = {}
    models = {}
    for name, comm in (("parallel", tp), ("alone", alone)):
        model = GPTModel(cfg, comm, dtype="float64", seed=0)
        loss, count, ctx = model.forward(ids, targets)
        model.backward(ctx, 1.0 / count)
        models[name] = (model, loss / count)
    (par, loss_par), (one, loss_one) = models["parallel"], models["alone"]
    errors["loss"] = abs(loss_par - loss_one) / abs(loss_one)
    errors["logits"] = _rel(par.logits(ids), one.logits(ids))
    errors.update(gradient_errors(par, one, tp))
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= args.tolerance
    if tp.rank == 0:
        print(
            f"tp={tp.size} vs one process, {cfg.n_layers} layers, hidden {cfg.hidden}, loss {loss_one:.6f}: "
            f"{len(errors)} quantities compared, worst relative error {errors[worst]:.2e} ({worst}) -> "
            f"{'OK' if ok else 'MISMATCH'} (tolerance {args.tolerance:g})"
        )
    return 0 if ok else 1


def _check_arguments(args):
    """Every rank runs this alike, so a bad value fails them all with one line."""
    if args.batch < 1:  # the loss is divided by the batch's token count
        raise ConfigError(f"--batch {args.batch}: expected a positive integer")
    if not 0 <= args.tolerance < float("inf"):  # nan would compare false and report MISMATCH
        raise ConfigError(f"--tolerance {args.tolerance}: expected a finite relative error >= 0")


def _rel(a, b, floor=1e-300):
    a, b = to_numpy(a), to_numpy(b)  # device arrays (--device cuda) compared on the host
    return float(np.abs(a - b).max(initial=0.0)) / max(float(np.abs(b).max(initial=0.0)), floor)


def gradient_errors(parallel, alone, comm) -> dict[str, float]:
    """Relative error of every gradient of ``parallel`` (split over ``comm``) against ``alone``."""
    # loaded when the command runs, not by hpc-tp --help
    from .module import gather_full

    ref = alone.trainable_state()  # frozen parameters (LoRA's base weights) have no gradient
    # The K bias gradient is zero in exact math (softmax ignores a per-query constant), so its
    # round-off is measured against the largest gradient rather than against itself.
    largest = max(float(np.abs(to_numpy(p.grad)).max(initial=0.0)) for p in ref.values())
    return {
        f"grad {name}": _rel(
            gather_full(p.grad, p.partition, comm), ref[name].grad, largest if name.endswith("k.bias") else 1e-300
        )
        for name, p in parallel.trainable_state().items()
    }
