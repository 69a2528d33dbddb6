"""``hpc-tp serve``: a checkpoint behind an HTTP endpoint shaped like the common completions API.

    POST /v1/completions  {"prompt": TEXT, "max_tokens": 16, "temperature": 1.0, "top_p": 1.0,
                           "top_k": 0, "stop": TEXT | [TEXT], "seed": INT, "stream": false}
    GET  /health

Rank 0 runs the HTTP server: handler threads parse and check each request (a bad one gets a 400
with the reason, and never reaches the model), tokenize it and queue it. The main thread takes
what is queued (up to --max-batch, waiting --batch-window-ms for company), tells the tp group a
batch is coming and decodes it with them; the other ranks only ever receive token ids. Streaming
responses are server-sent events: one ``data: {chunk}`` per piece of final text, then
``data: [DONE]``.

SIGTERM on rank 0 (``scancel`` and ``srun`` signal every rank; under ``mpirun`` send it to the
ranks, whose pids the start-up line prints) stops accepting connections, finishes every request
already accepted, then tells the other ranks to stop, and all exit 0. SIGTERM on another rank is
noted and waits for rank 0's word.
"""
from __future__ import annotations

import argparse
import os
import time

from .command import add_model_arguments

DEFAULT_MAX_TOKENS = 16  # the completions API's default


def add_arguments(parser: argparse.ArgumentParser):
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free one, printed at start)")
    parser.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default %(default)s)")
    parser.add_argument("--batch-window-ms", type=float, default=5.0,
                        help="how long a new batch waits for more requests (default %(default)s)")


def run(args) -> int:
    from ..errors import ConfigError
    from ..train.preemption import StopRequest
    from .command import load_for_inference
    from .generate import Engine

    if args.max_batch < 1 or not 0 <= args.batch_window_ms < float("inf") or not 0 <= args.port < 65536:
        raise ConfigError(f"--max-batch {args.max_batch} --batch-window-ms {args.batch_window_ms} --port {args.port}: "
                          "expected a batch >= 1, a window >= 0 and a port in 0..65535")
    grid, model, tokenizer = load_for_inference(args)
    if grid.dp_size != 1:
        raise ConfigError(f"--tp {grid.tp_size} with {grid.world.size} ranks: serve runs one tp group, "
                          f"use --tp {grid.world.size}")
    stop = StopRequest(("SIGTERM", "SIGINT"))
    engine = Engine(model, tokenizer)
    server, error = None, None
    if grid.world.rank == 0:
        from .http import CompletionServer

        try:
            server = CompletionServer(args.host, args.port, tokenizer, model.cfg, DEFAULT_MAX_TOKENS)
        except OSError as e:
            error = f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})"
    pids = grid.world.allgather_object(os.getpid())
    error = grid.world.bcast_object(error)
    if error is not None:
        raise ConfigError(error)
    if grid.world.rank != 0:
        while engine.comm.bcast_object(None) == "batch":
            engine.generate()
        return 0
    print(f"hpc-tp serve: listening on http://{server.host}:{server.port} (tp={grid.tp_size}, "
          f"rank pids {' '.join(map(str, pids))})", flush=True)
    window = args.batch_window_ms / 1000
    while not stop.received:
        _serve_batch(engine, server.next_batch(args.max_batch, window, timeout=0.1))
    server.stop_accepting()
    while server.busy():  # every request already accepted is answered
        _serve_batch(engine, server.next_batch(args.max_batch, window, timeout=0.1))
    engine.comm.bcast_object("stop")
    server.close()
    print(f"hpc-tp serve: {stop.received} received, {server.answered} requests answered, stopped", flush=True)
    return 0


def _serve_batch(engine, jobs):
    if not jobs:
        return
    engine.comm.bcast_object("batch")
    started = time.perf_counter()
    completions, metrics = engine.generate([j.ids for j in jobs], [j.params for j in jobs],
                                           on_text=lambda row, piece, finish: jobs[row].text(piece),
                                           cancelled=lambda row: jobs[row].cancelled)
    for job, completion in zip(jobs, completions):
        job.finish(completion, metrics, queued_s=started - job.arrived)
