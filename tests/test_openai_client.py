"""`hpc-tp serve` driven by the official OpenAI client, as applications and frameworks drive it: every
option and input shape they send, sync and async, each answer the same as the reference engine's at
tp = 1 and accepted by the client's own pydantic models; and vLLM's /tokenize and /detokenize."""

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_generate import _model, write_checkpoint
from test_serve import serving

from hpc_tp.comm.mpi import self_comm
from hpc_tp.grid import ProcessGrid
from hpc_tp.serve.chat import ChatTemplate
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}a:"
MAX_MODEL_LEN = 31


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, reference engine) of a server at tp = 2 for the module's tests."""
    folder = tmp_path_factory.mktemp("openai")
    ckpt = write_checkpoint(folder / "ckpt", "llama-gqa", ProcessGrid(tp=1, world=self_comm()), ByteTokenizer())
    (folder / "chat.jinja").write_text(TEMPLATE)
    with serving(
        "--ckpt",
        str(ckpt),
        "--dtype",
        "float64",
        "--max-batch",
        "6",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--chat-template",
        str(folder / "chat.jinja"),
    ) as served:
        yield f"http://127.0.0.1:{served.port}", Engine(_model("llama-gqa", self_comm()), ByteTokenizer())


def _client(url, cls=openai.OpenAI):
    return cls(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(engine, prompt: str | list[int], **params):
    completions, _ = engine.generate(
        [list(prompt.encode()) if isinstance(prompt, str) else prompt], [SamplingParams(**params)]
    )
    return completions[0]


def _raw(call, model):
    """The answer of ``call`` (a ``with_raw_response`` method) checked by the client's own ``model``."""
    return model.model_validate(call().http_response.json())


def _chat_text(messages) -> str:
    """The prompt the server makes of ``messages`` (its template's rendering: tests/test_chat.py)."""
    return ChatTemplate(TEMPLATE).render(messages)


def test_models_are_listed_and_retrieved_by_name_and_others_are_404(server):
    url, _ = server
    client = _client(url)
    assert [m.id for m in client.models.list()] == ["ckpt"]
    assert _raw(lambda: client.models.with_raw_response.retrieve("ckpt"), Model).id == "ckpt"
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served here"):
        client.models.retrieve("gpt-4")


def test_prompts_as_text_lists_and_token_ids_with_n_choices_and_echo(server):
    url, engine = server
    client = _client(url)
    prompts = ["alpha: ", "be"]
    answer = _raw(
        lambda: client.completions.with_raw_response.create(
            model="ckpt", prompt=prompts, n=2, max_tokens=5, temperature=0, echo=True
        ),
        Completion,
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for choice in answer.choices:
        prompt = prompts[choice.index // 2]
        want = _reference(engine, prompt, max_new_tokens=5)
        assert (choice.text, choice.finish_reason) == (prompt + want.text, want.finish_reason)
    assert answer.usage.prompt_tokens == sum(len(p) for p in prompts)
    streamed, finishes = {}, {}
    for chunk in client.completions.create(
        model="ckpt", prompt=prompts, n=2, max_tokens=5, temperature=0, echo=True, stream=True
    ):
        [piece] = chunk.choices  # one choice a chunk, the choices interleaved
        streamed[piece.index] = streamed.get(piece.index, "") + piece.text
        finishes[piece.index] = piece.finish_reason
    assert streamed == {c.index: c.text for c in answer.choices}
    assert finishes == {c.index: c.finish_reason for c in answer.choices}
    ids = [list(b"token "), list(b"ids")]
    by_ids = client.completions.create(model="ckpt", prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [_reference(engine, p, max_new_tokens=4).text for p in ids]
    one = client.completions.create(model="ckpt", prompt=ids[0], max_tokens=None, temperature=0)
    assert one.usage.completion_tokens == len(_reference(engine, ids[0], max_new_tokens=16).ids)  # null: the default


def test_penalties_min_p_ignore_eos_and_seed_as_the_reference_samples_them(server):
    url, engine = server
    client = _client(url)
    options = dict(presence_penalty=0.7, frequency_penalty=0.4)
    extra = dict(repetition_penalty=1.3, min_p=0.05, top_k=0, ignore_eos=True)
    answer = client.completions.create(
        model="ckpt", prompt="UUUU", max_tokens=9, temperature=0, **options, extra_body=extra
    )
    want = _reference(engine, "UUUU", max_new_tokens=9, **options, **extra)
    assert (answer.choices[0].text, answer.usage.completion_tokens) == (want.text, 9) and want.finish_reason == "length"
    plain = _reference(engine, "UUUU", max_new_tokens=9)
    assert want.ids != plain.ids  # the penalties changed the greedy choices
    sampled = [
        client.completions.create(
            model="ckpt", prompt="seed ", max_tokens=8, temperature=1.0, seed=11, extra_body={"min_p": 0.1}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert (
        sampled[0]
        == sampled[1]
        == _reference(engine, "seed ", max_new_tokens=8, temperature=1.0, seed=11, min_p=0.1).text
    )


def test_logprobs_of_completions_and_chats_are_the_models(server):
    url, engine = server
    client = _client(url)
    answer = _raw(
        lambda: client.completions.with_raw_response.create(
            model="ckpt", prompt="log ", max_tokens=6, temperature=0, logprobs=3
        ),
        Completion,
    )
    want = _reference(engine, "log ", max_new_tokens=6, logprobs=3)
    got = answer.choices[0].logprobs
    np.testing.assert_allclose(got.token_logprobs, [e.logprob for e in want.logprobs], rtol=0, atol=1e-9)
    assert got.text_offset == [e.text_offset for e in want.logprobs] and all(len(t) == 3 for t in got.top_logprobs)
    assert got.tokens[0] == bytes([want.ids[0]]).decode("utf-8", "replace") or got.tokens[0].startswith("bytes:")
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    chat = _raw(
        lambda: client.chat.completions.with_raw_response.create(
            model="ckpt", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
        ),
        ChatCompletion,
    )
    want = _reference(engine, _chat_text(messages), max_new_tokens=5, logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.bytes for c in content] == [[i] for i in want.ids]
    np.testing.assert_allclose([c.logprob for c in content], [e.logprob for e in want.logprobs], rtol=0, atol=1e-9)
    assert [[t.bytes[0] for t in c.top_logprobs] for c in content] == [[t for t, _ in e.top] for e in want.logprobs]


def test_a_chat_with_parts_a_tool_turn_and_null_content_streams_as_openai_streams(server):
    url, engine = server
    client = _client(url)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    want = _reference(engine, _chat_text(messages), max_new_tokens=6)
    for include_usage in (True, False):
        raw = client.chat.completions.with_raw_response.create(
            model="ckpt",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": include_usage},
        )
        body = raw.http_response.read().decode()
        events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
        if include_usage:  # its own last chunk, with no choices; null on every other
            usage = chunks.pop()
            assert usage.choices == [] and usage.usage.completion_tokens == len(want.ids)
            assert all("usage" in json.loads(e) and json.loads(e)["usage"] is None for e in events[:-2])
        else:
            assert all("usage" not in json.loads(e) for e in events[:-1])
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.choices[0].delta.role is None for c in chunks[1:])
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_forced_call_streams_its_arguments_in_pieces_the_clients_stream_helper_assembles(server):
    url, _ = server
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    }
    with _client(url).chat.completions.stream(
        model="ckpt",
        messages=[{"role": "user", "content": "q"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "f"}},
        max_tokens=20,
        temperature=0,
    ) as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    [call] = final.message.tool_calls
    assert call.function.name == "f" and call.function.arguments == "".join(pieces) and len(pieces) > 1
    if final.finish_reason == "tool_calls":  # not cut by max_tokens: the arguments are the schema's object
        assert set(json.loads(call.function.arguments)) == {"n"}


def test_sixteen_concurrent_async_streams_each_equal_the_request_alone(server):
    url, engine = server
    prompts = [f"chat {i}: " + "z" * (i % 4) for i in range(16)]

    async def chat(client, prompt):
        stream = await client.chat.completions.create(
            model="ckpt", messages=[{"role": "user", "content": prompt}], max_tokens=5, temperature=0, stream=True
        )
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def all_at_once():
        async with _client(url, openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(chat(client, p) for p in prompts))

    answers = asyncio.run(all_at_once())
    for prompt, got in zip(prompts, answers):
        want = _reference(engine, _chat_text([{"role": "user", "content": prompt}]), max_new_tokens=5)
        assert got == (want.text, want.finish_reason), prompt


def _call(url, path, body=None):
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_version_health_and_a_prompt_too_long(server):
    url, _ = server
    assert _call(url, "/tokenize", {"prompt": "héllo"}) == (
        200,
        {"tokens": list("héllo".encode()), "count": 6, "max_model_len": MAX_MODEL_LEN},
    )
    messages = [{"role": "user", "content": "hi"}]
    status, rendered = _call(url, "/tokenize", {"model": "ckpt", "messages": messages})
    assert status == 200 and rendered["tokens"] == list(_chat_text(messages).encode())
    assert _call(url, "/detokenize", {"tokens": list("héllo".encode())}) == (200, {"prompt": "héllo"})
    status, refused = _call(url, "/detokenize", {"tokens": [1, 999]})
    assert status == 400 and "token ids in [0, 258)" in refused["error"]["message"]
    assert _call(url, "/tokenize", {"text": "x"})[0] == 400
    status, version = _call(url, "/version")
    assert status == 200 and version["version"]
    assert _call(url, "/health") == (200, {"status": "ok"})
    with pytest.raises(openai.BadRequestError, match="this server takes 31 \\(--max-model-len\\)"):
        _client(url).completions.create(model="ckpt", prompt="x" * 30, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings needs an encoder \\(BERT\\) checkpoint"):
        _client(url).embeddings.create(model="ckpt", input="x")
