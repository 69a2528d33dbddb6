"""Continuous (iteration-level) batching: requests join and leave a running decode batch.

The batch has a fixed number of rows (``hpc-tp serve --max-batch``), each its own region of one KV
cache: a request is prefilled into a free row (from slot 0, or after the prefix it finds cached
there, below), and every iteration
runs one decode step for the busy rows (``decoding.step_rows``: each row writes its token at its
own slot, its positions count its own tokens, and a key mask by its length hides whatever an
earlier request left in the row). A row that finishes (EOS, stop string, max tokens, client gone)
takes the next queued request at the next iteration, as in Orca (OSDI '22) and vLLM, where a static
batch (``Engine.generate``) holds every row until its longest one is done.

Prefix caching: every row keeps a record of the tokens its K/V stand for (``tokens``, ``lens``),
and a row that frees keeps its K/V. A request whose prompt begins with what some row holds (the
same system prompt, or a chat's next turn, which repeats the last turn's prompt and answer)
prefills only the rest of its prompt, attending to those slots: in the free row holding the
longest such prefix, or, where a busy row holds it, in a free row the prefix's K/V are copied into
(one copy of a few slots instead of recomputing them). The logits are those of a whole prefill. A
free row that runs along in a decode step writes at its kept length, after what it keeps. vLLM
shares prefixes in place, as blocks of a paged cache; rows of one cache copy them.

One iteration, collective over the tp group:

    admit     tp rank 0 gives each queued request a free row and finds the longest prefix of its
              prompt some row holds (``_place``), and one ``bcast_object`` sends their (row, prompt
              ids, prefix length, the row holding it), only when there are any; when no row is busy every rank
              waits in that broadcast for the next admissions, or for the word to stop;
    decode    one step for the rows that have a token to feed, up to the last of them;
    prefill   each admitted prompt's prefix copied into its row where another row holds it; then the
              prompts waiting, in admission order, up to ``chunk_tokens`` tokens in all (chunked
              prefill: a long prompt goes on at the next iteration), right-padded to the longest in
              one forward pass per first slot (``_prefill``; several when their padded tokens pass
              ``prefill_tokens``), each into its own row: a prompt's last real token's logits, once
              its last chunk is in, give the request's first token;
    sample    rank 0 samples every busy row (``_Row``: EOS, stop strings, max tokens, cancellation),
              streams text, finishes requests and takes queued ones for the rows now free; one
              ``comm.broadcast`` of an int64 array gives each row's next token (-1: free;
              ``DROPPED``: cancelled during its prefill, free now) and whether admissions follow. The other ranks only ever see token ids.

Prompts admitted together share their prefill: one pass has the same 2 all-reduces a layer and one
logits gather for k prompts as for one, where prefilling each alone took k of each. Right padding
keeps every prompt at positions 0..n-1 from slot 0, as alone: causal attention never lets a real token
see the padding after it, and MoE inference is dropless, so the padding changes no prompt's numbers.
The K/V go straight into each prompt's row (``kv_cache.RowsPrefill``; the rows admitted together need
not be neighbours), with no second cache to copy from, and only each row's last real position reaches
the LM head (``GPTModel.infer``'s ``last``).

Left for later: the step runs eagerly (its shapes change with the rows' lengths, so no CUDA graph
is captured, unlike a static batch's steps on a GPU at tp = 1), a prefill chunk and the decode step
of the rows already busy are two passes rather than one (vLLM mixes them in one), and each row holds
its max_len slots from the start (no paged memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy

from .. import backend
from ..comm.base import on_rank0
from .decoding import step_rows
from .generate import _Row, check_request
from .kv_cache import KVCache, RowsPrefill

# The default bound on a batched prefill's padded tokens (its prompts x the longest of them), raised to
# the rows' max_len where that is more, as vLLM's max_num_batched_tokens before chunked prefill
# (max(max_model_len, 2048)). It bounds the prefill's activations [prompts, longest, hidden] and attention
# tiles: a burst of prompts takes no more memory than 2048 tokens, or one longest prompt a row takes.
PREFILL_TOKENS = 2048


# Prompt tokens one iteration prefills at most: a longer prompt (or a burst) is prefilled over several
# iterations, each also running the decode step of the rows already busy, which so never wait for a
# whole long prefill (vLLM's chunked prefill; Sarathi-Serve, OSDI '24). 256 measured on the CPU
# (benchmarks/chunked_prefill.py, W1 blocks, tp = 2): a 1000-token prompt stalled a decoding row
# 493 ms whole, 236 ms in chunks of 512, 120 ms of 256 and 77 ms of 128, and took 492 / 458 / 449 /
# 523 ms to its first token: 128 costs the long prompt, 256 does not.
CHUNK_TOKENS = 256
DROPPED = -2  # a row's control value: its request was cancelled during its prefill, and the row is free


def prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of prompts of ``lengths`` in groups to prefill together, longest first, so that each
    group's padded size (its count x its longest) stays within ``budget``; a longer prompt goes alone.
    Similar lengths share a group, which keeps the padding small."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class RowMetrics:
    """What a request's usage reports of the batch it was decoded in."""

    batch: int  # rows busy once it was admitted, its own included
    kv_cache_bytes_per_rank: list[int]  # the whole cache: every row, max_len slots each

    def to_dict(self) -> dict:
        return dict(vars(self))


