"""Tool calls for ``/v1/chat/completions``: a request's ``tools`` and ``tool_choice`` (OpenAI's shapes)
in, the model's calls parsed back out as OpenAI's ``tool_calls``.

In: the tools go to the model's chat template as Hugging Face's ``apply_chat_template`` passes them
(a ``tools`` variable holding the request's ``{"type": "function", "function": {...}}`` objects); a
conversation's earlier calls and results pass through (assistant messages with ``tool_calls``,
``role: "tool"`` messages), the calls' ``arguments`` turned from OpenAI's JSON strings into the
objects templates print with ``tojson`` (as vLLM does).

Out, by ``tool_choice``:
    "auto"      (the default with tools) the answer is searched for calls in the formats chat models
                are trained to write: Hermes and Qwen's ``<tool_call>{"name", "arguments"}</tool_call>``
                blocks (text around them is the message's content); Mistral's ``[TOOL_CALLS]`` and a
                JSON list of ``{"name", "arguments"}``; Llama 3.1's JSON ``{"name", "parameters"}``
                (after ``<|python_tag|>``, several joined by ";"). Only calls of tools the request
                declares count; anything else is content;
    "none"      the template still sees the tools (the model knows of them, OpenAI's sense), the answer
                is content;
    a function  (``{"type": "function", "function": {"name"}}``) the answer is held by the grammar
                (``serve.structured``) to that function's ``parameters`` schema, and is its arguments;
    "required"  the answer is held to a JSON list of one call or more (one with
                ``parallel_tool_calls: false``), each ``{"name", "arguments"}`` of a declared tool —
                the same list the Mistral format reads. Forcing calls through a grammar of their own,
                not the template's format, works for any model (vLLM does the same).

A message with calls has finish reason "tool_calls". Streamed, text that may still turn out to be a
call is held back: everything for a forced call or an answer that opens with ``{``, ``[`` or a call
marker, else from a ``<tool_call>`` (or what may be its beginning) on; the last chunk carries what
was held as content and the calls as ``delta.tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid

from ..errors import ConfigError
from .structured import Grammar

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)(?:" + re.escape(_HERMES_CLOSE) + r"|$)", re.DOTALL)
# Markers a whole-answer call may start with: Mistral's (when the tokenizer keeps its special tokens
# in decoded text) and Llama 3.1's.
_PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")
_CHOICE_WORDS = ("none", "auto", "required")
# What a call in any of those formats opens with, up to the ``{`` of its arguments: its name first.
_CALL_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class ToolUse:
    """One chat request's tools and tool choice: what its template sees, the grammar a forced call is
    held to, and a whole answer turned into a message with calls (a streamed one: ``CallStream``)."""

    def __init__(self, tools: list[dict], choice, parallel: bool = True):
        self.tools, self.choice = tools, choice
        self.names = [t["function"]["name"] for t in tools]
        self.forced = choice if isinstance(choice, dict) else None
        self.grammar = self._grammar(parallel)

    @classmethod
    def from_request(cls, request: dict) -> ToolUse | None:
        """The request's tool use, None if it has no tools; ConfigError naming a malformed field."""
        tools, choice = request.get("tools"), request.get("tool_choice")
        parallel = request.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ConfigError(f"parallel_tool_calls={parallel!r}: expected true or false")
        if tools is None:
            if choice not in (None, "none"):
                raise ConfigError(f"tool_choice={choice!r} needs tools: the request declares none")
            return None
        if not isinstance(tools, list) or not tools:
            raise ConfigError(
                f'tools must be a non-empty list of {{"type": "function", "function": {{...}}}} objects, got {tools!r}'
            )
        for i, tool in enumerate(tools):
            _check_tool(i, tool)
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) < len(names):
            raise ConfigError(f"tools: function names must differ, got {names}")
        choice = "auto" if choice is None else choice
        named = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if isinstance(choice, dict) and not (
            set(choice) == {"type", "function"}
            and choice["type"] == "function"
            and set(choice["function"]) == {"name"}
            and named in names
        ):
            raise ConfigError(
                f'tool_choice={choice!r}: expected {{"type": "function", "function": {{"name": one of {names}}}}}'
            )
        if not isinstance(choice, dict) and choice not in _CHOICE_WORDS:
            raise ConfigError(
                f"tool_choice={choice!r}: expected one of {', '.join(_CHOICE_WORDS)} or "
                '{"type": "function", "function": {"name": ...}}'
            )
        return cls(tools, choice, parallel)

    def _grammar(self, parallel: bool) -> Grammar | None:
        if self.forced is not None:
            i = self.names.index(self.forced["function"]["name"])
            return Grammar.json_schema(_parameters(self.tools[i]), f"tools[{i}].function.parameters")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _parameters(tool)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, tool in zip(self.names, self.tools)
        ]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return Grammar.json_schema(schema, 'tools (for tool_choice "required")')

    def turn(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """(the assistant's message, the finish reason) for a whole answer ``text``."""
        content, calls = self.parse(text)
        turn = {"role": "assistant", "content": content.strip() or None}
        if calls:
            turn["tool_calls"], finish_reason = calls, "tool_calls"
        return turn, finish_reason

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(content, OpenAI tool calls) of an answer; the calls empty where it holds none."""
        if self.choice == "none":
            return text, []
        if self.forced is not None:
            arguments = _json(text)
            if not isinstance(arguments, dict):  # cut by max_tokens: not a call
                return text, []
            return "", [_call(self.forced["function"]["name"], arguments)]
        hermes = [m.group(1) for m in _HERMES.finditer(text)]
        if hermes:
            calls = [_named_call(_json(block), "arguments", self.names) for block in hermes]
            return (_HERMES.sub("", text), calls) if all(calls) else (text, [])
        body = text.strip()
        for prefix in _PREFIXES:
            body = body.removeprefix(prefix).lstrip()
        whole = _json(body)
        if isinstance(whole, list):  # Mistral's list (and what tool_choice "required" holds answers to)
            calls = [_named_call(c, "arguments", self.names) for c in whole]
        else:  # Llama 3.1: one call, or several joined by ";"
            parts = [whole] if isinstance(whole, dict) else [_json(part) for part in body.split(";")]
            calls = [_named_call(part, "parameters", self.names) for part in parts]
        return ("", calls) if calls and all(calls) else (text, [])

    def may_call(self, text: str) -> bool:
        """Whether an answer beginning with ``text`` may be a call from its start."""
        head = text.lstrip()
        return (
            self.choice != "auto"
            or not head
            or head[0] in "{["
            or any(head.startswith(p) or p.startswith(head) for p in _PREFIXES)
        )


class CallStream:
    """One streamed answer: what it has said so far, how much of that has gone out as content (text
    that may still turn out to be a call is held back), and the calls it has begun. A call goes out as
    OpenAI streams one: its id, type and name once the model has written its name and the ``{`` that
    opens its arguments, then the arguments piece by piece as they are written (the model's own JSON
    text, whitespace and all). A forced call's whole answer is its arguments. The last chunk carries the
    held-back content, and the calls whole where their format was only recognisable at the end."""

    def __init__(self, tools: ToolUse):
        self.tools, self.text, self.sent = tools, "", 0
        self.calls: list[_OpenCall] = []  # the calls begun, in order
        self.searched = 0  # where the search for the next call's header resumes

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """The answer ``piece`` longer: (the part of it that can no longer be a call and has not gone
        out, the tool-call deltas it adds)."""
        self.text += piece
        end = self._streamable()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, self._call_deltas()

    def last(self, finish_reason: str) -> tuple[dict, str]:
        """(the last chunk's delta: what was held back, and the calls not streamed; the finish reason)."""
        content, calls = self.tools.parse(self.text)
        rest = content[self.sent :] if content.startswith(self.text[: self.sent]) else content
        if self.calls:  # they went out as they were written
            delta = {"role": "assistant", "content": (rest or None) if calls else None}
            return delta, "tool_calls" if finish_reason == "stop" else finish_reason
        delta = {"role": "assistant", "content": rest or None}
        if calls:
            delta["tool_calls"], finish_reason = [{"index": i, **c} for i, c in enumerate(calls)], "tool_calls"
        return delta, finish_reason

    def _streamable(self) -> int:
        """How much of the answer so far cannot be, or begin, a call."""
        if self.tools.choice == "none":
            return len(self.text)
        if self.tools.may_call(self.text):
            return 0
        start = self.text.find(_HERMES_OPEN)
        if start >= 0:
            return start
        for k in range(min(len(_HERMES_OPEN) - 1, len(self.text)), 0, -1):
            if self.text.endswith(_HERMES_OPEN[:k]):
                return len(self.text) - k
        return len(self.text)

    def _call_deltas(self) -> list[dict]:
        deltas = []
        while True:
            if self.calls and not self.calls[-1].closed:
                piece = self.calls[-1].more(self.text)
                if deltas and deltas[-1]["index"] == len(self.calls) - 1:  # one delta a call a chunk, as OpenAI's
                    deltas[-1]["function"]["arguments"] += piece
                elif piece:
                    deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
                if not self.calls[-1].closed:
                    return deltas
                self.searched = self.calls[-1].end
            opened = self._next_call()
            if opened is None:
                return deltas
            self.calls.append(opened)
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
            deltas.append({"index": len(self.calls) - 1, **call, "function": {"name": opened.name, "arguments": ""}})

    def _next_call(self) -> _OpenCall | None:
        """The call whose header the unsearched text holds, if it holds one naming a declared tool."""
        if self.tools.choice == "none":
            return None
        if self.tools.forced is not None:
            return None if self.calls or not self.text.lstrip() else _OpenCall(self.tools.forced["function"]["name"], 0)
        header = _CALL_HEADER.search(self.text, self.searched)
        if header is None or header.group(1) not in self.tools.names or header.start() < self.sent:
            return None
        return _OpenCall(header.group(1), header.end())


class _OpenCall:
    """A streamed call's arguments: an object starting at ``start`` in the answer, sent up to ``end``;
    ``closed`` once its closing brace is sent."""

    def __init__(self, name: str, start: int):
        self.name, self.start, self.end, self.closed = name, start, start, False

    def more(self, text: str) -> str:
        """The arguments' text written since the last call, up to their closing brace."""
        close = _object_end(text, self.start)
        stop = len(text) if close is None else close
        piece, self.end, self.closed = text[self.end : stop], stop, close is not None
        return piece


def _object_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that begins (after whitespace) at ``start``, if it is an object
    or array written to its end; None while it is still open."""
    depth, quoted, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if quoted:
            escaped, quoted = (not escaped and c == "\\"), quoted and (escaped or c != '"')
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def template_messages(messages):
    """``messages`` as chat templates read them: an assistant's earlier calls with their ``arguments``
    as objects, not OpenAI's JSON strings. Anything malformed is left for ``ChatTemplate.render`` to
    refuse."""
    if not isinstance(messages, list):
        return messages
    return [_template_message(m) for m in messages]


def _template_message(message):
    if not (isinstance(message, dict) and isinstance(message.get("tool_calls"), list)):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            arguments = _json(function["arguments"])
            call = {
                **call,
                "function": {**function, "arguments": arguments if arguments is not None else function["arguments"]},
            }
        calls.append(call)
    return {**message, "tool_calls": calls}


def _check_tool(i: int, tool):
    function = tool.get("function") if isinstance(tool, dict) else None
    if not (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and set(tool) == {"type", "function"}
        and isinstance(function, dict)
    ):
        raise ConfigError(
            f'tools[{i}]={tool!r}: expected {{"type": "function", "function": {{"name", "description", "parameters"}}}}'
        )
    name = function.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ConfigError(f"tools[{i}].function.name={name!r}: expected 1 to 64 letters, digits, '_' or '-'")
    extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if extra:
        raise ConfigError(f"tools[{i}].function: unknown fields {', '.join(extra)}")
    if not isinstance(function.get("parameters", {}), dict):
        raise ConfigError(f"tools[{i}].function.parameters must be a JSON schema object")


def _parameters(tool: dict) -> dict:
    """A function's arguments schema; a function declaring none takes any object (OpenAI's reading)."""
    return tool["function"].get("parameters") or {"type": "object"}


def _json(text: str):
    """The JSON value ``text`` holds (surrounding whitespace aside), or None."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _named_call(value, arguments_key: str, names: list[str]) -> dict | None:
    """An OpenAI call from a parsed ``{"name", arguments_key}`` object naming one of ``names``; None
    for anything else."""
    if not (isinstance(value, dict) and value.get("name") in names):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    return _call(value["name"], arguments) if isinstance(arguments, dict) else None


def _call(name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
