"""Continuous (iteration-level) batching: requests join and leave a running decode batch.

The batch has a fixed number of rows (``hpc-tp serve --max-batch``), each a request in flight, whose
K/V live in blocks of one paged KV cache (``kv_cache.PagedKVCache``, blocks handed out by
``blocks.BlockManager``): a request takes a block as its tokens reach one, so the cache holds what the
requests have, not every row at the longest a request may be. A request is prefilled into a free row
(after the prefix it finds cached, below), and every iteration runs one decode step for the rows with
a token to feed (``decoding.step_view``: each row writes its token in its own last block, its
positions count its own tokens, and it attends over its own blocks up to its length). A row that
finishes (EOS, stop string, max tokens, client gone) gives its blocks back and takes the next queued
request at the next iteration, as in Orca (OSDI '22) and vLLM, where a static batch
(``Engine.generate``) holds every row until its longest one is done.

Prefix caching (vLLM's automatic prefix caching, ``serve.blocks``): the full blocks of a request's
tokens are named by a hash chain over them, and a request whose prompt begins with blocks the cache
holds (the same system prompt, or a chat's next turn, which repeats the last turn's prompt and answer)
shares them, counted by reference, and prefills only the rest, attending to them; where its prompt goes
on into a partly filled block some request wrote, it gets a copy of that block (copy-on-write). A
finished request's blocks stay cached until a new block is needed and no free one is left (LRU).
The logits are those of a whole prefill.

Preemption by recompute: where a row needs a block (a decode step entering a new block, a prefill
chunk) and none is free, the youngest request in flight (the last admitted) gives all its blocks back
and is queued again, first in line, to be prefilled again with its prompt and the tokens it has
chosen so far (its cached blocks, if still there, found by prefix caching), and goes on as if never
stopped. Admission waits while the free blocks cannot hold a queued prompt and other requests run.
A request that cannot fit in the whole cache alone is refused (``check_request``'s ``kv_tokens``).

Sliding windows: the layers of one window (or none) are a kind with a block table of its own
(``blocks.PagedLayout``), all kinds' blocks out of one pool of units. A windowed kind gives back each
block that falls wholly out of its window as the request goes on, its table keeping the scratch unit
in its place, while a global kind (Gemma 3's one layer in six) keeps every block: a long request holds
its whole context only in the global layers. A decode step's window is applied per row (its query's
own position). The check that a request fits the cache (``kv_tokens``) counts the units it holds at
its longest: a windowed kind's at most its window and a prefill chunk.

One iteration, collective over the tp group; every rank keeps the same block tables, making the same
calls on the same broadcast inputs, so no block number is ever sent:

    admit     tp rank 0 gives queued requests (those preempted first) free rows, and one
              ``bcast_object`` sends their (row, token ids), only when there are any; when no row is
              busy every rank waits in that broadcast for the next admissions, or for the word to stop;
    blocks    a block for the new slot of each row that has a token to feed (oldest first; the
              youngest are preempted where blocks run out); each admitted prompt's cached prefix
              found (``BlockManager.admit``); then the prompts waiting, in admission order, up to
              ``chunk_tokens`` tokens in all (chunked prefill: a long prompt goes on at the next
              iteration), each with blocks for its chunk;
    passes    the prompts' chunks right-padded to the longest in one forward pass per first slot
              (several when their padded tokens pass ``prefill_tokens``, or where a pass more costs
              less than the padding it saves, ``prefill_groups``), the decode step of the rows with a
              token to feed riding along the first (``_pass``), or alone where no prompt waits: a
              prompt's last real token's logits, once its last chunk is in, give the request's first
              token;
    sample    rank 0 samples every busy row (``_Row``: EOS, stop strings, max tokens, cancellation),
              streams text, finishes requests, queues the preempted ones again and takes queued ones
              for the rows now free; one ``comm.broadcast`` of an int64 array gives each row's next
              token (-1: free; ``DROPPED``: cancelled during its prefill, free now) and whether
              admissions follow. The other ranks only ever see token ids.

Prompts admitted together share their prefill: one pass has the same 2 all-reduces a layer and one
logits gather for k prompts as for one, where prefilling each alone took k of each. Right padding
keeps every prompt at positions 0..n-1 from slot 0, as alone: causal attention never lets a real token
see the padding after it, and MoE inference is dropless, so the padding changes no prompt's numbers.
The K/V go straight into each prompt's blocks, the padding's into the scratch block, and only each
row's last real position reaches the LM head (``GPTModel.infer``'s ``last``).

A decode step and a prefill pass in one (as vLLM schedules them, and Sarathi's "piggybacking"): every
layer but attention works token by token, so the prompts' tokens and the decode rows' are flattened
into one row of tokens (``kv_cache.MixedView``) and each weight is read once for both, where a decode
step alone reads every weight for a few rows; each layer's attention splits the tokens back into the
prefill's [rows, width] and the step's [rows, 1] and runs each as it runs alone, so every request's
numbers are those of the two passes.

CUDA graphs: on a GPU, at tp = 1 or over NCCL, a decode step that runs alone (no prompt waiting) goes through
``decoding.PagedSteps``: padded to the fixed shapes of its bucket (rows up to a power of two, each
row's slots up to a power of two of blocks), each bucket captured at its first step and replayed after.
A step riding along a prefill pass runs eagerly, its shapes the pass's; so does every step on the CPU
and over MPI (``fixed_steps`` asks for the padded steps anywhere: the tests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy

from .. import backend
from ..comm.base import on_rank0
from ..errors import ConfigError
from ..kernels import functional as F
from .blocks import SCRATCH, BlockManager, PagedLayout, Sequence
from .decoding import decode_slots, paged_steps, step_arguments
from .generate import _Row, check_request
from .kv_cache import MixedView, PagedKVCache, PagedView

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
KV_BLOCK_SIZE = 16  # tokens a block, vLLM's default
DROPPED = -2  # a row's control value: its request was cancelled during its prefill, and the row is free


# What a prefill pass costs beyond its padded tokens, in tokens: reading every weight once and the
# per-layer calls. SmolLM2-135M on one core (float32): a pass of T tokens ~40 ms + 3.1 ms x T
# (T = 1 .. 256), so one pass more pays once it saves ~13 padded tokens.
PASS_TOKENS = 16


def prefill_groups(lengths: list[int], budget: int, pass_tokens: int) -> list[list[int]]:
    """Indices of prompts of ``lengths`` in groups to prefill together, longest first, each group's padded
    size (its count x its longest) within ``budget`` (a longer prompt goes alone), with the fewest padded
    tokens plus ``pass_tokens`` a pass: runs of the prompts sorted by length, cut where the padding a
    cut saves is worth a pass more (dynamic programming over the cuts; ties take fewer passes)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    cost, cut = [0] + [math.inf] * len(order), [0] * (len(order) + 1)  # of the first j prompts, and j's cut
    for stop in range(1, len(order) + 1):
        for start in range(stop):  # the group order[start:stop], its longest first
            padded = (stop - start) * lengths[order[start]]
            if padded <= budget or stop - start == 1:
                if cost[start] + pass_tokens + padded < cost[stop]:
                    cost[stop], cut[stop] = cost[start] + pass_tokens + padded, start
    groups, stop = [], len(order)
    while stop:
        groups.append(order[cut[stop] : stop])
        stop = cut[stop]
    return groups[::-1]