class _Listed:
    """A request of ``ContinuousBatcher.generate``'s list: queued from the start, never cancelled."""

    def __init__(self, ids, params):
        self.ids, self.params, self.arrived, self.cancelled = ids, params, time.perf_counter(), False
        self.result = None

    def text(self, piece, logprobs=None):
        pass

    def finish(self, completion, metrics, queued_s):
        self.result = completion, metrics


class _Queue:
    """``run``'s source over a fixed list: everything queued at once, serving ends when it is all taken
    and done."""

    def __init__(self, requests):
        self.pending = list(requests)

    def take(self, limit: int, idle: bool):
        if idle and not self.pending:
            return None
        taken, self.pending = self.pending[:limit], self.pending[limit:]
        return taken


class _Busy:
    """Rank 0's record of one busy row."""

    def __init__(self, request, row: _Row, admitted: float, batch: int, cached: int):
        self.request, self.row, self.admitted, self.batch, self.cached = request, row, admitted, batch, cached
        self.first: float | None = None  # when its first token was chosen


class ContinuousBatcher:
    """Serves requests through ``rows`` rows of one KV cache for ``engine``'s model and tokenizer, each
    row ``max_len`` slots (default the model's max_seq_len; a request must fit its prompt and new
    tokens but the last in them). ``prefix_caching``: a prompt that begins with what a row holds
    prefills only the rest (module docstring). Prompts admitted together are prefilled in batches
    of at most ``prefill_tokens`` padded tokens (default ``PREFILL_TOKENS``, or max_len if more; 1:
    one at a time). An iteration prefills at most ``chunk_tokens`` prompt tokens (default
    ``CHUNK_TOKENS``), a longer prompt over several iterations, between decode steps (chunked
    prefill). Collective over the tp group: every rank builds one (the cache is allocated here) and
    calls ``run``."""

    def __init__(
        self,
        engine,
        rows: int,
        max_len: int | None = None,
        prefix_caching: bool = True,
        prefill_tokens: int | None = None,
        chunk_tokens: int | None = None,
    ):
        self.engine, self.model, self.comm = engine, engine.model, engine.comm
        self.max_len = min(self.model.cfg.max_seq_len, max_len or self.model.cfg.max_seq_len)
        for name, value in (("prefill_tokens", prefill_tokens), ("chunk_tokens", chunk_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} {value}: expected an integer >= 1")
        self.prefill_tokens = prefill_tokens or max(PREFILL_TOKENS, self.max_len)
        self.chunk_tokens = chunk_tokens or CHUNK_TOKENS
        self.prompts: dict[int, list[int]] = {}  # rows whose prompt is being prefilled, in admission order
        self.cache = KVCache.for_model(self.model, rows, self.max_len)
        self.kv_bytes = self.comm.allgather_object(self.cache.nbytes)
        self.prefix_caching = prefix_caching
        # Each row's cached tokens: a busy row's request so far; a free row's last request's, kept for a
        # prompt that begins with them (without prefix caching, none).
        self.lens = numpy.zeros(rows, dtype=numpy.int64)
        self.tokens = numpy.zeros((rows, self.max_len), dtype=numpy.int64)
        self.feed = numpy.full(rows, -1, dtype=numpy.int64)  # the token each row feeds next (-1: none)
        self._busy: list[_Busy | None] = [None] * rows  # rank 0 only
        self._taken: list = []  # rank 0: requests taken for freed rows, admitted at the next iteration
        self._deferred: list = []  # rank 0: requests whose prompt one admitted with them brings (``_admit``)

    def run(self, source=None):
        """Serve until tp rank 0's ``source`` says stop. ``source`` (rank 0 only) has
        ``take(limit, idle)``: up to ``limit`` queued requests, a list (maybe empty) that it may wait
        for when ``idle`` (no row busy), or None to stop serving then. A request has ``ids`` (prompt
        token ids), ``params`` (SamplingParams), ``arrived`` (``time.perf_counter``) and
        ``cancelled``; the batcher calls its ``text(piece, logprobs)`` with text as it becomes final (and
        the row's ``TokenLogprob`` list so far, or None where none were asked) and then
        ``finish(completion, metrics, queued_s)`` once (``Completion``, ``RowMetrics``, seconds from
        arrival to admission; the completion's ``ttft_s`` counts from admission)."""
        more = False
        while True:
            idle = not (self.feed >= 0).any() and not self.prompts
            admitted = []
            if more or idle:
                admitted = on_rank0(self.comm, lambda: self._admit(source, idle), idle)
                if admitted is None:
                    return
            logits = self._forward(admitted)
            control = numpy.full(len(self.feed) + 1, -1, dtype=numpy.int64)  # next tokens, then "admissions follow"
            if self.comm.rank == 0:
                control[-1] = self._sample(logits, control, source)
            self.comm.broadcast(control)
            for r in numpy.flatnonzero(control[:-1] == DROPPED):
                del self.prompts[int(r)]
            self.feed = numpy.maximum(control[:-1], -1)
            prefilling = numpy.isin(numpy.arange(len(self.feed)), list(self.prompts))
            self._free_rows((self.feed < 0) & ~prefilling)
            more = bool(control[-1])

    def generate(self, prompts=None, params=None):
        """Collective, as ``Engine.generate``, for a whole list at once: on tp rank 0 ``prompts`` (lists
        of token ids) and one SamplingParams each, which take rows as earlier ones finish. Returns
        [(Completion, RowMetrics)] in the prompts' order on rank 0, None elsewhere."""
        if self.comm.rank != 0:
            return self.run()
        requests = [_Listed(ids, p) for ids, p in zip(prompts, params)]
        self.run(_Queue(requests))
        return [r.result for r in requests]

    def _free_rows(self, free):
        """Rows ``free`` (a mask) keep what they hold for prefix caching, but for one slot: a free row
        that runs along in a decode step writes its token at its length, which must be a slot."""
        self.lens[free] = numpy.minimum(self.lens[free], self.max_len - 1) if self.prefix_caching else 0

    def _place(self, ids, free: list[int], taken: list[int]) -> tuple[int, int, int]:
        """Rank 0: (row, prefix, source) for prompt ``ids``: the free row to admit it into, the longest
        prefix of it a row holds and that row: the free row itself where one holds it (no copy), else
        the lowest busy one, the prompt going to the lowest free row. The prompt's last token is always
        prefilled (its logits give the first new token). Rows ``taken`` by this admission are no
        source: a copy into one of them may come first."""
        n = len(ids) - 1
        if not self.prefix_caching or n == 0:
            return free[0], 0, free[0]
        rows = numpy.array([r for r in range(len(self.lens)) if r not in taken])
        same = self.tokens[rows, :n] == numpy.asarray(ids[:n], dtype=numpy.int64)
        held = numpy.minimum(numpy.where(same.all(axis=1), n, same.argmin(axis=1)), self.lens[rows])
        best = int(held.max())
        if best == 0:
            return free[0], 0, free[0]
        holding = [int(r) for r in rows[held == best]]
        in_place = [r for r in holding if r in free]
        return (in_place[0], best, in_place[0]) if in_place else (free[0], best, holding[0])

    def _admit(self, source, idle: bool):
        """Rank 0: the requests taken (waiting for some when idle) placed in free rows (``_place``), as
        [(row, prompt ids, length of its cached prefix, the row holding that)]; None: stop.

        With prefix caching, a request whose prompt is the same as one admitted with it (the n choices
        of one API request) waits for the next iteration, when it finds that prompt's K/V in the other's
        row and copies them rather than prefilling the same tokens again."""
        requests, self._taken = self._taken, []
        while idle and not requests:
            requests = source.take(len(self._busy), idle=True)
            if requests is None:
                return None
        free = [r for r, busy in enumerate(self._busy) if busy is None]
        if len(requests) > len(free):
            raise ValueError(f"{len(requests)} requests taken for {len(free)} free rows")
        prompts, placing, self._deferred = [], [], []
        for request in requests:
            shared = self.prefix_caching and len(request.ids) > 1 and request.ids in prompts
            (self._deferred if shared else placing).append(request)
            prompts.append(request.ids)
        requests = placing
        now, busy = time.perf_counter(), len(self._busy) - len(free) + len(requests)
        admitted, taken = [], []
        for request in requests:
            check_request(request.ids, request.params, self.model.cfg, max_model_len=self.max_len)
            row, cached, source = self._place(request.ids, free, taken)
            free.remove(row)
            taken.append(row)
            row_state = _Row(request.params, self.engine.tokenizer, request.ids)
            self._busy[row] = _Busy(request, row_state, now, busy, cached)
            admitted.append((row, list(request.ids), cached, source))
        return admitted

    def _forward(self, admitted):
        """The decode step for the rows with a token to feed, then the admitted prompts' cached prefixes
        copied into their rows (all before any prefill, which could overwrite a source), then this
        iteration's prefill chunks (up to ``chunk_tokens``, those from one slot together); {row: logits
        [V]} on the host of rank 0 for the rows that stepped or whose prompt is now in ({} elsewhere)."""
        host = self.comm.rank == 0
        logits = {}
        stepping = numpy.flatnonzero(self.feed >= 0)
        if stepping.size:
            # Rows after the last busy one are left out; free rows before it run along, unread, writing
            # after what they keep (admitted rows are free here: their prefill overwrites that slot).
            last = int(stepping[-1]) + 1
            ids = numpy.where(self.feed >= 0, self.feed, self.engine.pad_id)[:last]
            out = step_rows(
                self.model, self.cache.rows(0, last), ids, self.lens[:last], width=int(self.lens[stepping].max()) + 1
            )
            self.tokens[stepping, self.lens[stepping]] = self.feed[stepping]
            self.lens[stepping] += 1
            if host:
                out = backend.to_numpy(out)
                logits.update((int(r), out[r]) for r in stepping)
        for row, ids, cached, source in admitted:
            if source != row:
                self.cache.copy_slots(source, row, cached)
                self.tokens[row, :cached] = self.tokens[source, :cached]
            self.lens[row], self.prompts[row] = cached, ids  # prefilled from its cached prefix on
        by_start: dict[int, list[tuple[int, int]]] = {}  # this iteration's chunks by their first slot
        budget = self.chunk_tokens
        for row, ids in self.prompts.items():  # in admission order: the earliest finish first
            start = int(self.lens[row])
            stop = min(len(ids), start + budget)
            if stop == start:
                break
            by_start.setdefault(start, []).append((row, stop))
            budget -= stop - start
        for start, chunks in by_start.items():
            for group in prefill_groups([stop - start for _, stop in chunks], self.prefill_tokens):
                rows, stops = [chunks[i][0] for i in group], [chunks[i][1] for i in group]
                out = self._prefill(rows, stops, start)
                done = [(i, row) for i, (row, stop) in enumerate(zip(rows, stops)) if stop == len(self.prompts[row])]
                if host:
                    out = backend.to_numpy(out)
                    logits.update((row, out[i]) for i, row in done)
                for _, row in done:
                    del self.prompts[row]
        return logits

    def _prefill(self, rows: list[int], stops: list[int], start: int):
        """One forward pass over the prompts of ``rows``, their tokens ``start`` up to ``stops``, right-
        padded to the longest, each into its row of the cache from slot ``start`` (the rows hold the
        tokens before it): with causal attention a prompt's tokens never see the padding after them, so
        each row's K/V and its last real token's logits ([len(rows), V]) are those of its prompt alone.
        The padding's K/V land after them, hidden by the row's length."""
        xp = backend.xp
        stops = numpy.array(stops)
        width = int(stops.max()) - start
        tokens = numpy.full((len(rows), width), self.engine.pad_id, dtype=numpy.int64)
        for i, (row, stop) in enumerate(zip(rows, stops)):
            tokens[i, : stop - start] = self.prompts[row][start:stop]
            self.tokens[row, start:stop] = tokens[i, : stop - start]
        real = numpy.arange(start + width) < stops[:, None]  # the held slots, then each chunk's own tokens
        view = RowsPrefill(self.cache, xp.asarray(rows, dtype=numpy.int64), start)
        out = self.model.infer(
            xp.asarray(tokens),
            xp.arange(start, start + width),
            xp.asarray(real),
            view,
            last=xp.asarray(stops - start - 1),
        )
        self.lens[rows] = stops
        return out

    def _sample(self, logits, control, source) -> bool:
        """Rank 0: each busy row's next token into ``control`` (-1 where the row is now free, DROPPED
        where a request cancelled during its chunked prefill leaves it), finished requests answered,
        queued requests taken for the free rows; True if any were."""
        now = time.perf_counter()
        for r, z in logits.items():
            busy = self._busy[r]
            if busy.request.cancelled:
                busy.row.cancel(now)
            else:
                busy.row.step(z, now)
                busy.first = now if busy.first is None else busy.first
                busy.row.report(lambda piece, finish: busy.request.text(piece, busy.row.logprobs))
            if busy.row.finish is None:
                control[r] = busy.row.ids[-1]
                continue
            self._finish(r, now)
        for r in [r for r in self.prompts if self._busy[r].request.cancelled]:  # no need to prefill the rest
            self._busy[r].row.cancel(now)
            self._finish(r, now)
            control[r] = DROPPED
        free = sum(b is None for b in self._busy) - len(self._deferred)
        self._taken, self._deferred = self._deferred + (source.take(free, idle=False) if free else []), []
        return bool(self._taken)

    def _finish(self, r: int, now: float):
        """Rank 0: row ``r``'s request answered, the row free."""
        busy = self._busy[r]
        first = now if busy.first is None else busy.first
        busy.request.finish(
            busy.row.completion(len(busy.request.ids), busy.admitted, first, busy.cached),
            RowMetrics(busy.batch, self.kv_bytes),
            busy.admitted - busy.request.arrived,
        )
        self._busy[r] = None
