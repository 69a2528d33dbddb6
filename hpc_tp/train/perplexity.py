"""``hpc-tp eval``: a checkpoint's loss and perplexity on a text corpus, at any tp.

    mpiexec -n 4 hpc-tp eval --ckpt CKPT --data corpus.txt [--tp 2] [--seq-len 256] [--batch 8] [--json out.json]

The corpus is tokenized by the checkpoint's tokenizer and cut into windows of ``--seq-len`` tokens
(the training pipeline's ``CorpusDataset``: each window predicts its next tokens), all of them, or
the first ``--max-windows``. Each tp group computes the cross entropy of its windows without ever
gathering the vocabulary (the training loss, dropout off and no MoE capacity); with ``--tp`` below
the world size the data-parallel replicas split the windows (window i to replica i mod dp) and sum
their losses. The numbers are those of one process (``tests/test_eval.py``), so a converted model
can be checked against the perplexity its source reports.
"""

from __future__ import annotations

import argparse
import json
import math

from .. import backend
from ..errors import ConfigError
from ..paths import check_output_file, check_output_folder
from ..serve.command import add_model_arguments


def add_arguments(parser: argparse.ArgumentParser):
    add_model_arguments(parser)
    parser.add_argument("--data", required=True, help="a .txt file, or a folder of .txt files")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens a window predicts (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="windows a forward pass takes (default %(default)s)")
    parser.add_argument("--max-windows", type=int, default=None, metavar="N", help="only the first N windows")
    parser.add_argument(
        "--cache-dir", default="io/cache", help="where the corpus is tokenized once (default %(default)s)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON (world rank 0)")


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..serve.loading import load_for_inference
    from .data import CorpusDataset, build_dataset

    for flag, value in (("--seq-len", args.seq_len), ("--batch", args.batch), ("--max-windows", args.max_windows)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: expected a positive whole number")
    if args.json is not None:  # every rank, though rank 0 alone writes it: they fail together
        check_output_file(args.json, "--json")
    check_output_folder(args.cache_dir, "--cache-dir")
    grid, model, tokenizer = load_for_inference(args)
    world = grid.world
    dataset = build_dataset(args.data, args.seq_len, tokenizer, args.cache_dir, rank=world.rank, barrier=world.barrier)
    if not isinstance(dataset, CorpusDataset):
        raise ConfigError(f"--data {args.data}: expected a .txt file or a folder of .txt files")
    windows = min(len(dataset), args.max_windows or len(dataset))
    mine = list(range(grid.coords.dp, windows, grid.dp_size))
    loss, tokens = 0.0, 0
    with model.inference(), model.uncounted():
        for start in range(0, len(mine), args.batch):
            ids, targets = dataset.get(mine[start : start + args.batch])
            loss_sum, count, _ = model.forward(backend.xp.asarray(ids), backend.xp.asarray(targets))
            loss, tokens = loss + float(loss_sum), tokens + int(count)
    loss, tokens = grid.dp.all_reduce_scalar(loss), int(grid.dp.all_reduce_scalar(tokens))
    result = {
        "checkpoint": str(args.ckpt),
        "data": str(args.data),
        "windows": windows,
        "seq_len": args.seq_len,
        "tokens": tokens,
        "loss": loss / tokens,
        "perplexity": math.exp(loss / tokens),
        "tp": grid.tp_size,
        "dp": grid.dp_size,
        "dtype": args.dtype,
    }
    if world.rank == 0:
        print(
            f"hpc-tp eval: {tokens} tokens in {windows} windows of {args.seq_len}: loss {result['loss']:.6f}, "
            f"perplexity {result['perplexity']:.4f} (tp={grid.tp_size}, dp={grid.dp_size}, {args.dtype})"
        )
        if args.json is not None:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
    return 0
