"""Answers in the shapes of OpenAI's API: a whole completion or chat completion, the chunks of a
streamed one, usage, and log-probabilities.

A stream sends, per choice, chunks of text as it becomes final (a chat's first delta carries the
role, the others only content), then a chunk with the choice's finish reason; with
``stream_options.include_usage`` a last chunk of its own carries the usage, with no choices, and
every chunk before it ``"usage": null`` (OpenAI's stream). Log-probabilities ride with the text
of the tokens they are of: completions as ``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``; chat as ``content``: [{token, logprob, bytes, top_logprobs}].
"""

from __future__ import annotations

import time


def token_bytes(tokenizer, token: int) -> bytes:
    """A token's own bytes: a byte tokenizer's byte (a piece of a character, maybe), else its text's."""
    if getattr(tokenizer, "kind", None) == "bytes":
        return bytes([token]) if 0 <= token < 256 else b""
    return tokenizer.decode([token]).encode()


def token_text(raw: bytes) -> str:
    """A token's text, or ``bytes:\\xNN...`` for bytes that are not whole characters (OpenAI's spelling)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(entries, tokenizer, offset: int = 0) -> dict:
    """``/v1/completions``' logprobs object for ``entries`` (``generate.TokenLogprob``); text offsets
    shifted by ``offset`` (the echoed prompt's length)."""

    def text(token):
        return token_text(token_bytes(tokenizer, token))

    return {
        "tokens": [text(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": [e.text_offset + offset for e in entries],
    }


def chat_logprobs(entries, tokenizer) -> dict:
    """``/v1/chat/completions``' logprobs object for ``entries``."""

    def item(token, logprob):
        raw = token_bytes(tokenizer, token)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }


def choice(
    request, index: int, text: str, finish: str | None, entries, tokenizer, streamed: bool, first: bool, calls=None
) -> dict:
    """Choice ``index`` of ``request`` (an ``api_request.Request``): its text, or a chunk of it, and the
    log-probabilities ``entries`` of its tokens (None where none were asked). ``first``: the choice's
    first chunk, which carries a chat's role and an echoed prompt. ``calls``: a chunk's tool-call deltas."""
    if request.echo is not None and first:
        text = request.echo[index // request.n] + text
    if request.chat:
        logprobs = None if entries is None else chat_logprobs(entries, tokenizer)
        if not streamed or first:
            message = {"role": "assistant", "content": text}
        else:
            message = {"content": text} if text else {}
        if calls:
            message = {**message, "content": text or None, "tool_calls": calls}
        if request.tools is not None and finish is not None:  # the answer's calls, parsed out of its text
            calls = request.jobs[index].calls
            message, finish = calls.last(finish) if streamed else request.tools.turn(text, finish)
            if streamed and not first:
                message.pop("role")
        return {
            "index": index,
            "delta" if streamed else "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
    offset = len(request.echo[index // request.n]) if request.echo is not None else 0
    logprobs = None if entries is None else completion_logprobs(entries, tokenizer, offset)
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def envelope(request, job_id: int, model: str, choices: list[dict], streamed: bool, **extra) -> dict:
    """The object around ``choices``: a whole answer, or one chunk of a streamed one."""
    if request.chat:
        kind, name = ("chat.completion.chunk" if streamed else "chat.completion"), f"chatcmpl-{job_id}"
    else:
        kind, name = "text_completion", f"cmpl-{job_id}"
    if streamed and request.include_usage:
        extra = {"usage": None, **extra}
    return {"id": name, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}


def usage(request, results: dict) -> dict:
    """The request's usage from its choices' ``results`` {index: (completion, metrics, queued_s)}: token
    counts over all choices (a prompt counted once, for its n choices); and this server's own timings:
    the first token and queue time of the earliest choice, the mean decode rate of the choices, the
    largest batch any was decoded in and the KV cache's bytes."""
    done = [results[i] for i in sorted(results)]
    prompts = [c for i, (c, _, _) in enumerate(done) if i % request.n == 0]
    completion_tokens = sum(len(c.ids) for c, _, _ in done)
    prompt_tokens = sum(c.prompt_tokens for c in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in prompts)},
        "time_to_first_token_s": min(q + c.ttft_s for c, _, q in done),
        "queue_s": min(q for _, _, q in done),
        "decode_tokens_per_s": sum(c.decode_tokens_per_s for c, _, _ in done) / len(done),
        "batch_size": max(m.batch for _, m, _ in done),
        "kv_cache_bytes_per_rank": done[0][1].kv_cache_bytes_per_rank,
    }
