"""The HTTP side of ``hpc-tp serve`` (rank 0 only): parse and check requests, queue them as jobs,
hand queued jobs to the decoding loop (``serve.continuous``), answer each as JSON or as server-sent
events. The endpoints of OpenAI's API that serving a model takes, and vLLM's few more:

    POST /v1/completions        continue a ``prompt`` (``serve.api_request`` says what it takes;
                                ``response_format`` holds an answer to JSON: ``serve.structured``)
    POST /v1/chat/completions   render ``messages`` with the model's chat template (``serve.chat``),
                                answer with the assistant's ``message`` (streamed as ``delta`` chunks);
                                ``tools`` let it call functions (``serve.tools``)
    GET  /v1/models             the one model served, by the name requests give as ``model``
    GET  /v1/models/{id}        that model's card (404 naming any other id)
    POST /tokenize, /detokenize vLLM's: a prompt's or chat's token ids, ids' text (``serve.tokenize_endpoints``)
    POST /v1/embeddings         an encoder (BERT) checkpoint's sentence embeddings (``serve.embeddings``);
                                the only POST an encoder answers, and one a decoder refuses
    GET  /version, /health      the package's version; 200 while serving
    GET  /metrics               what the server did (``serve.metrics``)

Handler threads never touch the model: they turn a request into jobs (token ids and sampling
parameters, one per choice) and wait on its event queue, which the decoding loop fills with text
pieces and, at the end of each job, its completion. A request that fails a check is answered 400
with the reason at once. A client that goes away marks its jobs cancelled, and the decoding loop
frees their rows; a connection that sends nothing for IDLE_TIMEOUT_S is closed, so it cannot hold
up a graceful shutdown.
"""

from __future__ import annotations

import itertools
import json
import queue
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .. import __version__
from ..errors import ConfigError
from . import api_response
from .api_request import CHAT, COMPLETIONS, Request, UnknownModel, parse_request
from .embeddings import EmbeddingJob, embedding_response, parse_embedding_request
from .metrics import ServerMetrics
from .tokenize_endpoints import detokenize, tokenize

MAX_BODY_BYTES = 16 * 2**20
IDLE_TIMEOUT_S = 10.0  # a connection that sends (or takes) nothing this long is closed
TOKENIZE, DETOKENIZE, EMBEDDINGS = "/tokenize", "/detokenize", "/v1/embeddings"
_POST = (COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE, EMBEDDINGS)


