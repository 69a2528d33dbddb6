"""Supervised fine-tuning data: conversations, rendered with the model's chat template, the loss on the
assistant's tokens only.

    hpc-tp train --init CKPT --data chats.jsonl [--chat-template FILE] [--eval-split 0.05] [--eval-every N]

A line is ``{"messages": [{"role", "content"}, ...]}`` (what the chat server takes, and the common SFT
datasets' layout) or ``{"prompt": ..., "completion": ...}`` (a user turn and the assistant's answer).
Each conversation is rendered whole by the chat template; an assistant turn's tokens are those the
conversation up to and including it adds to the conversation up to it with the assistant's turn opened
(``add_generation_prompt``): the reply and what closes it (``<|im_end|>``, ``<|eot_id|>``, ...), so the
model learns where to stop. Every other target (system, user and tool turns, the template's markup) is
IGNORE, and so left out of the token count that divides the loss: every layout still computes the
gradient of one process.

One conversation per row, right-padded to ``--seq-len`` (no packing: a row's attention never reaches
another conversation, so the numbers are exact without document masks). A conversation longer than
``--seq-len`` + 1 tokens is refused with its line number rather than silently cut. ``--eval-split``
holds out a fraction of the conversations (chosen by ``--seed``), whose assistant-token loss the
trainer reports as ``heldout_loss``.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from ..jsonl import read_json_lines
from .data import TokenDataset
from .tasks import IGNORE


def read_conversations(path) -> list[tuple[int, list[dict]]]:
    """(line number, messages) of each non-blank line; a bad line is an error naming it."""
    conversations = [(n, _messages(record, f"{path} line {n}")) for n, record in read_json_lines(path, "--data")]
    if not conversations:
        raise ConfigError(f"--data {path}: no conversations in it")
    return conversations


def _messages(record, where: str) -> list[dict]:
    if isinstance(record, dict) and set(record) >= {"prompt", "completion"}:
        record = {
            "messages": [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]},
            ]
        }
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ConfigError(
            f'{where}: expected {{"messages": [{{"role", "content"}}, ...]}} or {{"prompt", "completion"}}'
        )
    if not any(m.get("role") == "assistant" for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant turn to learn")
    return messages


def render_conversation(template, tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and, for each, whether it belongs to an assistant turn (its reply
    and the markup that closes it)."""

    def encode(turns, opened):
        try:
            return tokenizer.encode(template.render(turns, add_generation_prompt=opened))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    ids = encode(messages, False)
    learned = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start, end = encode(messages[:i], True), encode(messages[: i + 1], False)
        if ids[: len(start)] != start or ids[: len(end)] != end:
            raise ConfigError(
                f"{where}: the chat template's rendering of turn {i + 1} does not tokenize as the "
                "start of the whole conversation, so its tokens cannot be told apart"
            )
        learned[len(start) : len(end)] = [True] * (len(end) - len(start))
    return ids, learned


class ChatDataset(TokenDataset):
    """One conversation a row: ids, and next-token targets that are IGNORE except on assistant tokens."""

    def __init__(self, rows: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
        self.seq_len = seq_len
        self.ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
        self.targets = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
        for r, (ids, learned) in enumerate(rows):
            n = len(ids) - 1
            self.ids[r, :n] = ids[:-1]
            self.targets[r, :n] = np.where(learned[1:], ids[1:], IGNORE)

    def __len__(self):
        return len(self.ids)

    def get(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        return self.ids[indices], self.targets[indices]


def build_chat_datasets(
    path, tokenizer, template, seq_len: int | None, eval_split: float = 0.0, seed: int = 0, context: int | None = None
) -> tuple[ChatDataset, ChatDataset | None]:
    """(training rows, held-out rows or None) of the conversations in ``path``, rows of ``seq_len``
    tokens (None: the longest conversation's, up to the model's ``context``)."""
    if template is None:
        raise ConfigError(
            f"--data {path}: conversations need a chat template, and the tokenizer carries none: "
            "--init a checkpoint of a chat model, or pass --chat-template FILE"
        )
    if not 0 <= eval_split < 1:
        raise ConfigError(f"--eval-split {eval_split}: expected a fraction in [0, 1)")
    rows = []
    limit, flag = (seq_len, "--seq-len") if seq_len is not None else (context, "the model's max_seq_len")
    for n, messages in read_conversations(path):
        ids, learned = render_conversation(template, tokenizer, messages, f"{path} line {n}")
        if limit is not None and len(ids) - 1 > limit:
            raise ConfigError(
                f"{path} line {n}: the conversation is {len(ids)} tokens, more than {flag} "
                f"{limit} + 1 (longer conversations are refused, not cut)"
            )
        rows.append((ids, learned))
    seq_len = seq_len or max(len(ids) - 1 for ids, _ in rows)
    held = math.ceil(eval_split * len(rows)) if eval_split else 0
    if held and held >= len(rows):
        raise ConfigError(f"--eval-split {eval_split} of {len(rows)} conversations leaves none to train on")
    order = np.random.default_rng(seed).permutation(len(rows))
    pad = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)
    train = ChatDataset([rows[i] for i in sorted(order[held:])], seq_len, pad)
    return train, ChatDataset([rows[i] for i in sorted(order[:held])], seq_len, pad) if held else None
