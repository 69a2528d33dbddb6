"""Held-out accuracy on the demo task: greedy completion of prompts the model never trained on.

Prompts sit right-padded in one array; each round runs the model over the whole array and
reads every row's next token at its own end (causal attention: padding after a row's end
changes nothing before it). Every rank of the tp group computes the same gathered logits, so
every rank decodes the same tokens without extra messages.
"""
from __future__ import annotations

import numpy as np

ROWS_PER_FORWARD = 256  # bounds the [rows, seq_len, vocab] logits a round holds


def greedy_complete(logits_fn, prompts: list[list[int]], max_new: int, seq_len: int, stop_ids: set[int],
                    pad_id: int) -> list[list[int]]:
    """Up to ``max_new`` greedy tokens after each prompt, ending at the first ``stop_ids`` token (kept)."""
    out = []
    for start in range(0, len(prompts), ROWS_PER_FORWARD):
        out.extend(_complete_rows(logits_fn, prompts[start:start + ROWS_PER_FORWARD], max_new, seq_len,
                                  stop_ids, pad_id))
    return out


def _complete_rows(logits_fn, prompts, max_new, seq_len, stop_ids, pad_id):
    ids = np.full((len(prompts), seq_len), pad_id, dtype=np.int64)
    ends = np.array([len(p) for p in prompts])
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    done = np.zeros(len(prompts), dtype=bool)
    new = [[] for _ in prompts]
    rows = np.arange(len(prompts))
    for _ in range(max_new):
        done |= ends >= seq_len
        if done.all():
            break
        logits = logits_fn(ids)
        choice = logits[rows, np.minimum(ends, seq_len) - 1].argmax(axis=-1)
        for row in np.flatnonzero(~done):
            token = int(choice[row])
            new[row].append(token)
            ids[row, ends[row]] = token
            done[row] = token in stop_ids
        ends = np.where(done, ends, ends + 1)
    return new


def heldout_accuracy(logits_fn, task, tokenizer, seq_len: int, problems: int) -> tuple[float, list]:
    """(fraction of the first ``problems`` held-out problems answered exactly, [(prompt, completion, ok)])."""
    examples = task.heldout_examples()[:problems]
    prompts = tokenizer.encode_batch([p for p, _ in examples])
    stop = {i for i in (tokenizer.eos_id, *tokenizer.encode("\n")) if i is not None}
    longest_answer = len(tokenizer.encode(task.answer(10 ** task.digits - 1, 10 ** task.digits - 1) + "\n"))
    pad = next(i for i in (tokenizer.pad_id, tokenizer.eos_id, 0) if i is not None)
    completions = greedy_complete(logits_fn, prompts, longest_answer, seq_len, stop, pad)
    results = []
    for (prompt, _), tokens in zip(examples, completions):
        text = tokenizer.decode(tokens)
        results.append((prompt, text, task.check(prompt, text)))
    return sum(ok for _, _, ok in results) / max(len(results), 1), results
