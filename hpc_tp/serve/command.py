"""``hpc-tp generate``: text from a checkpoint, the model split over tp ranks (and pp stages).

    hpc-tp generate --ckpt CKPT --prompt TEXT                      one prompt, text to stdout
    hpc-tp generate --ckpt CKPT --prompts IN.jsonl --out OUT.jsonl  a batch job (sbatch)

The checkpoint brings the model config (meta["config"]) and the tokenizer (its saved files; bytes
when it has none); each rank reads only its slice of the weights. World rank 0 alone reads the
prompts and writes the results; the others receive token ids by broadcast. ``--pp`` cuts the layers
into pipeline stages (``serve.stages``); with tp x pp < world size, the world is cut into data-parallel
replicas that share the prompts. ``--batching continuous`` (the default) decodes them with
``serve.continuous``'s scheduler, a prompt taking a row as soon as one is free; ``--batching static``
in batches of --batch-size that run until their longest is done.

A prompts line is {"prompt": TEXT} plus optional "id" and per-line overrides of the sampling
flags (max_new_tokens, temperature, top_k, top_p, seed, stop: a string or a list). An output line
adds the completion, its finish reason, token counts, time to first token, decode tokens/s and the
batch's metrics (per-rank KV-cache bytes, communication time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..comm.base import on_rank0
from ..errors import ConfigError
from ..jsonl import read_json_lines
from ..paths import check_output_file
from .chat import read_template, stop_at_end_of_turn, template_for

# The half types keep weights, activations and the KV cache in 16 bits (half the memory and the bytes
# each decode step reads); products sum in float32 (``kernels.small_m``), norms and softmax too.
DTYPES = ("float32", "float64", "bfloat16", "float16")
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def add_model_arguments(parser: argparse.ArgumentParser, stages: bool = True):
    """The checkpoint, layout and precision flags ``generate``, ``serve`` and ``embed`` share; ``stages``:
    with ``--pp`` (a decoder's pipeline stages; an encoder runs in one piece)."""
    parser.add_argument(
        "--ckpt",
        "--checkpoint",
        dest="ckpt",
        required=True,
        metavar="CKPT",
        help="checkpoint step folder, or a root holding them (the latest is used)",
    )
    over = " over --pp" if stages else ""
    parser.add_argument("--tp", type=int, default=None, help=f"tensor-parallel size (default: the world size{over})")
    if stages:
        parser.add_argument(
            "--pp",
            type=int,
            default=1,
            help="pipeline stages, each its share of the layers on tp ranks: a model larger than a node, "
            "pp across nodes and tp inside (default %(default)s); the world is tp x pp x replicas",
        )
        parser.add_argument(
            "--pp-layers",
            default=None,
            metavar="N,N,...",
            help="layers per pipeline stage, one count a stage (default: balanced by a cost estimate, as training splits)",
        )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="precision of weights and activations; bfloat16/float16 sum products in float32 (default %(default)s)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="array backend (default %(default)s)")


def add_batching_argument(parser: argparse.ArgumentParser, unit: str):
    parser.add_argument(
        "--batching",
        choices=("continuous", "static"),
        default="continuous",
        help=f"continuous: {unit} take a row as soon as one is free, between decode steps; "
        f"static: a batch runs until its longest is done, its decode steps CUDA graphs "
        f"on a GPU at tp=1 (default %(default)s)",
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"continuous batching: the KV cache keeps full blocks of tokens (shared, and after their "
        f"request ends until the memory is needed), and {unit} that begin with them prefill only "
        f"the rest (default: on)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="continuous batching: GiB of K/V blocks a rank, allocated at start; where they run out the "
        "youngest request is preempted and recomputed later (default: enough for every row at "
        "the longest a request may be, which never preempts)",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        default=16,
        metavar="N",
        help="continuous batching: tokens a KV cache block holds (default %(default)s)",
    )


def add_chat_template_argument(parser: argparse.ArgumentParser, used_by: str):
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help=f"Jinja chat template for {used_by} (default: the one the checkpoint's tokenizer carries, if any)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of every prompt (default %(default)s)")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text appears (repeatable); the model's stop ids (eos, its chat template's end of turn) always stop",
    )


def add_arguments(parser: argparse.ArgumentParser):
    add_model_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='JSON lines, each {"prompt": TEXT, ...} or, for a chat model, {"messages": [...], ...}',
    )
    parser.add_argument("--out", metavar="FILE.jsonl", help="results as JSON lines (default: stdout)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default %(default)s)")
    add_batching_argument(parser, "prompts")
    add_chat_template_argument(parser, '--prompts lines with "messages"')
    add_sampling_arguments(parser)


def sampling_defaults(args) -> dict:
    return {key: getattr(args, key) for key in SAMPLING_KEYS}


