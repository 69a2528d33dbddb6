"""`hpc-tp serve` behind LangChain's `ChatOpenAI`, as an application built on the framework drives it:
a turn, a streamed turn and a forced tool call, each as the reference engine answers at tp = 1."""

import functools
import operator

import pytest
from test_openai_client import _chat_text, _reference, server  # noqa: F401 (the module's server fixture)

langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")


def _chat(url, **options):
    return langchain_openai.ChatOpenAI(
        base_url=url + "/v1", api_key="unused", model="ckpt", temperature=0, max_retries=0, timeout=60, **options
    )


def test_a_turn_and_a_streamed_turn_are_the_reference_engines(server):  # noqa: F811
    url, engine = server
    want = _reference(engine, _chat_text([{"role": "user", "content": "hi"}]), max_new_tokens=6)
    answer = _chat(url, max_tokens=6).invoke([("user", "hi")])
    assert answer.content == want.text
    assert answer.response_metadata["finish_reason"] == want.finish_reason
    assert answer.usage_metadata["output_tokens"] == len(want.ids)
    streamed = list(_chat(url, max_tokens=6).stream([("user", "hi")]))
    assert "".join(chunk.content for chunk in streamed) == want.text


def test_a_forced_tool_call_comes_back_as_langchains_tool_calls(server):  # noqa: F811
    url, _ = server
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "a function of one integer",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    }
    chat = _chat(url, max_tokens=20).bind_tools([tool], tool_choice="f")
    whole = chat.invoke([("user", "q")])
    streamed = functools.reduce(operator.add, chat.stream([("user", "q")]))  # the chunks, as LangChain adds them
    for answer in (whole, streamed):
        [call] = answer.tool_calls
        assert call["name"] == "f" and set(call["args"]) == {"n"} and isinstance(call["args"]["n"], int)
    assert whole.tool_calls[0]["args"] == streamed.tool_calls[0]["args"]