@dataclass
class RowMetrics:
    """What a request's usage reports of the batch it was decoded in."""

    batch: int  # rows busy once it was admitted, its own included
    kv_cache_bytes_per_rank: list[int]  # the whole pool of blocks, allocated at start

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
    """Rank 0's record of one request in flight (or preempted and queued again)."""

    def __init__(self, request, row: _Row, admitted: float, batch: int):
        self.request, self.row, self.admitted, self.batch = request, row, admitted, batch
        self.cached: int | None = None  # prompt tokens found cached at its first admission
        self.first: float | None = None  # when its first token was chosen
        self.preemptions = 0  # times it gave its blocks back to an older request

    @property
    def ids(self) -> list[int]:
        """What a prefill gives it: its prompt, then the tokens chosen so far (after a preemption)."""
        return list(self.request.ids) + self.row.ids


def kv_pool_units(model, layout: PagedLayout, rows: int, max_len: int, memory_gib: float | None) -> int:
    """Units of the pool (``layout``'s), the scratch unit among them: as many as ``memory_gib`` GiB a
    rank holds (``--kv-cache-memory``), or by default enough for ``rows`` requests of ``max_len`` tokens
    each (the whole batch at its longest: no request is ever preempted)."""
    if memory_gib is None:
        return rows * layout.units_for(max_len) + 1
    # the most a rank of the group holds: pipeline stages hold different layers, and every rank needs
    # the same units (collective over the group, as the batcher that calls it)
    per_unit = max(model.comm.allgather_object(PagedKVCache.unit_bytes(model, layout)))
    if not (math.isfinite(memory_gib) and memory_gib > 0):
        raise ConfigError(f"--kv-cache-memory {memory_gib}: expected a number of GiB > 0")
    units = int(memory_gib * 2**30 // per_unit)
    if units < 2:
        raise ConfigError(
            f"--kv-cache-memory {memory_gib}: holds {units} units of {layout.size} tokens "
            f"({per_unit} bytes each a rank); expected at least {2 * per_unit / 2**30:.3g} GiB "
            "(one unit and the scratch unit)"
        )
    return units


class ContinuousBatcher:
    """Serves requests through ``rows`` rows (requests in flight) for ``engine``'s model and tokenizer,
    their K/V in one paged KV cache of blocks of ``block_size`` tokens, ``kv_cache_memory`` GiB a rank
    (default: enough for every row at ``max_len``; ``kv_pool_units``). A request must fit its prompt
    and new tokens but the last in ``max_len`` (default the model's max_seq_len) and in the cache.
    ``prefix_caching``: a prompt that begins with what the cache holds prefills only the rest (module
    docstring). Prompts admitted together are prefilled in batches of at most ``prefill_tokens`` padded
    tokens (default ``PREFILL_TOKENS``, or max_len if more; 1: one at a time). An iteration prefills at
    most ``chunk_tokens`` prompt tokens (default ``CHUNK_TOKENS``), a longer prompt over several
    iterations, between decode steps (chunked prefill). ``fixed_steps``: a decode step that runs alone
    goes through ``decoding.PagedSteps`` (its rows and slots padded to a bucket's, replayed from a CUDA
    graph on a GPU, at tp = 1 or over NCCL), by default (None) where graphs are captured (``decoding.paged_steps``);
    the graphs live as long as the batcher (those a warm-up request captured serve the requests after it).
    Collective over the tp group: every rank builds one (the cache is allocated here) and calls ``run``."""

    def __init__(
        self,
        engine,
        rows: int,
        max_len: int | None = None,
        prefix_caching: bool = True,
        prefill_tokens: int | None = None,
        chunk_tokens: int | None = None,
        block_size: int | None = None,
        kv_cache_memory: float | None = None,
        fixed_steps: bool | None = None,
    ):
        self.engine, self.model, self.comm = engine, engine.model, engine.comm
        self.max_len = min(self.model.cfg.max_seq_len, max_len or self.model.cfg.max_seq_len)
        for name, value in (("prefill_tokens", prefill_tokens), ("chunk_tokens", chunk_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} {value}: expected an integer >= 1")
        self.prefill_tokens = prefill_tokens or max(PREFILL_TOKENS, self.max_len)
        self.chunk_tokens = chunk_tokens or CHUNK_TOKENS
        block_size = KV_BLOCK_SIZE if block_size is None else block_size
        self.layout = PagedLayout.of(self.model.cfg, block_size, self.chunk_tokens)
        units = kv_pool_units(self.model, self.layout, rows, self.max_len, kv_cache_memory)
        self.cache = PagedKVCache.for_model(self.model, units, self.layout)
        self.steps = paged_steps(self.model, self.cache, rows, self.max_len, fixed_steps)
        self.blocks = BlockManager(units, self.layout, prefix_caching)
        self.kv_bytes = self.comm.allgather_object(self.cache.nbytes)
        self.prefix_caching = prefix_caching
        # the tables cover every layer of the model (``PagedLayout.of`` reads the config), so that
        # pipeline stages, which hold different ones, make the same calls
        self.seqs = [Sequence(len(self.layout.windows)) for _ in range(rows)]  # each row's blocks and tokens held
        self.age = numpy.full(rows, -1, dtype=numpy.int64)  # when each busy row was admitted (-1: free)
        self._admissions = 0
        self.prompts: dict[int, list[int]] = {}  # rows whose prompt is being prefilled, in admission order
        self.feed = numpy.full(rows, -1, dtype=numpy.int64)  # the token each row feeds next (-1: none)
        self.preempted: list[int] = []  # rows whose request was preempted this iteration, youngest first
        self._busy: list[_Busy | None] = [None] * rows  # rank 0 only
        self._waiting: list = []  # rank 0: requests taken (and preempted ones, first) waiting for a row

    @property
    def kv_tokens(self) -> int:
        """Tokens one request may hold: as many as every unit but the scratch one holds for it (with
        every kind windowed and the windows fitting, any number: ``max_len``)."""
        most = self.layout.most_slots(self.blocks.usable)
        return self.max_len if most is None else most

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
            for r in numpy.flatnonzero((self.feed < 0) & ~prefilling & (self.age >= 0)):
                self._free(int(r))
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

    def _free(self, row: int):
        """Row ``row``'s blocks given back (with prefix caching they stay cached until needed)."""
        self.blocks.release(self.seqs[row])
        self.age[row] = -1

    def _admit(self, source, idle: bool):
        """Rank 0: queued requests (waiting for some when idle) given free rows, as [(row, the ids to
        prefill)]; None: stop. Requests go in order while the free blocks hold their prompts (the
        first always, when no row is busy: it fits alone).

        With prefix caching, a request whose prompt is the same as one admitted with it (the n choices
        of one API request) waits for the next iteration, when it finds that prompt's K/V cached and
        shares them rather than prefilling the same tokens again."""
        while idle and not self._waiting:
            requests = source.take(len(self._busy), idle=True)
            if requests is None:
                return None
            self._waiting += requests
        free = [r for r, busy in enumerate(self._busy) if busy is None]
        busy, room = len(self._busy) - len(free), self.blocks.available()
        now, admitted = time.perf_counter(), []
        for item in list(self._waiting):
            if not free:
                break
            ids = item.ids
            if self.prefix_caching and len(ids) > 1 and any(ids == other for _, other in admitted):
                continue
            needed = self.layout.units_for(len(ids))
            if needed > room and (busy or admitted):
                break
            room -= needed
            self._waiting.remove(item)
            if not isinstance(item, _Busy):  # a new request, not a preempted one
                check_request(ids, item.params, self.model.cfg, max_model_len=self.max_len, kv_tokens=self.kv_tokens)
                item = _Busy(item, _Row(item.params, self.engine.tokenizer, ids), now, 0)
            row = free.pop(0)
            self._busy[row] = item
            admitted.append((row, ids))
        for row, _ in admitted:
            self._busy[row].batch = self._busy[row].batch or busy + len(admitted)
        return admitted

    def _forward(self, admitted):
        """Blocks for the rows with a token to feed, then the admitted prompts' cached prefixes found,
        then this iteration's prefill chunks (up to ``chunk_tokens``, those from one slot together),
        blocks reserved for each (``_room``); then the passes: the decode step rides along the first
        prefill pass (``_pass``: the weights read once for both), or runs alone where no prompt waits.
        {row: logits [V]} on the host of rank 0 for the rows that stepped or whose prompt is now in
        ({} elsewhere)."""
        host = self.comm.rank == 0
        logits, self.preempted = {}, []
        for row in numpy.argsort(self.age):  # the oldest first: the youngest are preempted for them
            if self.feed[row] >= 0:
                self._room(int(row), self.seqs[row].length + 1)
        for row, ids in admitted:
            for copy in self.blocks.admit(self.seqs[row], ids, len(ids) - 1):
                self.cache.copy_block(*copy)
            self.prompts[row], self.age[row] = ids, self._admissions
            self._admissions += 1
            if host and self._busy[row].cached is None:
                self._busy[row].cached = self.seqs[row].length
        chunks, budget = [], self.chunk_tokens  # (row, first slot, stop) in admission order: the earliest finish first
        for row, ids in list(self.prompts.items()):
            if row not in self.prompts:  # preempted for an older one's chunk
                continue
            start = self.seqs[row].length
            stop = min(len(ids), start + budget)
            if stop == start:
                break
            if self._room(row, stop):
                chunks.append((row, start, stop))
                budget -= stop - start
        passes = []  # (rows, stops, first slot)
        for start in dict.fromkeys(start for _, start, _ in chunks):  # each first slot, in order
            mine = [(row, stop) for row, first, stop in chunks if first == start]
            for group in prefill_groups([stop - start for _, stop in mine], self.prefill_tokens, PASS_TOKENS):
                passes.append(([mine[i][0] for i in group], [mine[i][1] for i in group], start))
        stepping = numpy.flatnonzero(self.feed >= 0)  # after the chunks' blocks, which may preempt the youngest
        if stepping.size and not passes:
            passes.append(([], [], 0))
        for rows, stops, start in passes:
            out = self._pass(stepping, rows, stops, start)
            done = [(i, row) for i, (row, stop) in enumerate(zip(rows, stops)) if stop == len(self.prompts[row])]
            if host:
                out = _host_logits(out)
                logits.update((int(r), out[len(rows) + i]) for i, r in enumerate(stepping))  # sampled first
                logits.update((row, out[i]) for i, row in done)
            for _, row in done:
                del self.prompts[row]
            stepping = stepping[:0]  # the first pass took the decode step
        return logits

    def _room(self, row: int, slots: int) -> bool:
        """Blocks for row ``row``'s first ``slots`` slots, the youngest requests preempted while too few
        are free; False where that was the row's own."""
        while not self.blocks.reserve(self.seqs[row], slots):
            victim = int(numpy.argmax(self.age))
            self._free(victim)
            self.prompts.pop(victim, None)
            self.feed[victim] = -1
            self.preempted.append(victim)
            if victim == row:
                return False
        return True

    def _pass(self, stepping, rows: list[int], stops: list[int], start: int):
        """One forward pass over a decode step for rows ``stepping`` (each feeding its token at its
        length) and the prompts of ``rows``, their tokens ``start`` up to ``stops`` (either may be
        empty); with both, their tokens flattened into one row (``MixedView``), so that the weights are
        read once for both. Records the tokens written; returns the logits [len(rows) + len(stepping),
        V]: each prompt's last token in the pass, then each decode row's."""
        if len(stepping) and not rows and self.steps is not None:  # the step alone: its bucket's fixed shapes
            out = self.steps.step(self.feed[stepping], *self._step_slots(stepping))
        else:
            parts = ([self._prefill_part(rows, stops, start)] if rows else []) + (
                [self._step_part(stepping)] if len(stepping) else []
            )
            if len(parts) == 1:
                ids, positions, mask, view, last = parts[0]
                out = self.model.infer(ids, positions, mask, view, last=last)
            else:
                ids, positions, view, last = _flattened(parts)
                out = self.model.infer(ids, positions, None, view, last=last)
        for row, stop in zip(rows, stops):
            self.blocks.written(self.seqs[row], self.prompts[row][start:stop])
        for r in stepping:
            self.blocks.written(self.seqs[r], [int(self.feed[r])])
        return out

    def _step_part(self, rows):
        """A decode step for ``rows``, each feeding its token at its length (``decoding.step_view``):
        (ids [B, 1], positions [B, 1], key mask, ``PagedView``, None)."""
        return (*step_arguments(self.model, self.cache, self.feed[rows], *self._step_slots(rows)), None)

    def _step_slots(self, rows):
        return decode_slots(self.blocks, [self.seqs[r] for r in rows])

    def _prefill_part(self, rows: list[int], stops: list[int], start: int):
        """The prompts of ``rows``, their tokens ``start`` up to ``stops``, right-padded to the longest,
        each into its row's blocks from slot ``start`` (the rows hold the tokens before it), the
        padding's K/V into the scratch block: with causal attention a prompt's tokens never see the
        padding after them, so each row's K/V and its last real token's logits are those of its
        prompt alone. (tokens [B, T], positions [T], key mask, ``PagedView``, each row's last [B])."""
        xp = backend.xp
        stops = numpy.array(stops)
        width = int(stops.max()) - start
        tokens = numpy.full((len(rows), width), self.engine.pad_id, dtype=numpy.int64)
        slots = numpy.full((self.layout.lanes, len(rows), start + width), SCRATCH, dtype=numpy.int64)
        for i, (row, stop) in enumerate(zip(rows, stops)):
            tokens[i, : stop - start] = self.prompts[row][start:stop]
            slots[:, i, :stop] = self.blocks.slots(self.seqs[row], stop)
        real = numpy.arange(start + width) < stops[:, None]  # the held slots, then each chunk's own tokens
        view = PagedView(self.cache, xp.asarray(slots[..., start:]), xp.asarray(slots) if start else None)
        positions = xp.arange(start, start + width)
        return xp.asarray(tokens), positions, xp.asarray(real), view, xp.asarray(stops - start - 1)

    def _sample(self, logits, control, source) -> bool:
        """Rank 0: each busy row's next token into ``control`` (-1 where the row is now free, DROPPED
        where a request cancelled during its chunked prefill leaves it), finished requests answered,
        preempted ones queued again first, queued requests taken for the free rows; True if any wait."""
        now = time.perf_counter()
        self._waiting[:0] = [self._busy[r] for r in reversed(self.preempted)]  # the oldest first
        for r in self.preempted:
            self._busy[r].preemptions += 1
            self._busy[r] = None
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
        free = sum(b is None for b in self._busy) - len(self._waiting)
        if free > 0:
            self._waiting += source.take(free, idle=False)
        return bool(self._waiting)

    def _finish(self, r: int, now: float):
        """Rank 0: row ``r``'s request answered, the row free."""
        busy = self._busy[r]
        first = now if busy.first is None else busy.first
        completion = busy.row.completion(len(busy.request.ids), busy.admitted, first, busy.cached)
        completion.preemptions = busy.preemptions
        busy.request.finish(
            completion,
            RowMetrics(busy.batch, self.kv_bytes),
            busy.admitted - busy.request.arrived,
        )
        self._busy[r] = None


def _host_logits(out):
    """A pass's logits on the host; half ones widened to float32 (exactly) for every row at once: the
    samplers' numpy argmax of a bfloat16 row of 49152 costs 28 us, of a float32 one 4 us."""
    out = backend.to_numpy(out)
    return F.cast(out, numpy.float32) if out.dtype.itemsize < 4 else out


def _flattened(parts):
    """``_pass``'s parts (ids [B, T], positions [T] or [B, T], key mask, view, last [B] or None: T - 1)
    as one row: (ids [1, N], positions [1, N], ``MixedView``, each part's last tokens' indices)."""
    xp = backend.xp
    ids, positions, cuts, last, first = [], [], [], [], 0
    for tokens, pos, mask, view, picks in parts:
        rows, width = tokens.shape
        ids.append(tokens.reshape(-1))
        positions.append(xp.broadcast_to(pos, (rows, width)).reshape(-1))
        cuts.append((view, rows, width, mask))
        picks = xp.full(rows, width - 1) if picks is None else picks
        last.append(first + xp.arange(rows) * width + picks)
        first += rows * width
    return xp.concatenate(ids)[None], xp.concatenate(positions)[None], MixedView(cuts), xp.concatenate(last)
