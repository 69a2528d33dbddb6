"""``hpc-tp serve``: a checkpoint behind an HTTP endpoint shaped like OpenAI's API.

    POST /v1/completions       {"prompt": TEXT | [TEXT] | [ids] | [[ids]], "max_tokens": 16, "temperature": 1.0,
                                "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                "repetition_penalty", "stop": TEXT | [TEXT], "seed", "n", "echo", "logprobs",
                                "ignore_eos", "stream": false, "stream_options": {"include_usage": false}}
    POST /v1/chat/completions  {"messages": [{"role": ROLE, "content": TEXT | [text parts] | null}, ...],
                                "logprobs": false, "top_logprobs", the same others}
    GET  /v1/models, /v1/models/{id}   the model served, by --served-model-name (the checkpoint folder's name)
    POST /tokenize, /detokenize; GET /version, /health, /metrics

Both take "response_format": {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
"schema"}}, the answer held to it token by token (``serve.structured``); a chat takes "tools" and
"tool_choice", and its calls come back as OpenAI's "tool_calls" (``serve.tools``). ``serve.api_request``
says what each field means; ``serve.http`` lists the endpoints.

A chat request's messages become a prompt through the model's chat template (``serve.chat``): the
one its checkpoint carries (imported with a Hugging Face or GGUF chat model), or --chat-template FILE.

Rank 0 runs the HTTP server: handler threads parse and check each request (a bad one gets a 400
with the reason, and never reaches the model), tokenize it and queue it. The main thread runs the
tp group's continuous batching (``serve.continuous``): --max-batch rows decode together, and between
two decode steps requests that finished leave their row and queued ones are prefilled into free
rows (together, in passes of at most --max-batch-prefill-tokens padded tokens), so a new request
starts within one step of arriving instead of waiting for a whole batch. An
idle server waits --batch-window-ms after a first request for company before it starts. The other
ranks only ever receive token ids. ``--pp`` cuts the layers into pipeline stages of tp ranks each
(``serve.stages``), one tp x pp group decoding. With more ranks than tp x pp (world = tp x pp x
replicas) every such group is a replica with its own batcher and KV cache, and the requests go to
whichever has a free row (``serve.replicas``). ``--batching static`` runs the batches of before instead
(``StaticBatches``). Streaming responses are server-sent events: one
``data: {chunk}`` per piece of final text, then ``data: [DONE]``.

A response's usage reports time_to_first_token_s from its arrival (queue_s of it waiting for a row),
decode_tokens_per_s of its own tokens after the first, batch_size (rows busy once it was admitted,
its own included) and kv_cache_bytes_per_rank (the whole pool of KV blocks, allocated at start:
--kv-cache-memory, or --max-batch rows of --max-model-len tokens).

Stopping (``serve.shutdown``): SIGTERM on rank 0 (``scancel`` and ``srun`` signal every rank; under
``mpirun`` send it to the ranks, whose pids the start-up line prints) stops accepting connections,
finishes every request already accepted, then tells the other ranks to stop, and all exit 0.
Ctrl-C (SIGINT, or Open MPI's mpiexec killing the job on one) stops in a hurry: open streams end at
once with a final chunk and ``[DONE]``. A signal on another rank is noted and waits for rank 0's word.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from ..errors import ConfigError
from .command import add_batching_argument, add_chat_template_argument, add_model_arguments

DEFAULT_MAX_TOKENS = 16  # the completions API's default


def add_arguments(parser: argparse.ArgumentParser):
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free one, printed at start)")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="rows decoded together; a request takes a free row between decode steps (default %(default)s)",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="how long an idle server waits for more requests after a first one (default %(default)s)",
    )
    add_batching_argument(parser, "requests")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="positions a request may fill, prompt and new tokens (default: the model's "
        "max_seq_len); continuous batching's KV cache holds N slots a row",
    )
    parser.add_argument(
        "--max-batch-prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompts admitted together are prefilled in one pass of at most N padded tokens "
        "(prompts x the longest), which bounds its activation memory; a longer prompt "
        "goes alone, 1 prefills one at a time (default: 2048, or --max-model-len if more)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens prefilled per iteration at most: a longer prompt is prefilled over "
        "several, the busy rows decoding between them (chunked prefill; default 256)",
    )
    add_chat_template_argument(parser, "/v1/chat/completions")
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model's name in answers and /v1/models; a request naming another is refused "
        "(default: the checkpoint folder's name)",
    )


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from ..kernels import threads
    from .chat import read_template, stop_at_end_of_turn, template_for
    from .embed import load_encoder
    from .loading import load_for_inference, open_checkpoint, warm_up
    from .replicas import RemoteJobs, Router
    from .shutdown import Shutdown

    if args.max_batch < 1 or not 0 <= args.batch_window_ms < float("inf") or not 0 <= args.port < 65536:
        raise ConfigError(
            f"--max-batch {args.max_batch} --batch-window-ms {args.batch_window_ms} --port {args.port}: "
            "expected a batch >= 1, a window >= 0 and a port in 0..65535"
        )
    for flag, value in (
        ("--max-model-len", args.max_model_len),
        ("--prefill-chunk", args.prefill_chunk),
        ("--max-batch-prefill-tokens", args.max_batch_prefill_tokens),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: expected an integer >= 1")
    template_source = read_template(args.chat_template)  # a bad file fails every rank before the load
    opened = open_checkpoint(args)
    grid, _, cfg = opened
    encoder = not cfg.causal  # served for /v1/embeddings
    if encoder and grid.tp_size != grid.world.size:  # embeddings batch over one tp group, in one piece
        raise ConfigError(
            f"--tp {grid.tp_size} --pp {grid.pp_size} with {grid.world.size} ranks: an encoder is served "
            f"by one tp group, use --tp {grid.world.size} --pp 1"
        )
    _, model, tokenizer = (load_encoder if encoder else load_for_inference)(args, opened)
    max_len = min(model.cfg.max_seq_len, args.max_model_len or model.cfg.max_seq_len)
    stop = Shutdown()
    # Every replica's tp rank 0 samples, so each checks the stop ids, the template's end of turn among them.
    template = None if encoder else template_for(tokenizer, template_source, args.chat_template)
    stop_at_end_of_turn(tokenizer, template)
    # The replicas' requests and answers go over a communicator of their own (serve.replicas).
    replicas = grid.world.split(0, grid.world.rank) if grid.dp_size > 1 else None
    leaders = [int(grid.ranks[d, 0, 0]) for d in range(grid.dp_size)]  # each replica's first rank, which samples
    server, error = None, None
    if grid.world.rank == 0:
        from .http import CompletionServer

        try:
            server = CompletionServer(
                args.host,
                args.port,
                tokenizer,
                model.cfg,
                DEFAULT_MAX_TOKENS,
                max_len,
                template,
                args.served_model_name or _model_name(args.ckpt),
            )
        except OSError as e:
            error = f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})"
    pids = grid.world.allgather_object(os.getpid())
    error = grid.world.bcast_object(error)
    if error is not None:
        raise ConfigError(error)
    batcher, layout = _batcher(args, model, tokenizer, max_len, encoder)
    if not encoder:  # the decode kernels compile or load now, not in the first request
        warm_up(model, batcher)
    if server is not None:  # a request the whole KV cache cannot hold is refused as it comes
        server.kv_tokens = getattr(batcher, "kv_tokens", None)
    if grid.world.rank != 0:
        batcher.run(RemoteJobs(replicas) if grid.world.rank in leaders else None)
        return 0
    print(
        f"hpc-tp serve: listening on http://{server.host}:{server.port} (tp={grid.tp_size}, pp={grid.pp_size}, "
        f"replicas={grid.dp_size}, rank pids {' '.join(map(str, pids))}); {layout}; "
        f"{threads.COUNT} compute thread{'s' * (threads.COUNT > 1)} a rank",
        flush=True,
    )
    stop.on_hurry = server.hurry
    router = Router(replicas, leaders[1:], server, args.max_batch) if replicas is not None else None
    batcher.run(_Jobs(server, stop, args.batch_window_ms / 1000))
    spread = ""
    if router is not None:  # every request is answered: the other replicas stop too
        router.close()
        remote = list(router.sent.values())
        spread = f" (by replica: {' '.join(map(str, [server.answered - sum(remote), *remote]))})"
    server.close()
    print(f"hpc-tp serve: {stop.received} received, {server.answered} requests answered{spread}, stopped", flush=True)
    return 0


def _batcher(args, model, tokenizer, max_len: int, encoder: bool):
    """The loop every rank runs, and a word on its memory for the start-up line."""
    from .continuous import ContinuousBatcher
    from .embeddings import EmbeddingBatches
    from .encoder import pad_id_of
    from .generate import Engine

    if encoder:
        return EmbeddingBatches(model, args.max_batch, pad_id_of(tokenizer)), f"{args.max_batch} inputs a batch"
    engine = Engine(model, tokenizer)
    if args.batching == "static":
        return StaticBatches(engine, args.max_batch), "static batches"
    batcher = ContinuousBatcher(
        engine,
        args.max_batch,
        max_len,
        args.prefix_caching,
        args.max_batch_prefill_tokens,
        args.prefill_chunk,
        args.kv_block_size,
        args.kv_cache_memory,
    )
    return batcher, (
        f"KV cache {batcher.cache.nbytes / 2**20:.1f} MiB a rank: {batcher.blocks.usable} units of "
        f"{batcher.blocks.size} tokens ({batcher.kv_tokens} tokens) for {args.max_batch} rows"
    )


class StaticBatches:
    """``--batching static``: the requests queued together (up to --max-batch) decode as one batch
    (``Engine.generate``) until its longest is done, and a request arriving meanwhile waits for the
    next batch. Kept beside continuous batching because on a GPU at tp = 1 a static batch's decode
    steps replay a CUDA graph (``serve.decoding``), which the continuous step does not yet. The same
    ``run(source)`` as ``ContinuousBatcher``; ``source.take`` is only ever asked while idle."""

    def __init__(self, engine, rows: int):
        self.engine, self.rows = engine, rows

    def run(self, source=None):
        comm = self.engine.comm
        while True:
            jobs = None
            if comm.rank == 0:
                while (jobs := source.take(self.rows, idle=True)) == []:
                    pass
            if comm.bcast_object(jobs is not None, idle=True) is False:
                return
            if comm.rank != 0:
                self.engine.generate()
                continue
            started = time.perf_counter()
            completions, metrics = self.engine.generate(
                [j.ids for j in jobs],
                [j.params for j in jobs],
                on_text=lambda row, piece, finish: jobs[row].text(piece),
                cancelled=lambda row: jobs[row].cancelled,
            )
            for job, completion in zip(jobs, completions):
                job.finish(completion, metrics, queued_s=started - job.arrived)


class _Jobs:
    """What the batcher admits (``run``'s source, either batcher's): the HTTP server's queued jobs.
    On a stop signal (``serve.shutdown.Shutdown``) it stops accepting connections, and once every
    request accepted is answered (a hurried stop: ended) and no row is busy it ends serving."""

    def __init__(self, server, stop, window: float):
        self.server, self.stop, self.window, self.closing = server, stop, window, False

    def take(self, limit: int, idle: bool):
        if self.stop.hurried and not self.server.hurrying:  # the signal came before the server was built
            self.server.hurry()
        if self.stop.received and not self.closing:
            self.server.stop_accepting()
            self.closing = True
        if not idle:  # rows are decoding: only what is queued now
            return self.server.next_batch(limit, 0, timeout=0)
        if self.server.hurrying and not self.server.answering():  # its jobs cancelled, their rows free
            return None
        if self.closing and not self.server.busy():
            return None
        return self.server.next_batch(limit, self.window, timeout=0.1)


def _model_name(ckpt: str) -> str:
    """The checkpoint's folder name: the root's, where ``ckpt`` is one of its step folders."""
    # loaded when the command runs, not by hpc-tp --help
    from ..checkpoint.format import is_step_folder

    folder = Path(ckpt).resolve()
    return folder.parent.name if is_step_folder(folder.name) else folder.name
