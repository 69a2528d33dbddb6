"""OpenAI API requests to jobs: a body checked and turned into one ``Job`` per choice to decode.

``/v1/completions`` takes ``prompt`` as a string, a list of strings, a list of token ids or a list of
such lists: each prompt is ``n`` choices, numbered prompt by prompt (OpenAI's ``index``).
``/v1/chat/completions`` takes ``messages``, rendered by the chat template (``serve.chat``), and ``n``.
Sampling options: ``max_tokens`` (``max_completion_tokens`` for chat; null or absent: 16 for a
completion, as OpenAI's default, and the rest of the context for a chat), ``temperature``, ``top_p``,
``top_k`` (0 or -1: no limit), ``min_p``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``seed`` (choice j of n samples with ``seed + j``), ``stop``, ``ignore_eos``. Outputs: ``logprobs`` (an
integer for completions: alternatives per token; ``true`` with ``top_logprobs`` for chat), ``echo``
(completions: the prompt before the completion), ``stream`` with ``stream_options.include_usage``.
Constraints: ``response_format`` (``json_object``, ``json_schema``: ``serve.structured``) and, for chat,
``tools`` with ``tool_choice`` and ``parallel_tool_calls`` (``serve.tools``).

Anything else is refused in one line (``ConfigError``), as is an option this server does not do at a
value that asks for it (``logit_bias``).
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, replace

from ..errors import ConfigError
from .generate import check_request
from .sampling import SamplingParams
from .structured import response_format, vocabulary
from .tools import CallStream, ToolUse, template_messages

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": None,
    "ignore_eos": False,
}
_FIELDS = {
    "max_tokens",
    "stop",
    "stream",
    "model",
    "n",
    "user",
    "stream_options",
    "logprobs",
    "response_format",
    *_SAMPLING,
}
# Options of OpenAI's API this server does not implement, taken at the values that ask for nothing (clients
# often send them so), refused otherwise: name -> the values that are their default.
_DEFAULT_ONLY = {"logit_bias": (None, {})}
_OWN_FIELDS = {
    COMPLETIONS: {"prompt", "echo"},
    CHAT: {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"},
}
MAX_CHOICES = 128  # n x prompts: jobs one request may queue
# The API's names of SamplingParams fields, for the errors (a chat's limit: by the name the request used)
_NAMES = {
    COMPLETIONS: {"max_new_tokens": "max_tokens"},
    CHAT: {"max_new_tokens": "max_tokens", "logprobs": "top_logprobs"},
}


class UnknownModel(ConfigError):
    """A request for a model this server does not serve (answered 404, as OpenAI's API does)."""


class Job:
    """One choice as the decoding loop sees it (``ContinuousBatcher.run``): its events go to the
    request's queue, tagged with its ``index``."""

    def __init__(
        self,
        ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        index: int = 0,
        events: queue.Queue | None = None,
        tools: ToolUse | None = None,
    ):
        self.ids, self.params, self.stream, self.index = ids, params, stream, index
        self.calls = CallStream(tools) if tools is not None and stream else None  # this choice's streamed calls
        self.arrived = time.perf_counter()
        self.events: queue.Queue = queue.Queue() if events is None else events
        self.cancelled = False  # the client went away: nobody reads what is decoded for it
        self.on_finish = None  # the server's count of it, called from the batcher's thread
        self.logprobs_sent = 0  # of the row's log-probabilities, those streamed so far

    def text(self, piece: str, logprobs=None):
        """Text that became final, and the row's log-probabilities so far (a list that grows)."""
        calls = None
        if self.calls is not None:  # text that may still be a tool call is held back, calls go out as deltas
            piece, calls = self.calls.feed(piece)
        if self.stream and (piece or calls):
            new = logprobs[self.logprobs_sent :] if logprobs is not None else None
            self.logprobs_sent += len(new or ())
            self.events.put(("text", self.index, piece, new, calls))

    def finish(self, completion, metrics, queued_s: float):
        if self.on_finish is not None:
            self.on_finish(self, completion, queued_s)
        self.events.put(("done", self.index, completion, metrics, queued_s))


@dataclass(eq=False)  # each one its own: the server keeps a set of those it answers
class Request:
    """A parsed request: its jobs (one per choice, in ``index`` order) sharing one event queue."""

    jobs: list[Job]
    events: queue.Queue
    chat: bool
    stream: bool
    include_usage: bool  # streamed: usage in a last chunk of its own
    echo: list[str] | None  # completions with echo: each prompt's text (ids decoded), by prompt
    n: int  # choices per prompt
    tools: ToolUse | None = None  # a chat's tools: its answers may be calls

    def cancel(self):
        for job in self.jobs:
            job.cancelled = True

    def abort(self):
        """The server stops in a hurry (``serve.shutdown``): its jobs are dropped and its answer ends now."""
        self.cancel()
        self.events.put(("abort",))


def parse_request(
    body: bytes,
    tokenizer,
    cfg,
    default_max_tokens: int,
    max_model_len: int | None = None,
    endpoint: str = COMPLETIONS,
    chat_template=None,
    model_name: str | None = None,
    kv_tokens: int | None = None,
) -> Request:
    """The Request for a body sent to ``endpoint``, or ConfigError with the reason it is refused.
        ``chat_template`` (a ``serve.chat.ChatTemplate``) renders a chat request's messages; a request
        naming a ``model`` other than ``model_name`` is refused (UnknownModel), and one whose prompt and
    tokens the whole KV cache cannot hold (``kv_tokens``, continuous batching's) with the reason."""
    request = read_body(body)
    fields = _FIELDS | _OWN_FIELDS[endpoint] | set(_DEFAULT_ONLY)
    unknown = sorted(set(request) - fields)
    if unknown:
        raise ConfigError(f"unknown fields {', '.join(unknown)}; supported: {', '.join(sorted(fields))}")
    for name, defaults in _DEFAULT_ONLY.items():
        value = request.get(name, defaults[0])
        if value not in defaults:
            raise ConfigError(
                f"{name}={value!r}: not supported by this server (only {' or '.join(json.dumps(d) for d in defaults)})"
            )
    check_model(request, model_name)
    stream = _flag(request, "stream")
    options = request.get("stream_options") or {}
    if not (
        isinstance(options, dict)
        and set(options) <= {"include_usage"}
        and isinstance(options.get("include_usage", False), bool)
    ):
        raise ConfigError(f'stream_options={options!r}: expected {{"include_usage": true or false}}')
    n = 1 if request.get("n") is None else request["n"]
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ConfigError(f"n={n!r}: expected an integer >= 1")
    grammar, tools = response_format(request.get("response_format")), None
    if endpoint == CHAT:
        tools = ToolUse.from_request(request)
        if tools is not None and tools.grammar is not None:
            if grammar is not None:
                raise ConfigError(
                    f"tool_choice={tools.choice!r} holds the answer to a call's JSON: "
                    "it cannot also take a response_format"
                )
            grammar = tools.grammar
        prompts = [tokenizer.encode(render_messages(request, chat_template, tools))]
        logprobs = _chat_logprobs(request)
        limit = request.get("max_completion_tokens", request.get("max_tokens"))
        echo = None
    else:
        prompts = _prompts(request.get("prompt"), tokenizer)
        logprobs = request.get("logprobs")
        limit = request.get("max_tokens")
        echo = _flag(request, "echo")
        if echo and logprobs is not None:
            raise ConfigError(
                f"echo with logprobs={logprobs!r}: the prompt's log-probabilities are not computed "
                "by this server (ask for one or the other)"
            )
    if len(prompts) * n > MAX_CHOICES:
        raise ConfigError(f"{len(prompts)} prompts x n={n}: at most {MAX_CHOICES} choices a request")
    stop = request.get("stop") or []
    # null is the default, as absent; a processor for a constraint (a grammar's mask) joins params.processors
    params = SamplingParams(
        max_new_tokens=limit,
        stop=[stop] if isinstance(stop, str) else stop,
        logprobs=logprobs,
        grammar=grammar,
        **{k: v if request.get(k) is None else request[k] for k, v in _SAMPLING.items()},
    )
    if grammar is not None:
        vocabulary(tokenizer)  # built (once) in this handler thread, not in the decoding loop
    if params.top_k == -1:  # vLLM's "no limit", which its clients send
        params.top_k = 0
    names = dict(
        _NAMES[endpoint],
        **({"max_new_tokens": "max_completion_tokens"} if request.get("max_completion_tokens") is not None else {}),
    )
    events, jobs = queue.Queue(), []
    for ids in prompts:
        own = (
            params
            if limit is not None
            else replace(
                params,
                max_new_tokens=_default_limit(endpoint, ids, default_max_tokens, max_model_len or cfg.max_seq_len),
            )
        )
        check_request(ids, own, cfg, names=names, max_model_len=max_model_len, kv_tokens=kv_tokens)
        for j in range(n):
            seeded = own if j == 0 or own.seed is None else replace(own, seed=own.seed + j)
            jobs.append(Job(ids, seeded, stream, len(jobs), events, tools))
    echoed = [tokenizer.decode(ids) for ids in prompts] if echo else None  # ids checked: all in the vocabulary
    return Request(
        jobs, events, endpoint == CHAT, stream, stream and options.get("include_usage", False), echoed, n, tools
    )


def read_body(body: bytes) -> dict:
    """A request body's JSON object, or ConfigError saying why it is not one."""
    try:
        request = json.loads(body)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"body is not JSON: {e}") from None
    except RecursionError:
        raise ConfigError("body is not JSON this server reads: nested too deeply") from None
    if not isinstance(request, dict):
        raise ConfigError("body must be a JSON object")
    return request


