"""Tool calls (``serve.tools``): tools reach a Hugging Face-style chat template with the conversation's
earlier calls and results; the common call formats parse into OpenAI's ``tool_calls``; a named
tool_choice (and "required") holds a random-weight model's answer to a call whose arguments validate,
the same at every tp as with one process; over HTTP, whole and streamed; bad input is one line."""

import json
import threading
import urllib.error
import urllib.request

import jsonschema
import pytest
from test_generate import larger_weights
from test_structured import CFG
from tp_helpers import tp_and_reference

from hpc_tp.errors import ConfigError
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve import api_response
from hpc_tp.serve.chat import ChatTemplate
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.http import CHAT, CompletionServer, parse_request
from hpc_tp.serve.tools import CallStream, ToolUse
from hpc_tp.tokenizer import ByteTokenizer

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["C", "F"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["a", "b"],
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 9},
                    "b": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            },
        },
    },
]
# The shape of Qwen 2.5's template, shortened: tools listed as JSON in the system turn, calls as
# <tool_call> blocks, results as <tool_response> in a user turn.
HERMES = """{% if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}{% for m in messages %}{% if m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}<|im_start|>assistant
"""
ASK = [{"role": "user", "content": "Weather in Paris?"}]
LONG = ModelConfig(**{**CFG.to_dict(), "max_seq_len": 1024})  # for prompts listing the tools in ~650 byte tokens
# Where the model runs: a short prompt, as the grammar (not the prompt) makes the call.
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "


def _request(body: dict, template=HERMES, cfg=LONG):
    return parse_request(
        json.dumps({"messages": ASK, **body}).encode(),
        ByteTokenizer(),
        cfg,
        64,
        endpoint=CHAT,
        chat_template=ChatTemplate(template),
    )


def _job(body: dict, template=HERMES, cfg=LONG):
    return _request(body, template, cfg).jobs[0]


def _tools(choice="auto") -> ToolUse:
    return ToolUse.from_request({"tools": TOOLS, "tool_choice": choice})


def test_tools_and_earlier_calls_reach_the_template():
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    prompt = ChatTemplate(HERMES).render(history, tools=TOOLS)
    listed = prompt.split("<tools>\n")[1].split("</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == TOOLS
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' not in prompt
    )  # OpenAI's arguments are a JSON string: a template prints it quoted...
    job = _job({"tools": TOOLS, "messages": history})
    prompt = ByteTokenizer().decode(job.ids)  # ...so the request hands the template an object
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in prompt
    assert "<tool_response>21 C</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant")
    assert "<tools>" not in ByteTokenizer().decode(_job({}).ids)  # no tools: the template's `if tools` is false


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
            "Let me check.",
            [("get_weather", {"city": "Paris", "unit": "C"})],
        ),
        (
            (
                '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
                '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
            ),
            None,
            [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})],
        ),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',
            None,
            [("add", {"a": 1, "b": 2})],
        ),  # EOS for </...>
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}',
            None,
            [("get_weather", {"city": "Oslo", "unit": "F"})],
        ),  # Llama 3.1
        (
            '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 5, "b": 6}}',
            None,
            [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})],
        ),
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 0, "b": 9}}]', None, [("add", {"a": 0, "b": 9})]),  # Mistral
        (
            '[{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}]',
            None,
            [("get_weather", {"city": "Rome", "unit": "C"})],
        ),  # Mistral's, its marker dropped as a special token
        ('{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),  # not a declared tool
        (
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            [],
        ),  # arguments must be an object
        ("It is sunny.", "It is sunny.", []),
    ],
)
def test_each_call_format_parses_into_openai_tool_calls(text, content, calls):
    message, finish = _tools().turn(text, "stop")
    assert message["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert got == calls and finish == ("tool_calls" if calls else "stop")
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message.get("tool_calls", []))
    assert len({c["id"] for c in message.get("tool_calls", [])}) == len(calls)


def test_tool_choice_none_and_a_cut_forced_call_answer_content():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert _tools("none").turn(call, "stop") == ({"role": "assistant", "content": call}, "stop")
    named = _tools({"type": "function", "function": {"name": "add"}})
    message, finish = named.turn('{"a": 1, "b": 2}', "stop")
    assert message["content"] is None and finish == "tool_calls"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("add", '{"a": 1, "b": 2}')]
    assert named.turn('{"a": 1, "b"', "length") == ({"role": "assistant", "content": '{"a": 1, "b"'}, "length")


def _fed(stream: CallStream, answer: str, step: int = 3) -> tuple[str, list[dict]]:
    """``answer`` fed to ``stream`` ``step`` characters at a time: the content and the call deltas sent."""
    fed = [stream.feed(answer[i : i + step]) for i in range(0, len(answer), step)]
    assert all(len({d["index"] for d in deltas}) == len(deltas) for _, deltas in fed)  # one delta a call a chunk
    return "".join(text for text, _ in fed), [d for _, deltas in fed for d in deltas]


def _assembled(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) of each call, as a client puts OpenAI's streamed tool-call deltas together."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["type"] == "function" and d["index"] == len(calls)
            calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


