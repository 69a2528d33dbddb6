"""The HTTP side of ``hpc-tp serve`` (rank 0 only): parse and check requests, queue them as jobs,
hand queued jobs to the decoding loop (``serve.continuous``), answer each as JSON or as server-sent
events. The endpoints of OpenAI's API that serving a model takes: ``/v1/completions`` continues a
``prompt``; ``/v1/chat/completions`` renders ``messages`` with the model's chat template
(``serve.chat``) and answers with the assistant's ``message`` (streamed as ``delta`` chunks);
``response_format`` holds an answer to JSON, and a chat request's ``tools`` let the model call
functions (``serve.structured``, ``serve.tools``). ``GET /v1/models`` lists the one model served, by
the name requests give as ``model``; ``GET /metrics`` counts what the server did (``serve.metrics``).

Handler threads never touch the model: they turn a request into a ``Job`` (token ids and sampling
parameters) and wait on its event queue, which the decoding loop fills with text pieces and, at
the end, the completion. A request that fails a check is answered 400 with the reason at once. A
client that goes away marks its job cancelled, and the decoding loop frees its row; a connection
that sends nothing for IDLE_TIMEOUT_S is closed, so it cannot hold up a graceful shutdown.
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

from ..errors import ConfigError
from .generate import check_request
from .metrics import ServerMetrics
from .sampling import SamplingParams
from .structured import response_format, vocabulary
from .tools import CallStream, ToolUse, template_messages

_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "model", "n", "user",
           "stream_options", "response_format"}
# Options of OpenAI's API this server does not implement, taken at the values that ask for nothing (clients
# often send them so), refused otherwise: name -> the values that are their default.
_DEFAULT_ONLY = {"presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (None, False),
                 "echo": (False,), "logit_bias": (None, {})}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_OWN_FIELDS = {COMPLETIONS: {"prompt"},
               CHAT: {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls"}}
MAX_BODY_BYTES = 16 * 2**20
IDLE_TIMEOUT_S = 10.0  # a connection that sends (or takes) nothing this long is closed


class UnknownModel(ConfigError):
    """A request for a model this server does not serve (answered 404, as OpenAI's API does)."""


class Job:
    """A request as the decoding loop sees it (``ContinuousBatcher.run``)."""

    def __init__(self, ids: list[int], params: SamplingParams, stream: bool, chat: bool = False,
                 tools: ToolUse | None = None):
        self.ids, self.params, self.stream, self.chat = ids, params, stream, chat
        self.tools = tools  # a chat request's tools: its answer may be calls
        self.calls = CallStream(tools) if tools is not None and stream else None
        self.arrived = time.perf_counter()
        self.events: queue.Queue = queue.Queue()
        self.cancelled = False  # the client went away: nobody reads what is decoded for it
        self.on_finish = None   # the server's count of it, called from the batcher's thread

    def text(self, piece: str):
        if self.calls is not None:
            piece = self.calls.feed(piece)  # text that may still be a call is held back
        if self.stream and piece:
            self.events.put(("text", piece))

    def finish(self, completion, metrics, queued_s: float):
        if self.on_finish is not None:
            self.on_finish(self, completion, queued_s)
        self.events.put(("done", completion, metrics, queued_s))


def parse_request(body: bytes, tokenizer, cfg, default_max_tokens: int, max_model_len: int | None = None,
                  endpoint: str = COMPLETIONS, chat_template=None, model_name: str | None = None) -> Job:
    """A Job for a request to ``endpoint``, or ConfigError with the reason the request is refused.
    ``chat_template`` (a ``serve.chat.ChatTemplate``) renders a chat request's messages; a request
    naming a ``model`` other than ``model_name`` is refused (UnknownModel)."""
    try:
        request = json.loads(body)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"body is not JSON: {e}") from None
    except RecursionError:
        raise ConfigError("body is not JSON this server reads: nested too deeply") from None
    if not isinstance(request, dict):
        raise ConfigError("body must be a JSON object")
    fields = _FIELDS | _OWN_FIELDS[endpoint] | set(_DEFAULT_ONLY)
    unknown = sorted(set(request) - fields)
    if unknown:
        raise ConfigError(f"unknown fields {', '.join(unknown)}; supported: {', '.join(sorted(fields))}")
    for name, defaults in _DEFAULT_ONLY.items():
        value = request.get(name, defaults[0])
        if not any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults):
            raise ConfigError(f"{name}={value!r}: not supported by this server (only "
                              f"{' or '.join(json.dumps(d) for d in defaults)})")
    options = request.get("stream_options") or {}
    if not (isinstance(options, dict) and set(options) <= {"include_usage"}
            and isinstance(options.get("include_usage", True), bool)):
        raise ConfigError(f"stream_options={options!r}: expected {{\"include_usage\": true or false}} "
                          "(usage always comes with the last chunk)")
    if model_name is not None and request.get("model", model_name) != model_name:
        raise UnknownModel(f"model {request['model']!r} is not served here: this server serves {model_name!r}")
    grammar, tools = response_format(request.get("response_format")), None
    if endpoint == CHAT:
        if chat_template is None:
            raise ConfigError("this model has no chat template: its checkpoint carries none, so start hpc-tp serve "
                              "with --chat-template FILE, or use /v1/completions")
        tools = ToolUse.from_request(request)
        if tools is not None and tools.grammar is not None:
            if grammar is not None:
                raise ConfigError(f"tool_choice={tools.choice!r} holds the answer to a call's JSON: "
                                  "it cannot also take a response_format")
            grammar = tools.grammar
        prompt = chat_template.render(template_messages(request.get("messages")),
                                      tools.tools if tools is not None else None)
    else:
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise ConfigError(f"prompt must be a string, got {type(prompt).__name__}")
    if request.get("n", 1) != 1:
        raise ConfigError(f"n={request['n']!r}: only one completion per request is supported")
    stop = request.get("stop") or []
    stream = request.get("stream", False)
    if not isinstance(stream, bool):
        raise ConfigError(f"stream={stream!r}: expected true or false")
    params = SamplingParams(max_new_tokens=request.get("max_completion_tokens",
                                                       request.get("max_tokens", default_max_tokens)),
                            temperature=request.get("temperature", 1.0), top_k=request.get("top_k", 0),
                            top_p=request.get("top_p", 1.0), seed=request.get("seed"),
                            stop=[stop] if isinstance(stop, str) else stop, grammar=grammar)
    if grammar is not None:
        vocabulary(tokenizer)  # built (once) in this handler thread, not in the decoding loop
    ids = tokenizer.encode(prompt)
    check_request(ids, params, cfg, names={"max_new_tokens": "max_tokens"}, max_model_len=max_model_len)
    return Job(ids, params, stream, endpoint == CHAT, tools)


