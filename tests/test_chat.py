"""Chat templates (``serve.chat``) and ``/v1/chat/completions`` requests (``serve.api_request``):
messages rendered as Hugging Face renders them, in Jinja's sandbox; every refusal one clear line."""

import json

import pytest

from hpc_tp.errors import ConfigError
from hpc_tp.models.config import ModelConfig
from hpc_tp.serve.api_request import CHAT, COMPLETIONS, parse_request
from hpc_tp.serve.chat import ChatTemplate
from hpc_tp.tokenizer import ByteTokenizer

# the shape of Llama 3's template, shortened: the bos token, a header per turn, the assistant's opened
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
STRICT = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{{ m['content'] }}|{% endfor %}"
)
HELLO = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}]
CFG = ModelConfig(vocab_size=258, hidden=32, n_layers=1, n_heads=4, max_seq_len=256)


def test_messages_render_with_the_special_tokens_and_the_assistants_turn_opened():
    text = ChatTemplate(LLAMA3, bos_token="<|begin_of_text|>").render(HELLO)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize(
    "messages, reason",
    [
        ("Hi", "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        ([{"role": "user", "content": "Hi"}, {"role": "user"}], "messages[1] must be an object with a string role"),
        ([{"role": "user", "content": 3}], "messages[0] must be an object with a string role and a content"),
        (
            [{"role": "user", "content": ["parts"]}],
            'messages[0].content[0]: "parts" is not supported; expected a text part',
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]: type 'image_url' is not supported",
        ),
        ([{"role": "assistant", "content": "Hi"}], "refused these messages: roles must alternate user/assistant"),
    ],
)
def test_messages_a_template_cannot_take_are_refused_in_one_line(messages, reason):
    with pytest.raises(ConfigError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        ChatTemplate(STRICT).render(messages)


def test_a_template_runs_sandboxed_and_a_broken_one_is_named():
    with pytest.raises(ConfigError, match="refused these messages: .*unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(HELLO)
    with pytest.raises(ConfigError, match="--chat-template t.jinja: not a Jinja template: .*line 1"):
        ChatTemplate("{% for m in messages %}", origin="--chat-template t.jinja")


def test_a_chat_request_is_its_rendered_prompt_with_the_same_sampling():
    template = ChatTemplate(LLAMA3, bos_token="<s>")
    body = json.dumps({"messages": HELLO, "max_completion_tokens": 5, "temperature": 0, "stream": True}).encode()
    request = parse_request(body, ByteTokenizer(), CFG, 16, endpoint=CHAT, chat_template=template)
    [job] = request.jobs
    assert request.chat and request.stream and job.params.max_new_tokens == 5 and job.params.temperature == 0
    assert job.ids == ByteTokenizer().encode(template.render(HELLO))
    plain = parse_request(json.dumps({"prompt": "Hi"}).encode(), ByteTokenizer(), CFG, 16)
    assert not plain.chat and plain.jobs[0].params.max_new_tokens == 16


@pytest.mark.parametrize(
    "endpoint, body, reason",
    [
        (CHAT, {"messages": HELLO}, "this model has no chat template: .*--chat-template FILE"),
        (CHAT, {"prompt": "Hi"}, "unknown fields prompt; supported: .*messages"),
        (COMPLETIONS, {"messages": HELLO}, "unknown fields messages; supported: .*prompt"),
    ],
)
def test_a_request_the_endpoint_cannot_take_is_refused(endpoint, body, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_request(json.dumps(body).encode(), ByteTokenizer(), CFG, 16, endpoint=endpoint)


def test_message_content_as_text_parts_or_null_and_a_tool_turn_reach_the_template():
    """OpenAI clients send content as a list of text parts, an assistant turn that only called a tool
    with content null, and the tool's answer as a message of role "tool": the template sees strings."""
    template = ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}={{ m['content'] }}"
        "{% if m['tool_call_id'] is defined %}#{{ m['tool_call_id'] }}{% endif %};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert template.render(messages) == "user=a\nb;assistant=;tool=42#c1;"


def test_what_clients_send_is_taken_and_what_is_out_of_range_refused():
    """Sampling options, outputs and limits OpenAI clients send (null where unset) become the jobs'
    parameters; a value out of range is a one-line refusal naming it."""
    body = {
        "prompt": "Hi",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "ignore_eos": True,
        "logprobs": 3,
        "seed": 7,
        "n": 2,
        "max_tokens": None,
        "top_p": None,
        "top_k": -1,
        "logit_bias": {},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = parse_request(json.dumps(body).encode(), ByteTokenizer(), CFG, 16)
    assert request.stream and request.include_usage and request.n == 2 and [j.index for j in request.jobs] == [0, 1]
    first, second = (job.params for job in request.jobs)
    assert (first.presence_penalty, first.frequency_penalty, first.repetition_penalty, first.min_p) == (
        0.5,
        -0.25,
        1.1,
        0.05,
    )
    assert first.ignore_eos and first.logprobs == 3 and first.max_new_tokens == 16 and first.top_p == 1.0
    assert first.top_k == 0  # vLLM's -1: no limit
    assert (first.seed, second.seed) == (7, 8)  # n choices sample apart, each reproducible
    chat = {"messages": HELLO, "logprobs": True, "top_logprobs": 2, "max_completion_tokens": None}
    [job] = parse_request(
        json.dumps(chat).encode(), ByteTokenizer(), CFG, 16, endpoint=CHAT, chat_template=ChatTemplate(LLAMA3)
    ).jobs
    assert job.params.logprobs == 2 and job.params.max_new_tokens == CFG.max_seq_len - len(job.ids) + 1
    for field, value, reason in (
        ("presence_penalty", 2.5, r"presence_penalty=2.5: expected a number in \[-2, 2\]"),
        ("logprobs", 21, r"logprobs=21: expected an integer in \[0, 20\]"),
        ("min_p", -0.1, "min_p=-0.1: expected a number in"),
        ("repetition_penalty", 0, "repetition_penalty=0: expected a number > 0"),
        ("ignore_eos", "yes", "ignore_eos='yes': expected true or false"),
        ("echo", 1, "echo=1: expected true or false"),
        ("n", 0, "n=0: expected an integer >= 1"),
        ("logit_bias", {"1": 5}, "logit_bias=.*not supported"),
        ("stream_options", {"include_usage": "yes"}, "stream_options="),
    ):
        with pytest.raises(ConfigError, match=reason):
            parse_request(json.dumps({"prompt": "Hi", field: value}).encode(), ByteTokenizer(), CFG, 16)
    with pytest.raises(ConfigError, match="echo with logprobs=1: the prompt's log-probabilities are not computed"):
        parse_request(json.dumps({"prompt": "Hi", "echo": True, "logprobs": 1}).encode(), ByteTokenizer(), CFG, 16)
    with pytest.raises(ConfigError, match=r"top_logprobs=21: expected an integer in \[0, 20\]"):
        parse_request(
            json.dumps({"messages": HELLO, "logprobs": True, "top_logprobs": 21}).encode(),
            ByteTokenizer(),
            CFG,
            16,
            endpoint=CHAT,
            chat_template=ChatTemplate(LLAMA3),
        )
    with pytest.raises(ConfigError, match="top_logprobs=2 needs logprobs=true"):
        parse_request(
            json.dumps({"messages": HELLO, "top_logprobs": 2}).encode(),
            ByteTokenizer(),
            CFG,
            16,
            endpoint=CHAT,
            chat_template=ChatTemplate(LLAMA3),
        )


@pytest.mark.parametrize(
    "prompt, ids",
    [
        ("ab", [[97, 98]]),
        (["ab", "c"], [[97, 98], [99]]),
        ([97, 98], [[97, 98]]),
        ([[97], [98, 99]], [[97], [98, 99]]),
    ],
)
def test_a_prompt_is_text_or_token_ids_or_a_list_of_either(prompt, ids):
    request = parse_request(json.dumps({"prompt": prompt, "n": 2, "echo": True}).encode(), ByteTokenizer(), CFG, 16)
    assert [job.ids for job in request.jobs] == [p for p in ids for _ in range(2)]
    assert request.echo == [bytes(p).decode() for p in ids]


@pytest.mark.parametrize(
    "prompt, reason",
    [
        ([], "prompt must be a string, a list of strings, a list of token ids or a list of such lists; got \\[\\]"),
        ([[1], "a", 2], "prompt must be a string"),
        (None, "got none"),
        ([300], "prompt token id 300 is outside the model's vocabulary of 258"),
    ],
)
def test_a_prompt_of_another_shape_is_refused(prompt, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_request(json.dumps({"prompt": prompt}).encode(), ByteTokenizer(), CFG, 16)