def check_model(request: dict, model_name: str | None):
    if model_name is not None and request.get("model", model_name) != model_name:
        raise UnknownModel(f"model {request['model']!r} is not served here: this server serves {model_name!r}")


def render_messages(request: dict, chat_template, tools: ToolUse | None = None) -> str:
    """A chat request's messages (earlier tool calls' arguments as objects) and its ``tools`` as the
    prompt text its template makes of them."""
    if chat_template is None:
        raise ConfigError(
            "this model has no chat template: its checkpoint carries none, so start hpc-tp serve "
            "with --chat-template FILE, or use /v1/completions"
        )
    return chat_template.render(
        template_messages(request.get("messages")), tools=tools.tools if tools is not None else None
    )


def _flag(request: dict, name: str) -> bool:
    value = request.get(name, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: expected true or false")
    return value


def _chat_logprobs(request: dict) -> int | None:
    """SamplingParams.logprobs of a chat request: None without ``logprobs: true``, else ``top_logprobs``."""
    asked, top = request.get("logprobs") or False, request.get("top_logprobs")
    if not isinstance(asked, bool):
        raise ConfigError(
            f"logprobs={asked!r}: expected true or false (and top_logprobs, an integer, for alternatives)"
        )
    if top is not None and not asked:
        raise ConfigError(f"top_logprobs={top!r} needs logprobs=true")
    if not asked:
        return None
    if top is not None and not (isinstance(top, int) and not isinstance(top, bool)):
        raise ConfigError(f"top_logprobs={top!r}: expected an integer in [0, 20]")
    return top or 0


def _prompts(prompt, tokenizer) -> list[list[int]]:
    """A completion request's prompts as token ids, whichever way ``prompt`` gives them."""

    def ids(value) -> bool:
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        )

    if isinstance(prompt, str):
        given = [prompt]
    elif ids(prompt):
        given = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        given = prompt
    else:
        got = json.dumps(prompt)[:40] if prompt is not None else "none"
        raise ConfigError(
            f"prompt must be a string, a list of strings, a list of token ids or a list of such lists; got {got}"
        )
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in given]


def _default_limit(endpoint: str, ids: list[int], default_max_tokens: int, max_len: int) -> int:
    """``max_tokens`` absent or null: OpenAI's 16 for a completion; for a chat, what the context leaves
    (at least 1, so that a prompt too long is named as such)."""
    return default_max_tokens if endpoint == COMPLETIONS else max(max_len - len(ids) + 1, 1)
