"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: what a client counts and checks its prompts with.

    /tokenize    {"prompt": TEXT} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}
                 (messages as a chat request renders them, through the chat template)
    /detokenize  {"tokens": [ids]} -> {"prompt": TEXT}

Both take an optional ``model``, refused where it names another model (UnknownModel, a 404).
"""

from __future__ import annotations

import json

from ..errors import ConfigError
from .api_request import check_model, read_body, render_messages


def tokenize(body: bytes, tokenizer, chat_template, model_name: str, max_model_len: int) -> dict:
    request = read_body(body)
    check_model(request, model_name)
    fields = sorted(set(request) - {"model"})
    if fields == ["prompt"] and isinstance(request["prompt"], str):
        ids = tokenizer.encode(request["prompt"])
    elif fields == ["messages"]:
        ids = tokenizer.encode(render_messages(request, chat_template))
    else:
        raise ConfigError(
            f'fields {", ".join(fields) or "none"}: expected {{"prompt": TEXT}} or '
            '{"messages": [...]} (and optional model)'
        )
    return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}


def detokenize(body: bytes, tokenizer, vocab_size: int, model_name: str) -> dict:
    request = read_body(body)
    check_model(request, model_name)
    ids, fields = request.get("tokens"), sorted(set(request) - {"model"})
    if fields != ["tokens"] or not (
        isinstance(ids, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)
    ):
        got = f"tokens {json.dumps(ids)[:40]}" if fields == ["tokens"] else f"fields {', '.join(fields) or 'none'}"
        raise ConfigError(f'expected {{"tokens": [token ids in [0, {vocab_size})]}}, got {got}')
    return {"prompt": tokenizer.decode(ids)}
