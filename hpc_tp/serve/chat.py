"""Chat messages to a prompt: the model's chat template, a Jinja template as Hugging Face writes them.

A chat model was trained on conversations laid out one way (role markers, special tokens, where
the assistant's turn begins); its ``tokenizer_config.json`` carries that layout as a Jinja template
(``chat_template``), which ``hpc-tp convert`` keeps from a Hugging Face folder or a GGUF file and
``hpc-tp serve --chat-template FILE`` can replace. ``/v1/chat/completions`` renders the request's
messages with it, the assistant's turn opened (``add_generation_prompt``), and completes that text
like any prompt. Templates run in Jinja's immutable sandbox, with the names Hugging Face's templates
use: ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception`` (a
template refusing a conversation: the client's error) and ``strftime_now``.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from ..errors import ConfigError


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "chat template"):
        import jinja2  # loaded when a template is used: hpc-tp --help imports this module
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=_refuse, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{origin}: not a Jinja template: {e.message} (line {e.lineno})") from None
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages) -> str:
        """The prompt for ``messages`` (a list of {"role", "content"} objects, as the OpenAI API sends
        them), ending where the assistant's reply begins; ConfigError saying what is wrong otherwise."""
        import jinja2  # loaded when a template is used: hpc-tp --help imports this module

        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"messages must be a non-empty list of {{role, content}} objects, "
                              f"got {type(messages).__name__}")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ConfigError(f"messages[{i}] must be an object with a string role and a string content")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.tokens)
        except jinja2.TemplateError as e:  # raise_exception's refusal, or a template error at render time
            raise ConfigError(f"the chat template refused these messages: {e}") from None


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


def _refuse(message: str):
    import jinja2  # loaded when a template is used: hpc-tp --help imports this module

    raise jinja2.TemplateError(message)