class CompletionServer:
    def __init__(self, host: str, port: int, tokenizer, cfg, default_max_tokens: int, max_model_len: int | None = None,
                 chat_template=None, model_name: str = "hpc-tp"):
        self.tokenizer, self.cfg, self.default_max_tokens = tokenizer, cfg, default_max_tokens
        self.max_model_len, self.chat_template, self.model_name = max_model_len, chat_template, model_name
        self.started = int(time.time())
        self.metrics = ServerMetrics()
        self.jobs: queue.Queue = queue.Queue()
        self.answered = 0
        self._active = 0  # connections accepted and not yet closed
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.httpd = _CountingServer((host, port), _handler(self), self)
        self.host, self.port = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self._thread.start()

    def next_batch(self, limit: int, window: float, timeout: float) -> list[Job]:
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

    def close(self):
        self.httpd.server_close()

    def _count(self, connections: int = 0, answered: int = 0):
        with self._lock:
            self._active += connections
            self.answered += answered

    def response(self, job: Job, job_id: int, completion, metrics, queued_s: float, text: str | None) -> dict:
        usage = {"prompt_tokens": completion.prompt_tokens, "completion_tokens": len(completion.ids),
                 "total_tokens": completion.prompt_tokens + len(completion.ids),
                 "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
                 "time_to_first_token_s": queued_s + completion.ttft_s, "queue_s": queued_s,
                 "decode_tokens_per_s": completion.decode_tokens_per_s, "batch_size": metrics.batch,
                 "kv_cache_bytes_per_rank": metrics.kv_cache_bytes_per_rank}
        return _answer(job, job_id, completion.text if text is None else text, completion.finish_reason,
                       streamed=text is not None, model=self.model_name, usage=usage)

    def models(self) -> dict:
        """``GET /v1/models``: the one model served."""
        card = {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "hpc-tp",
                "max_model_len": self.max_model_len or self.cfg.max_seq_len}
        return {"object": "list", "data": [card]}


