"""The ``hpc-tp`` command. Each subcommand lives in its own module with ``add_arguments(parser)``
and ``run(args) -> int``; they are imported only when chosen, so ``hpc-tp --help`` is instant."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import ConfigError

COMMANDS = {
    "verify": ("hpc_tp.verify", "check that tp = world size gives the numbers of one process"),
    "train": ("hpc_tp.train.command", "train a model (run under mpiexec/srun for tp/pp/dp > 1)"),
    "inspect": ("hpc_tp.checkpoint.inspect", "show a checkpoint's config, step and tensors"),
    "convert": ("hpc_tp.checkpoint.convert", "import a Hugging Face model folder or a GGUF file as a checkpoint"),
    "export": ("hpc_tp.checkpoint.export", "write a checkpoint as a Hugging Face folder (config.json + safetensors)"),
    "embed": ("hpc_tp.serve.embed", "sentence embeddings and token states from a BERT encoder checkpoint"),
    "plot": ("hpc_tp.train.plot", "plot the loss curve of a --log JSON-lines file"),
    "bench": ("hpc_tp.bench.command", "communication and step benchmarks"),
    "plan": ("hpc_tp.plan.command", "pick tp, pp, dp, micro-batch and recomputation for a model on a cluster"),
    "generate": ("hpc_tp.serve.command", "generate text from a checkpoint (prompts or a JSON-lines batch)"),
    "serve": ("hpc_tp.serve.server", "serve a checkpoint over HTTP (completions API, batched over tp ranks)"),
    "eval": ("hpc_tp.train.perplexity", "a checkpoint's loss and perplexity on a text corpus, at any tp"),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="hpc-tp", description="MPI tensor-parallel transformer engine")
    parser.add_argument("--version", action="version", version=f"hpc-tp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:  # a command whose module is missing from this install
            p.set_defaults(_missing=str(e))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"hpc-tp {args.command}: not available in this install ({args._missing})", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ConfigError as e:
        from .launch import report_error

        report_error(e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