def run(args) -> int:
    # The model and the engine load only when the command runs (``hpc-tp --help`` imports this module).
    from .continuous import ContinuousBatcher
    from .generate import Engine, check_request
    from .loading import WARM_UP_SLOTS, load_for_inference, warm_up
    from .sampling import SamplingParams

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: expected an integer >= 1")
    if args.out is not None:  # every rank, though rank 0 alone writes it: they fail together
        check_output_file(args.out, "--out")
    template_source = read_template(args.chat_template)  # a bad file fails every rank before the load
    grid, model, tokenizer = load_for_inference(args)
    world = grid.world
    requests = []  # texts stay on rank 0: the others receive token ids and sampling parameters

    def read():
        template = template_for(tokenizer, template_source, args.chat_template)
        stop_at_end_of_turn(tokenizer, template)  # rank 0 samples, so rank 0 alone checks stop ids
        requests.extend(_read_requests(args, tokenizer, template))
        return [(r["ids"], r["sampling"]) for r in requests]

    work = on_rank0(world, read)
    params = [SamplingParams(**sampling) for _, sampling in work]
    for n, ((ids, _), p) in enumerate(zip(work, params), start=1):  # every rank alike, before any replica starts
        try:
            check_request(ids, p, model.cfg)
        except ConfigError as e:
            raise ConfigError(f"prompt {n}: {e}") from None
    engine = Engine(model, tokenizer)
    mine = []
    if args.batching == "continuous":  # each replica its share of the prompts, rows refilled as they finish
        share = list(range(grid.coords.dp, len(work), grid.dp_size))
        longest = max((len(work[i][0]) + params[i].max_new_tokens - 1 for i in share), default=1)
        longest = min(max(longest, WARM_UP_SLOTS), model.cfg.max_seq_len)  # its rows' slots, and the warm-up's
        batcher = ContinuousBatcher(
            engine,
            max(1, min(args.batch_size, len(share))),
            longest,
            args.prefix_caching,
            block_size=args.kv_block_size,
            kv_cache_memory=args.kv_cache_memory,
        )
        warm_up(model, batcher)  # the times it reports are the model's, not numba's cache loading
        out = batcher.generate([work[i][0] for i in share], [params[i] for i in share])
        if out is not None:
            mine = [(i, c, metrics) for i, (c, metrics) in zip(share, out)]
    else:  # batches of --batch-size prompts, the replicas taking turns
        for b, start in enumerate(range(0, len(work), args.batch_size)):
            if b % grid.dp_size != grid.coords.dp:
                continue
            chunk = slice(start, start + args.batch_size)
            out = engine.generate([ids for ids, _ in work[chunk]], params[chunk])
            if out is not None:
                completions, metrics = out
                mine += [(start + i, c, metrics) for i, c in enumerate(completions)]
    results = sorted((r for part in world.allgather_object(mine) for r in part), key=lambda r: r[0])
    if world.rank == 0:
        _write_results(args, [_record(requests[i], c, m) for i, c, m in results])
    return 0


def _read_requests(args, tokenizer, template) -> list[dict]:
    """Rank 0: the prompts with their token ids and sampling; a "messages" line's prompt is the chat
    ``template``'s rendering of them."""
    defaults = sampling_defaults(args)
    if args.prompt is not None:
        lines = [{"prompt": args.prompt}]
    else:
        path = Path(args.prompts)
        lines = []
        for n, line in read_json_lines(path, "--prompts"):
            if "messages" in line:
                if "prompt" in line:
                    raise ConfigError(f'--prompts {path} line {n}: both "prompt" and "messages": give one')
                line["prompt"] = _chat_prompt(template, line["messages"], f"--prompts {path} line {n}")
            if not isinstance(line.get("prompt"), str):
                raise ConfigError(f'--prompts {path} line {n}: expected an object with a "prompt" string or "messages"')
            unknown = sorted(set(line) - {"prompt", "messages", "id", *SAMPLING_KEYS})
            if unknown:
                raise ConfigError(
                    f"--prompts {path} line {n}: unknown keys {', '.join(unknown)}; "
                    f"known: prompt, messages, id, {', '.join(SAMPLING_KEYS)}"
                )
            if isinstance(line.get("stop"), str):  # one stop string, as the HTTP API takes it
                line["stop"] = [line["stop"]]
            lines.append(line)
        if not lines:
            raise ConfigError(f"--prompts {path}: no prompts in it (expected JSON lines)")
    return [
        {
            "id": line.get("id", n),
            "prompt": line["prompt"],
            "ids": _encoded(tokenizer, line["prompt"], n + 1),
            "sampling": {**defaults, **{k: line[k] for k in SAMPLING_KEYS if k in line}},
        }
        for n, line in enumerate(lines)
    ]


def _chat_prompt(template, messages, where: str) -> str:
    if template is None:
        raise ConfigError(
            f"{where}: messages need a chat template, and the checkpoint carries none: pass --chat-template FILE"
        )
    try:
        return template.render(messages)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _encoded(tokenizer, prompt: str, n: int) -> list[int]:
    try:
        return tokenizer.encode(prompt)
    except ConfigError as e:  # a prompt no encoding holds (a lone surrogate): say which
        raise ConfigError(f"prompt {n}: {e}") from None


def _record(request: dict, completion, metrics) -> dict:
    return {
        "id": request["id"],
        "prompt": request["prompt"],
        "completion": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "cached_tokens": completion.cached_tokens,
        "completion_tokens": len(completion.ids),
        "ttft_s": completion.ttft_s,
        "decode_tokens_per_s": completion.decode_tokens_per_s,
        "batch": metrics.to_dict(),
    }


def _write_results(args, records: list[dict]):
    if args.prompt is not None and args.out is None:
        print(records[0]["prompt"] + records[0]["completion"], flush=True)
        print(
            json.dumps({k: v for k, v in records[0].items() if k not in ("prompt", "completion")}),
            file=sys.stderr,
            flush=True,
        )
        return
    text = "".join(json.dumps(r) + "\n" for r in records)
    if args.out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(out.name + ".tmp")
    temp.write_text(text)
    temp.replace(out)