def _answer(job: Job, job_id: int, text: str, finish_reason: str | None, streamed: bool, model: str, **extra) -> dict:
    """A whole answer, or one chunk of a streamed one, in the shape of the job's endpoint."""
    if job.chat:
        turn = {"role": "assistant", "content": text}
        if job.tools is not None and finish_reason is not None:  # the answer's calls parsed out of its text
            turn, finish_reason = job.calls.last(finish_reason) if streamed else job.tools.turn(text, finish_reason)
        choice = {"index": 0, "delta" if streamed else "message": turn, "logprobs": None,
                  "finish_reason": finish_reason}
        kind, name = ("chat.completion.chunk" if streamed else "chat.completion"), f"chatcmpl-{job_id}"
    else:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
        kind, name = "text_completion", f"cmpl-{job_id}"
    return {"id": name, "object": kind, "created": int(time.time()), "model": model, "choices": [choice], **extra}


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
            elif self.path == "/v1/models":
                self._json(200, app.models())
            elif self.path == "/metrics":
                self._send(200, "text/plain; version=0.0.4", app.metrics.render(app.jobs.qsize()).encode())
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self):
            if self.path not in _OWN_FIELDS:
                self._error(404, f"no such endpoint: POST {self.path} (use {COMPLETIONS} or {CHAT})")
                return
            length = self.headers.get("Content-Length") or "0"
            if not (length.isascii() and length.isdigit()):
                self._error(400, f"Content-Length {length!r} is not a number of bytes")
                return
            if int(length) > MAX_BODY_BYTES:
                self._error(413, f"Content-Length {length}: a request body may hold at most {MAX_BODY_BYTES} bytes")
                self._discard(min(int(length), 4 * MAX_BODY_BYTES))
                return
            try:
                body = self.rfile.read(int(length))
            except OSError:  # stalled past the timeout, or gone: nobody to answer
                self.close_connection = True
                return
            try:
                job = parse_request(body, app.tokenizer, app.cfg, app.default_max_tokens, app.max_model_len,
                                    self.path, app.chat_template, app.model_name)
            except UnknownModel as e:
                self._error(404, str(e))
                return
            except ConfigError as e:
                self._error(400, str(e))
                return
            except Exception as e:  # a bug: the client still gets an answer, the log the traceback
                self._error(500, f"internal error: {type(e).__name__}: {e}")
                raise
            job_id = next(app._ids)
            job.on_finish = app.metrics.finish
            app.jobs.put(job)
            try:
                (self._stream if job.stream else self._answer)(job, job_id)
            except OSError:  # the client went away mid-answer
                job.cancelled, self.close_connection = True, True
                return
            app._count(answered=1)

        def _answer(self, job: Job, job_id: int):
            while True:
                try:
                    _, completion, metrics, queued_s = job.events.get(timeout=0.5)
                    break
                except queue.Empty:
                    if self._client_gone():
                        raise ConnectionResetError("the client closed the connection")
            self._json(200, app.response(job, job_id, completion, metrics, queued_s, None))

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

        def _stream(self, job: Job, job_id: int):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            while True:
                event = job.events.get()
                if event[0] == "done":
                    break
                self._event(_answer(job, job_id, event[1], None, streamed=True, model=app.model_name))
            _, completion, metrics, queued_s = event
            self._event(app.response(job, job_id, completion, metrics, queued_s, text=""))  # finish reason and usage
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