class CompletionServer:
    def __init__(
        self,
        host: str,
        port: int,
        tokenizer,
        cfg,
        default_max_tokens: int,
        max_model_len: int | None = None,
        chat_template=None,
        model_name: str = "hpc-tp",
    ):
        """``cfg``: the model's; an encoder's (``causal`` false) is served for /v1/embeddings only."""
        self.tokenizer, self.cfg, self.default_max_tokens = tokenizer, cfg, default_max_tokens
        self.encoder = not cfg.causal
        self.max_model_len, self.chat_template, self.model_name = max_model_len, chat_template, model_name
        self.kv_tokens: int | None = None  # what the batcher's KV cache holds for one request, once built
        self.started = int(time.time())
        self.metrics = ServerMetrics()
        self.jobs: queue.Queue = queue.Queue()
        self.answered = 0
        self._active = 0  # connections accepted and not yet closed
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._open: set[Request] = set()  # requests being answered
        self.hurrying = False
        self.httpd = _CountingServer((host, port), _handler(self), self)
        self.host, self.port = self.httpd.server_address[:2]
        # polled often, so that a hurried stop stops taking connections within its 0.25 s
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="http", daemon=True
        )
        self._thread.start()

    def next_batch(self, limit: int, window: float, timeout: float) -> list:
        """Up to ``limit`` queued jobs: waits ``timeout`` for a first one, then ``window`` for company
        (both 0: only those queued now)."""
        try:
            batch = [self.jobs.get(timeout=timeout)]
        except queue.Empty:
            return []
        deadline = time.perf_counter() + window
        while len(batch) < limit:
            try:
                batch.append(self.jobs.get(timeout=max(deadline - time.perf_counter(), 0)))
            except queue.Empty:
                break
        self.metrics.admitted(len(batch))
        return batch

    def stop_accepting(self):
        self.httpd.shutdown()  # returns once serve_forever has stopped taking connections

    def busy(self) -> bool:
        with self._lock:
            return self._active > 0 or not self.jobs.empty()

    def refusal(self, path: str) -> tuple[int, str] | None:
        """(status, reason) where a POST to ``path`` is not for this server; None where it is."""
        if path not in _POST:
            return 404, f"no such endpoint: POST {path} (use {', '.join(_POST)})"
        if path != EMBEDDINGS and self.encoder:
            return 400, (
                f"this server serves an encoder ({self.cfg.family}) checkpoint: it answers {EMBEDDINGS}, not {path}"
            )
        if path == EMBEDDINGS and not self.encoder:
            return 400, (
                f"{EMBEDDINGS} needs an encoder (BERT) checkpoint: this server serves a decoder "
                f"({self.cfg.family}); use {COMPLETIONS} or {CHAT}"
            )
        return None

    def parse(self, path: str, body: bytes) -> Request | EmbeddingJob:
        """The request a body sent to ``path`` makes, or ConfigError saying why it makes none."""
        if path == EMBEDDINGS:
            request = parse_embedding_request(body, self.tokenizer, self.cfg, self.model_name)
            request.on_finish = self.metrics.embedded
            return request
        request = parse_request(
            body,
            self.tokenizer,
            self.cfg,
            self.default_max_tokens,
            self.max_model_len,
            path,
            self.chat_template,
            self.model_name,
            self.kv_tokens,
        )
        for job in request.jobs:
            job.on_finish = self.metrics.finish
        return request

    def answering(self) -> bool:
        """Whether some request is still being answered (a hurried stop waits only for these)."""
        with self._lock:
            return bool(self._open)

    def submit(self, request: Request | EmbeddingJob) -> bool:
        """Queue ``request``'s jobs for the batcher, counted as being answered; False once the server is
        stopping in a hurry (nothing queued)."""
        with self._lock:
            if self.hurrying:
                return False
            self._open.add(request)
        for job in request.jobs:
            self.jobs.put(job)
        return True

    def done_with(self, request: Request | EmbeddingJob):
        with self._lock:
            self._open.discard(request)

    def hurry(self):
        """A hurried stop (``serve.shutdown``; any thread): open answers end now, queued jobs are
        dropped, and the listening socket closes, so new connections are refused."""
        with self._lock:
            self.hurrying = True
            aborted = list(self._open)
        for request in aborted:
            request.abort()
        while True:
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                break
        self.stop_accepting()
        self.close()

    def close(self):
        self.httpd.server_close()

    def _count(self, connections: int = 0, answered: int = 0):
        with self._lock:
            self._active += connections
            self.answered += answered

    def answer(self, request: Request, job_id: int, results: dict) -> dict:
        """The whole answer to ``request`` from its choices' ``results`` {index: (completion, metrics, queued_s)}."""
        choices = [
            api_response.choice(
                request, i, c.text, c.finish_reason, c.logprobs, self.tokenizer, streamed=False, first=True
            )
            for i, (c, _, _) in sorted(results.items())
        ]
        return api_response.envelope(
            request, job_id, self.model_name, choices, streamed=False, usage=api_response.usage(request, results)
        )

    def chunk(
        self,
        request: Request,
        job_id: int,
        index: int,
        text: str,
        finish: str | None,
        entries,
        first: bool,
        calls: list[dict] | None = None,
    ) -> dict:
        """One chunk of a streamed answer: choice ``index``'s ``text``, the log-probabilities ``entries``
        and the tool-call deltas ``calls``."""
        piece = api_response.choice(
            request, index, text, finish, entries, self.tokenizer, streamed=True, first=first, calls=calls
        )
        return api_response.envelope(request, job_id, self.model_name, [piece], streamed=True)

    def models(self) -> dict:
        """``GET /v1/models``: the one model served."""
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "hpc-tp",
            "max_model_len": self.max_model_len or self.cfg.max_seq_len,
        }


class _CountingServer(ThreadingHTTPServer):
    """Counts open connections from the moment one is accepted (before its thread starts), so a
    shutdown never misses a request that was already let in."""

    daemon_threads = True
    request_queue_size = 256  # listen backlog: socketserver's default of 5 resets a burst of clients

    def __init__(self, address, handler, app: CompletionServer):
        self.app = app
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        self.app._count(connections=1)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        super().shutdown_request(request)
        self.app._count(connections=-1)


