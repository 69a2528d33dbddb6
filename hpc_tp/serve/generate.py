"""The generation engine: a batch of prompts through prefill and decode with a head-sharded KV cache.

    prefill   the prompts, left-padded to the longest, in one forward pass: every row's K/V fill
              the cache and the last position (a real token in every row) gives the first logits;
    decode    one token per row per step at the same slot for every row; key masks hide padding,
              and each row's positions count only its own tokens (learned positions and RoPE alike);
              on a GPU (tp = 1, or tp over NCCL) each step replays a captured CUDA graph
              (``serve.decoding``).

A static batch: every row stays until the longest is done. ``bench decode`` and ``--batching static``
run these; ``hpc-tp generate`` and ``hpc-tp serve`` batch continuously by default
(``serve.continuous``), reusing this module's per-row bookkeeping (``_Row``) and request checks.

Collective over the tp group: every rank calls ``generate``; tp rank 0 brings the prompts and the
sampling parameters, broadcasts them, samples every token and broadcasts the ids, so the other ranks
never see text. Rank 0 alone detokenizes, checks EOS and stop strings, and streams text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy

from .. import backend
from ..errors import ConfigError
from ..tokenizer import TextSoFar
from .decoding import decode_stepper
from .kv_cache import KVCache
from .sampling import SamplingParams, next_token, process_logits, token_logprobs


@dataclass
class Completion:
    ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max new tokens)
    prompt_tokens: int
    ttft_s: float  # to this row's first token from the start of the batch (continuous: its admission)
    decode_tokens_per_s: float  # tokens after the first, over the time they took
    cached_tokens: int = 0  # of the prompt's, found in the KV cache (continuous batching's prefix caching)
    logprobs: list[TokenLogprob] | None = None  # one per id, where the request asked for them
    preemptions: int = 0  # times its KV blocks went to an older request and it was prefilled again


@dataclass
class TokenLogprob:
    """A chosen token's log-probability under the model, the ``SamplingParams.logprobs`` most likely
    tokens' (id, log-probability), and where its text starts in the completion's."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int


@dataclass
class BatchMetrics:
    batch: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float  # time to first token of the batch
    decode_s: float
    decode_tokens_per_s: float
    comm_s: float  # of the whole batch, rank 0's communicator
    comm_bytes: int
    kv_cache_bytes_per_rank: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(vars(self))


