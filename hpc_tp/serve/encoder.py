"""A BERT encoder's inputs and outputs, shared by ``hpc-tp embed`` and ``/v1/embeddings``: rows of token
ids checked against the model, padded together into one forward pass, and their states mean-pooled."""

from __future__ import annotations

import json

import numpy

from .. import backend
from ..errors import ConfigError


def check_row(label: str, ids, type_ids, cfg):
    _check_integers(label, "ids", ids, cfg.vocab_size)
    _check_integers(label, "type_ids", type_ids, max(cfg.type_vocab_size, 1))
    if not ids or len(ids) > cfg.max_seq_len:  # a text too: it is not cut short silently
        raise ConfigError(f"{label}: {len(ids)} tokens; expected 1 to max_seq_len={cfg.max_seq_len}")
    if len(type_ids) != len(ids):
        raise ConfigError(f"{label}: {len(type_ids)} type_ids for {len(ids)} tokens")


def _check_integers(label: str, field: str, values, bound: int):
    """ConfigError naming the field and its first bad value unless ``values`` is a list of integers in [0, bound)."""
    if not isinstance(values, list):
        got = show(values)
    else:
        bad = next((i for i, v in enumerate(values) if not (integer(v) and 0 <= v < bound)), None)
        if bad is None:
            return
        got = f"{show(values[bad])} at index {bad}"
    raise ConfigError(f'{label}: "{field}" must be a list of integers in [0, {bound}), got {got}')


def integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def show(value, limit: int = 40) -> str:
    """A JSON value as the user wrote it, cut short to stay on one line."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pad_id_of(tokenizer) -> int:
    """The padding id of a BERT tokenizer (``[PAD]``; 0 without a tokenizer, as BERT's vocabularies have it)."""
    return (tokenizer.token_to_id("[PAD]") if tokenizer is not None else None) or 0


def encode_batch(model, rows: list[dict], pad_id: int):
    """Final token states [B, T, hidden] of ``rows`` ({ids, type_ids}) padded together (at least float32),
    and the key mask (host); collective over the model's tp group."""
    ids, type_ids, mask = pad_batch(rows, pad_id)
    states, _ = model.forward(*(backend.xp.asarray(a) for a in (ids, mask, type_ids)))
    if states.dtype.itemsize < 4:  # half precision: the mean sums in float32, and JSON writes float32's digits
        states = states.astype("float32")
    return states, mask


def pad_batch(rows: list[dict], pad_id: int):
    """ids, type ids [B, T] right-padded to the longest row, and the key mask (1 = real token)."""
    longest = max(len(r["ids"]) for r in rows)
    ids = numpy.full((len(rows), longest), pad_id, dtype=numpy.int64)
    type_ids = numpy.zeros_like(ids)
    mask = numpy.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n], type_ids[i, :n], mask[i, :n] = r["ids"], r["type_ids"], 1
    return ids, type_ids, mask


def mean_pool(states, mask):
    """Mean of the real tokens' states, L2-normalised: [B, hidden]."""
    xp = backend.xp_of(states)
    mask = xp.asarray(mask, dtype=states.dtype)[..., None]  # padding adds nothing to the sum
    mean = (states * mask).sum(axis=1) / mask.sum(axis=1)
    return backend.to_numpy(mean / xp.linalg.norm(mean, axis=-1, keepdims=True))