def test_a_stream_holds_back_what_may_be_a_call_and_streams_the_calls_arguments_in_pieces():
    stream = CallStream(_tools())
    answer = (
        'Checking <weather>.<tool_call>{"name": "add", "arguments": {"a": 1, "b": "}{\\""}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    )
    content, deltas = _fed(stream, answer)
    assert content == "Checking <weather>."  # "<we" was held until it could not begin "<tool_call>"
    assert len(deltas) > 4  # the arguments went out in pieces, as they were written
    assert _assembled(deltas) == [("add", '{"a": 1, "b": "}{\\""}'), ("add", '{"a": 3}')]
    last, finish = stream.last("stop")
    assert finish == "tool_calls" and last["content"] is None and "tool_calls" not in last
    llama = CallStream(_tools())
    assert _fed(llama, '{"name": "add", "parameters": {"a": 1, "b": 2}}', step=5)[1] != []
    forced = CallStream(_tools({"type": "function", "function": {"name": "add"}}))
    content, deltas = _fed(forced, '{"a": 1, "b": 2}', step=2)
    assert content == "" and _assembled(deltas) == [("add", '{"a": 1, "b": 2}')]
    assert forced.last("stop") == ({"role": "assistant", "content": None}, "tool_calls")
    whole = CallStream(_tools())  # keys in another order: recognised only at the end, and sent whole
    assert _fed(whole, '{"arguments": {"a": 1, "b": 2}, "name": "add"}') == ("", [])
    assert whole.last("stop")[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    plain = CallStream(_tools())
    assert plain.feed("Sunny, ")[0] + plain.feed("21 C")[0] == "Sunny, 21 C" and plain.last("stop") == (
        {"role": "assistant", "content": None},
        "stop",
    )
    held = CallStream(_tools())
    assert held.feed("[1, 2]") == ("", []) and held.last("stop") == ({"role": "assistant", "content": "[1, 2]"}, "stop")


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"tools": []}, "tools must be a non-empty list"),
        ({"tools": [{"type": "function"}]}, r"tools\[0\]=.*expected"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, r"tools\[0\].function.name='a b': expected"),
        ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]}, "unknown fields args"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "must be a JSON schema object",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "function names must differ"),
        ({"tool_choice": "auto"}, "tool_choice='auto' needs tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice='always': expected one of none, auto, required"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            r"expected .*one of \['get_weather', 'add'\]",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls='no': expected true or false"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
                "tool_choice": "required",
            },
            "cannot constrain output to this schema: Invalid type: frob",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot also take a response_format",
        ),
        ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\] must be an object with a string role"),
    ],
)
def test_bad_tool_requests_are_refused_in_one_line(body, reason):
    with pytest.raises(ConfigError, match=reason):
        _job(body)


def _schema_of(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.mpi(min_size=1)
def test_a_forced_call_gives_arguments_that_validate_the_same_at_every_tp():
    tp, one = tp_and_reference()
    # (a greedy "required" answer of this random model adds calls past any budget: sampled ones end)
    requests = [
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0}, 1),
        ({"tool_choice": "required", "temperature": 1.0, "seed": 2}, None),
        ({"tool_choice": "required", "temperature": 1.0, "seed": 3}, None),
        ({"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0.8, "seed": 9}, 1),
    ]
    asked = [_request({"tools": TOOLS, "max_tokens": 120, **body}, PLAIN, CFG) for body, _ in requests]
    jobs = [request.jobs[0] for request in asked]
    answers = []
    for comm in (tp, one):
        engine = Engine(larger_weights(GPTModel(CFG, comm, seed=4)), ByteTokenizer())
        answers.append(ContinuousBatcher(engine, 2).generate([j.ids for j in jobs], [j.params for j in jobs]))
    if tp.rank == 0:
        for request, (mine, _), (reference, _), (_, count) in zip(asked, *answers, requests):
            assert mine.ids == reference.ids and mine.finish_reason == "stop"
            answer = api_response.choice(
                request, 0, mine.text, mine.finish_reason, None, ByteTokenizer(), streamed=False, first=True
            )
            calls = answer["message"]["tool_calls"]
            assert answer["finish_reason"] == "tool_calls" and calls and len(calls) == (count or len(calls))
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), _schema_of(call["function"]["name"]))


def _post(port, body):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{CHAT}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class _Serving:
    """An in-process server at tp = 1: the HTTP side in its thread, the batcher in another."""

    def __init__(self):
        engine = Engine(larger_weights(GPTModel(CFG, tp_and_reference()[1], seed=4)), ByteTokenizer())
        self.server = CompletionServer("127.0.0.1", 0, ByteTokenizer(), CFG, 64, chat_template=ChatTemplate(PLAIN))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=ContinuousBatcher(engine, 2).run, args=(self,), daemon=True)
        self.thread.start()

    def take(self, limit, idle):
        if idle and self.stopping.is_set() and not self.server.busy():
            return None
        return self.server.next_batch(limit, 0, timeout=0.05 if idle else 0)

    def close(self):
        self.server.stop_accepting()
        self.stopping.set()
        self.thread.join(timeout=60)
        self.server.close()


def test_over_http_a_forced_call_whole_and_streamed_and_a_bad_schema_400():
    serving = _Serving()
    try:
        forced = {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "add"}},
            "max_tokens": 60,
            "temperature": 0,
        }
        status, body = _post(serving.server.port, forced)
        choice = json.loads(body)["choices"][0]
        assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        whole = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in whole] == ["add"]
        jsonschema.validate(json.loads(whole[0]["function"]["arguments"]), _schema_of("add"))
        status, body = _post(serving.server.port, {**forced, "stream": True})
        chunks = [
            json.loads(line[len("data: ") :])
            for line in body.split("\n\n")
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert status == 200 and "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks) == ""
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or ()]
        [(name, arguments)] = _assembled(deltas)
        assert name == "add" and json.loads(arguments) == json.loads(whole[0]["function"]["arguments"])
        bad = {
            "messages": ASK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}}},
        }
        status, body = _post(serving.server.port, bad)
        assert status == 400 and "Invalid type: frob" in json.loads(body)["error"]["message"]
        status, body = _post(
            serving.server.port,
            {
                "messages": ASK,
                "max_tokens": 100,
                "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}},
            },
        )
        jsonschema.validate(json.loads(json.loads(body)["choices"][0]["message"]["content"]), WEATHER)
    finally:
        serving.close()
