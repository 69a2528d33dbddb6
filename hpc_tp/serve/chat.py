"""Chat messages to a prompt: the model's chat template, a Jinja template as Hugging Face writes them.

A chat model was trained on conversations laid out one way (role markers, special tokens, where
the assistant's turn begins); its ``tokenizer_config.json`` carries that layout as a Jinja template
(``chat_template``), which ``hpc-tp convert`` keeps from a Hugging Face folder or a GGUF file and
``hpc-tp serve --chat-template FILE`` can replace. ``/v1/chat/completions`` renders the request's
messages with it, the assistant's turn opened (``add_generation_prompt``), and completes that text
like any prompt. Templates run in Jinja's immutable sandbox, with the names Hugging Face's templates
use: ``messages``, ``tools`` (where a request declares some: ``serve.tools``), ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``raise_exception`` (a template refusing a conversation: the client's
error) and ``strftime_now``.

A reply ends where the template closes the assistant's turn: ``<|im_end|>`` (ChatML), ``<|eot_id|>``
(Llama 3), ``<end_of_turn>`` (Gemma), ``</s>`` (Mistral). ``end_of_turn_ids`` finds that token by
rendering a short conversation, so generation stops there even where the checkpoint's eos is another
token (a base model's ``<|endoftext|>``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..errors import ConfigError


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "chat template"):
        import jinja2  # loaded when a template is used: hpc-tp --help imports this module
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals.update(raise_exception=_refuse, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{origin}: not a Jinja template: {e.message} (line {e.lineno})") from None
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def end_of_turn_ids(self, tokenizer) -> frozenset[int]:
        """The special token the template writes right after an assistant's reply (empty where it
        writes none, or refuses the probe conversation)."""
        import jinja2  # loaded when a template is used: hpc-tp --help imports this module

        probe = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": _REPLY}]
        try:
            text = self.template.render(messages=probe, add_generation_prompt=False, **self.tokens)
        except jinja2.TemplateError:
            return frozenset()
        after = text.partition(_REPLY)[2].lstrip()
        ids = tokenizer.encode(after)[:1] if after else []
        return frozenset(i for i in ids if i in tokenizer.special_ids)

    def render(self, messages, add_generation_prompt: bool = True, **context) -> str:
        """The prompt for ``messages`` (a list of {"role", "content"} objects, as the OpenAI API sends
        them: ``plain_messages``), ending where the assistant's reply begins (``add_generation_prompt``;
        False: the conversation as it stands, as fine-tuning reads it); ConfigError saying what is wrong
        otherwise. ``context``: further names the template sees, such as ``tools`` (``serve.tools``);
        one that is None is left undefined, as Hugging Face's templates test ``tools is defined``."""
        import jinja2  # loaded when a template is used: hpc-tp --help imports this module

        context = {name: value for name, value in context.items() if value is not None}
        try:
            return self.template.render(
                messages=plain_messages(messages), add_generation_prompt=add_generation_prompt, **self.tokens, **context
            )
        except jinja2.TemplateError as e:  # raise_exception's refusal, or a template error at render time
            raise ConfigError(f"the chat template refused these messages: {e}") from None


_REPLY = "Paris is the capital of France."  # a probe reply, text a template passes through as it is


def plain_messages(messages) -> list[dict]:
    """``messages`` as a template takes them: each a copy whose ``content`` is a string. OpenAI's API
    also sends content as a list of parts, of which text parts are taken (joined by newlines, as vLLM
    joins them), and null content (an assistant's turn that only calls tools), taken as "". Other
    keys (``name``, ``tool_calls``, ``tool_call_id``) pass through to the template."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"messages must be a non-empty list of {{role, content}} objects, got {type(messages).__name__}"
        )
    plain = []
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and (
                isinstance(message.get("content"), (str, list))
                or (message["role"] == "assistant" and message.get("content") is None)
            )
        ):
            raise ConfigError(
                f"messages[{i}] must be an object with a string role and a content: a string or "
                "a list of text parts (null in an assistant's)"
            )
        plain.append({**message, "content": _text_of(message.get("content"), f"messages[{i}].content")})
    return plain


def _text_of(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            got = f"type {kind!r}" if isinstance(kind, str) else f"{json.dumps(part)[:40]}"
            raise ConfigError(
                f'{where}[{j}]: {got} is not supported; expected a text part {{"type": "text", "text": ...}}'
            )
        texts.append(part["text"])
    return "\n".join(texts)


def read_template(path: str | None) -> str | None:
    """``--chat-template``'s text, compiled once to check it: read on every rank before the checkpoint
    loads, so a bad file stops them all with one line. None: no file given."""
    if path is None:
        return None
    try:
        source = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    ChatTemplate(source, origin=f"--chat-template {path}")
    return source


def template_for(tokenizer, source: str | None = None, path: str | None = None) -> ChatTemplate | None:
    """``--chat-template``'s (``source`` from ``path``), or else the template the tokenizer was saved with
    (``tokenizer.chat``), with the special tokens the tokenizer names; None if neither is there."""
    chat = tokenizer.chat
    origin = f"--chat-template {path}" if source is not None else "the checkpoint's chat template"
    source = source if source is not None else chat.get("chat_template")
    if not source:
        return None
    return ChatTemplate(source, chat.get("bos_token", ""), chat.get("eos_token", ""), origin)


def stop_at_end_of_turn(tokenizer, template: ChatTemplate | None):
    """Add the template's end-of-turn token to the ids that end a generation: a chat reply stops
    there with finish_reason "stop", and no template text follows it."""
    if template is not None:
        tokenizer.stop_ids = tokenizer.stop_ids | template.end_of_turn_ids(tokenizer)


def _refuse(message: str):
    import jinja2  # loaded when a template is used: hpc-tp --help imports this module

    raise jinja2.TemplateError(message)
