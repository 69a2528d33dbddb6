"""``POST /v1/embeddings`` of ``hpc-tp serve`` for an encoder (BERT) checkpoint, in OpenAI's shape.

    {"input": TEXT | [TEXT] | [ids] | [[ids]], "model", "encoding_format": "float" | "base64", "user"}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}

An embedding is ``hpc-tp embed``'s: the mean of the input's final token states, L2-normalised
(``serve.embed``). Text goes through the checkpoint's tokenizer.json with its special tokens;
``base64`` (what OpenAI's Python client asks for unless told otherwise) is the float32 vector's
little-endian bytes. Rank 0's handler threads turn each request into an ``EmbeddingJob``; every rank
runs ``EmbeddingBatches``: rank 0 takes the queued jobs, their inputs go to the tp group in one
broadcast, and batches of at most ``rows`` inputs, padded to their longest, run the encoder.
"""

from __future__ import annotations

import base64
import queue
import time

import numpy

from ..errors import ConfigError
from .api_request import check_model, read_body
from .encoder import check_row, encode_batch, mean_pool

_FIELDS = {"input", "model", "encoding_format", "user", "dimensions"}


class EmbeddingJob:
    """One request's inputs (rows {ids, type_ids}) as the embedding loop sees them."""

    def __init__(self, rows: list[dict], encoding: str):
        self.rows, self.encoding = rows, encoding
        self.arrived = time.perf_counter()
        self.events: queue.Queue = queue.Queue()
        self.cancelled = False
        self.on_finish = None  # the server's count of it, called from the loop's thread

    @property
    def jobs(self) -> list:
        """What the batcher is handed for it: itself (as ``api_request.Request.jobs``)."""
        return [self]

    def finish(self, vectors):
        if self.on_finish is not None:
            self.on_finish(self, sum(len(row["ids"]) for row in self.rows))
        self.events.put(("done", vectors))

    def cancel(self):
        self.cancelled = True

    def abort(self):
        self.cancel()
        self.events.put(("abort",))


def parse_embedding_request(body: bytes, tokenizer, cfg, model_name: str) -> EmbeddingJob:
    """The job for an embeddings request, or ConfigError naming what is wrong with it."""
    from ..tokenizer import utf8

    request = read_body(body)
    unknown = sorted(set(request) - _FIELDS)
    if unknown:
        raise ConfigError(f"unknown fields {', '.join(unknown)}; supported: {', '.join(sorted(_FIELDS))}")
    check_model(request, model_name)
    encoding = request.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ConfigError(f'encoding_format={encoding!r}: expected "float" or "base64"')
    if request.get("dimensions") not in (None, cfg.hidden):
        raise ConfigError(f"dimensions={request['dimensions']!r}: this model's embeddings have {cfg.hidden}")
    rows = []
    for i, item in enumerate(_inputs(request.get("input"))):
        label = f"input[{i}]"
        if isinstance(item, str):
            if tokenizer is None:
                raise ConfigError(f"{label}: the checkpoint has no tokenizer.json; give token ids")
            try:
                utf8(item)
            except ConfigError as e:
                raise ConfigError(f"{label}: {e}") from None
            encoded = tokenizer.encode(item)
            ids, type_ids = encoded.ids, encoded.type_ids
        else:
            ids, type_ids = item, [0] * len(item)
        check_row(label, ids, type_ids, cfg)
        rows.append({"ids": list(ids), "type_ids": list(type_ids)})
    return EmbeddingJob(rows, encoding)


def _inputs(given) -> list:
    def ids(value) -> bool:
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        )

    if isinstance(given, str) or ids(given):
        return [given]
    if isinstance(given, list) and given and all(isinstance(g, str) or ids(g) for g in given):
        return given
    raise ConfigError(
        "input must be a string, a list of strings, a list of token ids or a list of such lists; "
        f"got {type(given).__name__ if not isinstance(given, list) else 'another list'}"
    )


def embedding_response(job: EmbeddingJob, vectors, model: str) -> dict:
    def encoded(vector):
        if job.encoding == "base64":
            return base64.b64encode(numpy.asarray(vector, dtype="<f4").tobytes()).decode()
        return [float(x) for x in vector]

    tokens = sum(len(row["ids"]) for row in job.rows)
    return {
        "object": "list",
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
    }


class EmbeddingBatches:
    """The embedding loop: ``run(source)`` as the completions batchers' (``source.take(limit, idle)``
    on rank 0: queued jobs, or None to stop). Collective over the tp group (the world: serve runs one)."""

    def __init__(self, model, rows: int, pad_id: int):
        self.model, self.comm, self.rows, self.pad_id = model, model.comm, rows, pad_id

    def run(self, source=None):
        while True:
            jobs = None
            if self.comm.rank == 0:
                while (jobs := source.take(self.rows, idle=True)) == []:
                    pass
                jobs = [j for j in jobs if not j.cancelled] if jobs is not None else None
            rows = self.comm.bcast_object(None if jobs is None else [r for j in jobs for r in j.rows])
            if rows is None:
                return
            pooled = []
            for start in range(0, len(rows), self.rows):
                states, mask = encode_batch(self.model, rows[start : start + self.rows], self.pad_id)
                if self.comm.rank == 0:
                    pooled.extend(mean_pool(states, mask))
            if self.comm.rank == 0:
                for job in jobs:
                    job.finish(pooled[: len(job.rows)])
                    pooled = pooled[len(job.rows) :]