class _Row:
    """One request's tokens and text on rank 0: logits processors, a grammar's mask, stop ids (eos,
    end of turn), stop strings, max new tokens, stream holdback, log-probabilities. ``prompt_ids``:
    what the repetition penalty counts as seen."""

    def __init__(self, params: SamplingParams, tokenizer, prompt_ids=()):
        self.params, self.tokenizer, self.prompt_ids = params, tokenizer, prompt_ids
        self.rng = numpy.random.default_rng(params.seed)
        self._text = TextSoFar(tokenizer)
        self.ids: list[int] = self._text.ids  # the tokens kept, appended by ``_text.add``
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.text, self.finish, self.emitted, self.done_at = "", None, 0, None
        self.mask = params.grammar.mask_for(tokenizer) if params.grammar is not None else None

    def step(self, logits, now: float):
        """Choose and add the next token from this row's logits [V] (host), among those its grammar
        allows if it has one (the mask comes last: no processor may bring a forbidden token back)."""
        processed = (
            process_logits(logits, self.params, self.prompt_ids, self.ids)
            if self.params.transforms_logits()
            else logits
        )
        if self.mask is not None:
            processed = self.mask.apply(processed)
        # where this token's text starts: after the whole characters so far (a cut one is its to finish)
        token, offset = next_token(processed, self.params, self.rng), len(self.text.rstrip("\ufffd"))
        self.add(token)
        if self.logprobs is not None and len(self.ids) > len(self.logprobs):  # the token was kept
            self.logprobs.append(TokenLogprob(token, *token_logprobs(logits, token, self.params.logprobs), offset))
        if self.finish is not None:
            self.done_at = now

    def cancel(self, now: float):
        self.finish, self.done_at = "cancelled", now

    def report(self, on_text):
        """``on_text(piece, finish_reason)`` with the text that became final, if any, or the end."""
        piece = self.new_text()
        if piece or self.finish is not None:
            on_text(piece, self.finish)

    def completion(self, prompt_tokens: int, start: float, first: float, cached_tokens: int = 0) -> Completion:
        """From ``start`` (the batch's, or the request's admission) and its ``first`` token's time."""
        return Completion(
            self.ids,
            self.text,
            self.finish,
            prompt_tokens,
            first - start,
            _rate(len(self.ids) - 1, self.done_at - first),
            cached_tokens,
            self.logprobs,
        )

    def add(self, token: int):
        if not self.params.ignore_eos and token in self.tokenizer.stop_ids:
            self.finish = "stop"
            return
        text = self._text.add(token)  # appends the token to ``ids``
        if self.mask is not None:
            self.mask.accept(token)
        cuts = [text.find(s) for s in self.params.stop if s in text]
        if cuts:
            text, self.finish = text[: min(cuts)], "stop"
        elif self.mask is not None and self.mask.complete:
            self.finish = "stop"
        elif len(self.ids) >= self.params.max_new_tokens:
            self.finish = "length"
        self.text = text

    def new_text(self) -> str:
        """Text that can no longer change, not yet streamed: a running row holds back a cut
        multi-byte character and any tail that could be the start of a stop string."""
        end = len(self.text)
        if self.finish is None:
            end = len(self.text.rstrip("\ufffd"))
            for stop in self.params.stop:
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[:end].endswith(stop[:k]):
                        end -= k
                        break
        piece = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    cfg,
    names: dict[str, str] | None = None,
    max_model_len: int | None = None,
    kv_tokens: int | None = None,
):
    """ConfigError naming the problem (fields named as in ``names``), before a request joins a batch;
    ``max_model_len``: a server's own bound on a request's positions, below the model's max_seq_len;
    ``kv_tokens``: the most a request may hold in a paged KV cache (all of it)."""
    params.validate(names)
    if not prompt_ids:
        raise ConfigError("prompt is empty: generation needs at least one prompt token")
    bad = [i for i in prompt_ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary of {cfg.vocab_size}")
    needed = len(prompt_ids) + params.max_new_tokens - 1  # the last new token is never fed back
    # RoPE has no table to run out of, but max_seq_len is the context the model declares (and what
    # bounds the KV cache a request may ask for), as vLLM's max_model_len.
    limit = (names or {}).get("max_new_tokens", "max_new_tokens")
    asked = f"prompt of {len(prompt_ids)} tokens + {limit} {params.max_new_tokens} needs {needed} positions"
    if max_model_len is not None and needed > max_model_len:  # named first: the bound a server's user can change
        raise ConfigError(
            f"{asked}; this server takes {max_model_len} (--max-model-len) of the model's max_seq_len {cfg.max_seq_len}"
        )
    if needed > cfg.max_seq_len:
        raise ConfigError(f"{asked}; the model has max_seq_len {cfg.max_seq_len}")
    if kv_tokens is not None and needed > kv_tokens:
        raise ConfigError(f"{asked}; this server's KV cache holds {kv_tokens} tokens (--kv-cache-memory)")


def left_pad(prompts: list[list[int]], extra: int, pad_id: int):
    """Prompts right-aligned at the longest one's length W: tokens [B, W], a key mask [B, W + extra]
    (the prompt's slots set; the ``extra`` decode slots are set as they fill) and positions [B, W]
    that count each row's own tokens from 0 (padding slots get 0, nobody attends to them)."""
    width = max(len(ids) for ids in prompts)
    tokens = numpy.full((len(prompts), width), pad_id, dtype=numpy.int64)
    key_mask = numpy.zeros((len(prompts), width + extra), dtype=bool)
    for i, ids in enumerate(prompts):
        tokens[i, width - len(ids) :] = ids
        key_mask[i, width - len(ids) : width] = True
    return tokens, key_mask, numpy.maximum(key_mask[:, :width].cumsum(axis=1) - 1, 0)


class Engine:
    def __init__(self, model, tokenizer):
        self.model, self.comm, self.tokenizer = model, model.comm, tokenizer
        self.pad_id = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)

    def generate(self, prompts=None, params=None, on_text=None, cancelled=None):
        """Collective. On tp rank 0: ``prompts`` (lists of token ids) and one SamplingParams each;
        ``on_text(row, text, finish_reason)`` receives each row's text as it becomes final (the
        reason is None until the row's last call); a row for which ``cancelled(row)`` turns true
        stops there (finish reason "cancelled"), and the batch ends once every row has. Returns
        (completions, BatchMetrics) on rank 0 and None elsewhere."""
        comm, model, xp = self.comm, self.model, backend.xp
        prompts, params = comm.bcast_object((prompts, params) if comm.rank == 0 else None)
        for ids, p in zip(prompts, params):
            check_request(ids, p, model.cfg)  # on every rank alike, so all raise together
        start, comm_s, comm_bytes = time.perf_counter(), comm.seconds, comm.bytes
        lens = numpy.array([len(ids) for ids in prompts])
        batch, width, steps = len(prompts), int(lens.max()), max(p.max_new_tokens for p in params)
        cache = KVCache.for_model(model, batch, width + steps - 1)
        tokens, key_mask, positions = left_pad(prompts, steps - 1, self.pad_id)
        logits = model.infer(xp.asarray(tokens), xp.asarray(positions), xp.asarray(key_mask[:, :width]), cache)
        decoder = decode_stepper(model, cache, key_mask, lens)
        rows = [_Row(p, self.tokenizer, ids) for p, ids in zip(params, prompts)] if comm.rank == 0 else None
        first = None
        try:
            for step in range(steps):
                chosen = numpy.full(batch + 1, self.pad_id, dtype=numpy.int64)  # the ids, then "all finished"
                if comm.rank == 0:
                    self._sample(backend.to_numpy(logits), rows, chosen, on_text, cancelled)
                comm.broadcast(chosen)
                first = first or time.perf_counter()
                if chosen[batch] or step == steps - 1:
                    break
                logits = decoder.step(chosen[:batch])
        finally:
            decoder.close()
        end = time.perf_counter()
        kv_bytes = comm.allgather_object(cache.nbytes)
        if comm.rank != 0:
            return None
        new = sum(len(r.ids) for r in rows)
        after_first = sum(max(len(r.ids) - 1, 0) for r in rows)
        metrics = BatchMetrics(
            batch,
            int(lens.sum()),
            new,
            first - start,
            end - first,
            _rate(after_first, end - first),
            comm.seconds - comm_s,
            comm.bytes - comm_bytes,
            kv_bytes,
        )
        completions = [r.completion(int(n), start, first) for r, n in zip(rows, lens)]
        return completions, metrics

    def _sample(self, logits, rows, chosen, on_text, cancelled):
        now = time.perf_counter()
        for i, row in enumerate(rows):
            if row.finish is None and cancelled is not None and cancelled(i):
                row.cancel(now)
            if row.finish is not None:
                continue
            row.step(logits[i], now)
            chosen[i] = row.ids[-1] if row.ids else self.pad_id
            if on_text is not None:
                row.report(lambda piece, finish: on_text(i, piece, finish))
        chosen[-1] = all(r.finish is not None for r in rows)


def _rate(count: int, seconds: float) -> float:
    return count / seconds if count > 0 and seconds > 0 else 0.0
