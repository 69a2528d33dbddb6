"""Chat templates (``serve.chat``) and ``/v1/chat/completions`` requests (``serve.http.parse_request``):
messages rendered as Hugging Face renders them, in Jinja's sandbox; every refusal one clear line."""
import json

import pytest

from hpc_tp.errors import ConfigError
from hpc_tp.models.config import ModelConfig
from hpc_tp.serve.chat import ChatTemplate
from hpc_tp.serve.http import CHAT, COMPLETIONS, parse_request
from hpc_tp.tokenizer import ByteTokenizer

# the shape of Llama 3's template, shortened: the bos token, a header per turn, the assistant's opened
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{{ m['content'] }}|{% endfor %}")
HELLO = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}]
CFG = ModelConfig(vocab_size=258, hidden=32, n_layers=1, n_heads=4, max_seq_len=256)


def test_messages_render_with_the_special_tokens_and_the_assistants_turn_opened():
    text = ChatTemplate(LLAMA3, bos_token="<|begin_of_text|>").render(HELLO)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("messages, reason", [
    ("Hi", "messages must be a non-empty list"),
    ([], "messages must be a non-empty list"),
    ([{"role": "user", "content": "Hi"}, {"role": "user"}], "messages[1] must be an object with a string role"),
    ([{"role": "user", "content": ["parts"]}], "messages[0] must be an object with a string role"),
    ([{"role": "assistant", "content": "Hi"}], "refused these messages: roles must alternate user/assistant"),
])
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
    job = parse_request(body, ByteTokenizer(), CFG, 16, endpoint=CHAT, chat_template=template)
    assert job.chat and job.stream and job.params.max_new_tokens == 5 and job.params.temperature == 0
    assert job.ids == ByteTokenizer().encode(template.render(HELLO))
    plain = parse_request(json.dumps({"prompt": "Hi"}).encode(), ByteTokenizer(), CFG, 16)
    assert not plain.chat and plain.params.max_new_tokens == 16


@pytest.mark.parametrize("endpoint, body, reason", [
    (CHAT, {"messages": HELLO}, "this model has no chat template: .*--chat-template FILE"),
    (CHAT, {"prompt": "Hi"}, "unknown fields prompt; supported: .*messages"),
    (COMPLETIONS, {"messages": HELLO}, "unknown fields messages; supported: .*prompt"),
])
def test_a_request_the_endpoint_cannot_take_is_refused(endpoint, body, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_request(json.dumps(body).encode(), ByteTokenizer(), CFG, 16, endpoint=endpoint)


def test_options_left_at_their_defaults_are_taken_and_others_refused():
    """What OpenAI clients send by default (zero penalties, no logprobs, stream_options) is taken;
    asking for what this server does not do is a 400 naming the value."""
    quiet = {"prompt": "Hi", "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "echo": False,
             "logit_bias": {}, "stream": True, "stream_options": {"include_usage": True}}
    assert parse_request(json.dumps(quiet).encode(), ByteTokenizer(), CFG, 16).stream
    for field, value, reason in (("presence_penalty", 0.5, "presence_penalty=0.5: not supported"),
                                 ("logprobs", 3, "logprobs=3: not supported"),
                                 ("echo", True, "echo=True: not supported"),
                                 ("stream_options", {"include_usage": "yes"}, "stream_options=")):
        with pytest.raises(ConfigError, match=reason):
            parse_request(json.dumps({"prompt": "Hi", field: value}).encode(), ByteTokenizer(), CFG, 16)