def _handler(app: CompletionServer):
    class Handler(BaseHTTPRequestHandler):
        server_version = "hpc-tp"
        timeout = IDLE_TIMEOUT_S  # on the socket: reads and writes that stall this long fail

        def log_message(self, format, *args):  # one line per request on a busy server is noise
            pass

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/version":
                self._json(200, {"version": __version__})
            elif self.path == "/v1/models":
                self._json(200, app.models())
            elif self.path.startswith("/v1/models/"):
                name = self.path[len("/v1/models/") :]
                if name == app.model_name:
                    self._json(200, app.model_card())
                else:
                    self._error(404, f"model {name!r} is not served here: this server serves {app.model_name!r}")
            elif self.path == "/metrics":
                self._send(200, "text/plain; version=0.0.4", app.metrics.render(app.jobs.qsize()).encode())
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self):
            refusal = app.refusal(self.path)
            if refusal is not None:
                self._error(*refusal)
                return
            body = self._body()
            if body is None:
                return
            try:
                if self.path == TOKENIZE:
                    self._json(
                        200,
                        tokenize(
                            body,
                            app.tokenizer,
                            app.chat_template,
                            app.model_name,
                            app.max_model_len or app.cfg.max_seq_len,
                        ),
                    )
                    return
                if self.path == DETOKENIZE:
                    self._json(200, detokenize(body, app.tokenizer, app.cfg.vocab_size, app.model_name))
                    return
                request = app.parse(self.path, body)
            except UnknownModel as e:
                self._error(404, str(e))
                return
            except ConfigError as e:
                self._error(400, str(e))
                return
            except Exception as e:  # a bug: the client still gets an answer, the log the traceback
                self._error(500, f"internal error: {type(e).__name__}: {e}")
                raise
            if not app.submit(request):
                self._error(503, "the server is stopping: it takes no new requests")
                return
            job_id = next(app._ids)
            try:
                if isinstance(request, EmbeddingJob):
                    self._embed(request)
                else:
                    (self._stream if request.stream else self._answer)(request, job_id)
            except OSError:  # the client went away mid-answer
                request.cancel()
                self.close_connection = True
                return
            finally:
                app.done_with(request)
            app._count(answered=1)

        def _body(self) -> bytes | None:
            """The request's body, or None where it was answered already (too big, unreadable)."""
            length = self.headers.get("Content-Length") or "0"
            if not (length.isascii() and length.isdigit()):
                self._error(400, f"Content-Length {length!r} is not a number of bytes")
                return None
            if int(length) > MAX_BODY_BYTES:
                self._error(413, f"Content-Length {length}: a request body may hold at most {MAX_BODY_BYTES} bytes")
                self._discard(min(int(length), 4 * MAX_BODY_BYTES))
                return None
            try:
                return self.rfile.read(int(length))
            except OSError:  # stalled past the timeout, or gone: nobody to answer
                self.close_connection = True
                return None

        def _embed(self, job: EmbeddingJob):
            event = self._wait(job.events)
            if event[0] == "abort":
                self._error(503, "the server is stopping in a hurry: this request was not finished")
            else:
                self._json(200, embedding_response(job, event[1], app.model_name))

        def _wait(self, events: queue.Queue):
            """The next event of a request answered whole, as long as its client is there."""
            while True:
                try:
                    return events.get(timeout=0.5)
                except queue.Empty:
                    if self._client_gone():
                        raise ConnectionResetError("the client closed the connection") from None

        def _answer(self, request: Request, job_id: int):
            results = {}
            while len(results) < len(request.jobs):
                event = self._wait(request.events)
                if event[0] == "abort":
                    self._error(503, "the server is stopping in a hurry: this request was not finished")
                    return
                if event[0] == "done":
                    results[event[1]] = event[2:]
            self._json(200, app.answer(request, job_id, results))

        def _discard(self, nbytes: int):
            """Read and drop a body that is not wanted, so the client, still sending it, can read the
            answer: closing with unread bytes would reset the connection under it."""
            self.close_connection = True
            try:
                while nbytes > 0 and (chunk := self.rfile.read1(min(nbytes, 2**20))):
                    nbytes -= len(chunk)
            except OSError:  # gone, or stalled past the timeout: nothing more to do for it
                pass

        def _client_gone(self) -> bool:
            """A request is complete once read, so a readable socket now means the peer closed it."""
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            try:
                return not self.connection.recv(1, socket.MSG_PEEK)
            except OSError:
                return True

        def _stream(self, request: Request, job_id: int):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            results, started = {}, set()
            while len(results) < len(request.jobs):
                event = request.events.get()
                if event[0] == "abort":  # each open choice ends here, as what was streamed of it
                    for index in sorted(set(range(len(request.jobs))) - set(results)):
                        self._event(app.chunk(request, job_id, index, "", "abort", None, index not in started))
                    break
                index = event[1]
                if event[0] == "text":
                    text, entries, calls = event[2:]
                    self._event(app.chunk(request, job_id, index, text, None, entries, index not in started, calls))
                else:
                    completion, sent = event[2], request.jobs[index].logprobs_sent
                    rest = None if completion.logprobs is None else completion.logprobs[sent:]  # not streamed yet
                    self._event(
                        app.chunk(request, job_id, index, "", completion.finish_reason, rest, index not in started)
                    )
                    results[index] = event[2:]
                started.add(index)
            if request.include_usage and len(results) == len(request.jobs):
                self._event(
                    api_response.envelope(
                        request, job_id, app.model_name, [], streamed=True, usage=api_response.usage(request, results)
                    )
                )
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _event(self, payload: dict):
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

        def _json(self, status: int, payload: dict):
            self._send(status, "application/json", json.dumps(payload).encode())

        def _send(self, status: int, content_type: str, body: bytes):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str):
            app.metrics.refuse(status)
            self._json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

    return Handler
