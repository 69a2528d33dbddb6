"""Continuous batching (``serve.continuous``): requests admitted at different iterations, into rows
freed by others, give the tokens and logits they give alone; a request that arrives while a long one
decodes starts at once; a cancelled request frees its row; a prompt that begins with what a free row
holds prefills only the rest, with the logits of a whole prefill. At tp = world size, float64."""

import itertools
import time

import numpy as np
import pytest
from test_generate import CONFIGS, PROMPTS, _model, larger_weights
from tp_helpers import max_rel_err, tp_and_reference

from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve import continuous, decoding, generate
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.filterwarnings("error")]


class Request:
    made = itertools.count()

    def __init__(self, ids, max_new_tokens, cancel_after=None, stop=()):
        # greedy, so the seed only names the request: it outlives the pickling of a broadcast
        self.ids = ids
        self.params = SamplingParams(max_new_tokens=max_new_tokens, seed=next(Request.made), stop=list(stop))
        self.arrived, self.cancel_after = time.perf_counter(), cancel_after
        self.sampled, self.pieces, self.done = [], [], None  # sampled: the logits of each token chosen

    @property
    def cancelled(self):
        return self.cancel_after is not None and len(self.sampled) >= self.cancel_after

    def text(self, piece, logprobs=None):
        self.pieces.append(piece)

    def finish(self, completion, metrics, queued_s):
        assert self.done is None
        self.done = completion, metrics, queued_s


class Script:
    """Hands each request out from the ``take`` call it is due at (counting calls from 1), in order."""

    def __init__(self, due):
        self.due, self.calls = due, 0  # [(call, request)]

    def take(self, limit, idle):
        self.calls += 1
        ready = [r for call, r in self.due if call <= self.calls][:limit]
        self.due = [(call, r) for call, r in self.due if r not in ready]
        return None if idle and not ready and not self.due else ready


class Chosen(list):
    """Every token chosen for a watched request, in order, as that request; each keeps its logits."""

    def __init__(self):
        super().__init__()
        self.owners = {}

    def watch(self, request):
        self.owners[request.params.seed] = request
        return request


@pytest.fixture(autouse=True, params=[1, 16], ids=["block1", "block16"])
def block_size(request, monkeypatch):
    """Every test at two block sizes: one token a block (every prefix a run of full blocks, shared by
    reference) and the default 16 (these short prompts' prefixes mostly in partly filled blocks, copied)."""
    monkeypatch.setattr(continuous, "KV_BLOCK_SIZE", request.param)
    return request.param


@pytest.fixture
def events(monkeypatch):
    chosen, pick = Chosen(), generate.next_token

    def spy(logits, params, rng):
        owner = chosen.owners.get(params.seed)
        if owner is not None:
            owner.sampled.append(np.array(logits))
            chosen.append(owner)
        return pick(logits, params, rng)

    monkeypatch.setattr(generate, "next_token", spy)
    return chosen


def _serve(comm, name, rows, due, events, prefix_caching=True, engine=None, fixed_steps=None):
    """Run the batcher at tp = ``comm`` (every rank); the requests, on tp rank 0."""
    engine = engine or Engine(_model(name, comm), ByteTokenizer())
    batcher = ContinuousBatcher(engine, rows, prefix_caching=prefix_caching, fixed_steps=fixed_steps)
    for _, request in due:
        events.watch(request)
    batcher.run(Script(due) if comm.rank == 0 else None)
    assert not any(batcher.blocks.refs)  # every request done: every block given back
    return engine


def _alone(engine, request, events):
    """The request by itself through ``Engine.generate`` (collective): completion and logits."""
    probe = events.watch(Request(request.ids, request.params.max_new_tokens, stop=request.params.stop))
    out = engine.generate(
        [probe.ids] if engine.comm.rank == 0 else None, [probe.params] if engine.comm.rank == 0 else None
    )
    return out, probe


@pytest.mark.parametrize("name", CONFIGS)
def test_each_request_gives_what_it_gives_alone(name, events, monkeypatch):
    tp, _ = tp_and_reference()
    passes, run_pass = [], ContinuousBatcher._pass  # (decode rows, prompts) of each forward pass

    def finite_pass(self, stepping, rows, stops, start):
        out = run_pass(self, stepping, rows, stops, start)
        passes.append((len(stepping), len(rows)))
        assert np.isfinite(out).all()
        return out

    monkeypatch.setattr(ContinuousBatcher, "_pass", finite_pass)
    long_prompt = [int(i) for i in np.random.default_rng(3).integers(0, 256, 27)]
    requests = [
        Request(PROMPTS[2], 3),
        Request(PROMPTS[1], 10),
        Request(PROMPTS[3], 5),
        Request(PROMPTS[0], 4),
        Request(long_prompt, 6),
        Request([9, 8, 7], 7),  # 27 + 6 - 1: every position of max_seq_len 32
        Request([200, 3], 1),
    ]  # done at its prefill: never decodes
    due = [
        (1, requests[0]),
        (1, requests[1]),
        (2, requests[2]),
        (2, requests[3]),
        (4, requests[4]),
        (9, requests[5]),
        (9, requests[6]),
    ]
    engine = _serve(tp, name, 2, due, events)
    order = [requests.index(r) for r in events]  # the batcher's tokens, before the runs alone
    for request in requests:
        out, probe = _alone(engine, request, events)
        if tp.rank != 0:
            continue
        completion, metrics, queued_s = request.done
        assert completion.ids == out[0][0].ids and completion.finish_reason == out[0][0].finish_reason
        assert completion.text == out[0][0].text == "".join(request.pieces)
        assert len(request.sampled) == len(probe.sampled) == request.params.max_new_tokens
        assert max(max_rel_err(a, b) for a, b in zip(request.sampled, probe.sampled)) <= 1e-10
        assert metrics.batch in (1, 2) and len(metrics.kv_cache_bytes_per_rank) == tp.size and queued_s >= 0
    if tp.rank == 0:
        # seven requests through two rows: later ones wait, are admitted while others decode, reuse rows
        first = [order.index(i) for i in range(len(requests))]
        last = [len(order) - 1 - order[::-1].index(i) for i in range(len(requests))]
        assert first[2] > last[0] and first[2] < last[1]  # into row 0 once the first request left it
        assert first[4] < last[1] or first[4] < last[3]  # admitted while another row decodes
        steps = [rows for rows, _ in passes if rows]
        assert max(steps) == 2 and min(steps) == 1
        assert any(rows and prompts for rows, prompts in passes)  # a decode step rode along a prefill pass


@pytest.mark.parametrize("name", ["gpt2", "llama-window"])
def test_decode_steps_at_a_bucket_s_fixed_shapes_give_what_each_request_gives_alone(name, events, monkeypatch):
    """The decode steps that run alone through ``decoding.PagedSteps`` (asked for: on the CPU they run
    eagerly), rows joining and leaving so that the steps change buckets: each request's tokens and
    logits are those it has alone, and those of the eager steps (1e-12)."""
    tp, _ = tp_and_reference()
    buckets, step = [], decoding.PagedSteps.step

    def spy(self, ids, lens, slots):
        buckets.append(self.bucket(len(lens), slots.shape[-1]))
        return step(self, ids, lens, slots)

    monkeypatch.setattr(decoding.PagedSteps, "step", spy)
    engine = Engine(_model(name, tp), ByteTokenizer())
    long_prompt = [int(i) for i in np.random.default_rng(3).integers(0, 256, 20)]
    runs = []
    for fixed in (True, False):
        requests = [
            Request(ids, new)
            for ids, new in [
                (PROMPTS[0], 12),
                (PROMPTS[1], 4),
                (PROMPTS[3], 8),
                (PROMPTS[2], 6),
                (long_prompt, 9),
                ([9, 8, 7], 5),
            ]
        ]
        # four rows, then three, two, one; then two more join the one
        _serve(tp, name, 5, list(zip((1, 1, 1, 1, 10, 10), requests)), events, engine=engine, fixed_steps=fixed)
        runs.append(requests)
    for fixed, eager in zip(*runs):
        _agrees_with_alone(engine, fixed, events)
        if tp.rank == 0:
            assert fixed.done[0].ids == eager.done[0].ids
            assert max(max_rel_err(a, b) for a, b in zip(fixed.sampled, eager.sampled)) <= 1e-12
    assert {width for width, _ in buckets} == {1, 2, 4} and len({keys for _, keys in buckets}) >= 2, buckets


# capacity 0.5 would drop tokens in training: inference must keep them, padding or not
MODELS = {**CONFIGS, "moe": dict(CONFIGS["gpt2"], num_experts=4, top_k=2, capacity_factor=0.5)}


@pytest.mark.parametrize(
    "prefill_tokens, pass_tokens, shapes",
    [
        (None, 1000, [(6, 27)]),
        (None, 16, [(2, 27), (4, 7)]),
        (16, 16, [(1, 27), (1, 13), (2, 7), (2, 2)]),
        (1, 16, [(1, 27), (1, 13), (1, 7), (1, 5), (1, 2), (1, 1)]),
    ],
    ids=["one-prefill", "less-padding", "bounded", "one-at-a-time"],
)
@pytest.mark.parametrize("name", MODELS)
def test_prompts_admitted_together_share_a_prefill_and_give_what_they_give_alone(
    name, prefill_tokens, pass_tokens, shapes, events, monkeypatch
):
    """``generate`` with a row for every prompt admits them all at once: prompts of different lengths
    right-padded into one forward pass (or into passes of at most ``prefill_tokens`` padded tokens,
    longest first, cut where the padding saved is worth a pass of ``pass_tokens``), each request's
    tokens and logits those it has alone."""
    monkeypatch.setattr(continuous, "PASS_TOKENS", pass_tokens)
    tp, _ = tp_and_reference()
    model = larger_weights(GPTModel(ModelConfig(**MODELS[name]), tp, seed=4))
    engine, prefills = Engine(model, ByteTokenizer()), _prefill_passes(monkeypatch)
    long_prompt = [int(i) for i in np.random.default_rng(5).integers(0, 256, 27)]
    requests = [
        events.watch(Request(ids, new))
        for ids, new in [
            (PROMPTS[0], 4),
            (long_prompt, 6),
            (PROMPTS[3], 5),
            (PROMPTS[1], 3),
            (list(b"thirteen long"), 2),
            (PROMPTS[2], 1),
        ]
    ]
    batcher = ContinuousBatcher(engine, len(requests), prefill_tokens=prefill_tokens)
    out = batcher.generate(
        [r.ids for r in requests] if tp.rank == 0 else None, [r.params for r in requests] if tp.rank == 0 else None
    )
    assert [shape for shape, _ in prefills] == shapes
    for i, request in enumerate(requests):
        alone, probe = _alone(engine, request, events)
        if tp.rank == 0:
            assert out[i][0].ids == alone[0][0].ids and out[i][1].batch == len(requests)
            assert len(request.sampled) == len(probe.sampled) == request.params.max_new_tokens
            assert max(max_rel_err(a, b) for a, b in zip(request.sampled, probe.sampled)) <= 1e-10, f"request {i}"


def test_prefill_groups_bound_padded_tokens_longest_first():
    assert continuous.prefill_groups([2, 9, 5, 7, 1, 3], 16, 16) == [[1], [3, 2], [5, 0, 4]]
    assert continuous.prefill_groups([4, 4, 4], 12, 16) == [[0, 1, 2]]  # ties keep their order
    assert continuous.prefill_groups([30, 3], 8, 16) == [[0], [1]]  # a prompt past the bound goes alone
    # a pass more where it saves more padded tokens than it costs: 44 padded > 16, 4 padded < 16
    assert continuous.prefill_groups([106, 150], 2048, 16) == [[1], [0]]
    assert continuous.prefill_groups([96, 100], 2048, 16) == [[1, 0]]
    assert continuous.prefill_groups([96, 100], 2048, 3) == [[1], [0]]
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 200, 7)]
    groups = continuous.prefill_groups(lengths, 600, 16)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert all(len(g) * max(lengths[i] for i in g) <= 600 for g in groups)
    assert _groups_cost(groups, lengths) == min(
        _groups_cost(g, lengths)
        for g in _partitions(sorted(range(7), key=lambda i: -lengths[i]))
        if all(len(group) * max(lengths[i] for i in group) <= 600 for group in g)
    )
    engine = Engine(_model("gpt2", tp_and_reference()[1]), ByteTokenizer())
    assert ContinuousBatcher(engine, 1).prefill_tokens == continuous.PREFILL_TOKENS
    assert ContinuousBatcher(engine, 1, prefill_tokens=8).prefill_tokens == 8
    with pytest.raises(ValueError, match="prefill_tokens 0: expected an integer >= 1"):
        ContinuousBatcher(engine, 1, prefill_tokens=0)


def _groups_cost(groups, lengths, pass_tokens=16):
    return sum(pass_tokens + len(g) * max(lengths[i] for i in g) for g in groups)


def _partitions(order):
    """Every cut of ``order`` into runs."""
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, run = [], [order[0]]
        for index, cut in zip(order[1:], cuts):
            if cut:
                groups.append(run)
                run = []
            run.append(index)
        yield groups + [run]


def test_a_request_arriving_mid_decode_starts_before_the_long_one_ends(events):
    tp, _ = tp_and_reference()
    long, short = Request(PROMPTS[0], 20), Request(PROMPTS[1], 3)
    _serve(tp, "llama-gqa", 2, [(1, long), (3, short)], events)
    if tp.rank == 0:
        order = [{long: "L", short: "S"}[r] for r in events]  # one letter per token chosen, in order
        assert order.count("L") == 20 and order.count("S") == 3
        # the short one's tokens come between the long one's: it ends while the long one decodes
        first_short, last_long = order.index("S"), len(order) - 1 - order[::-1].index("L")
        assert first_short < last_long
        # due at the 3rd take, which follows the long one's 2nd token: admitted in the 3rd iteration
        assert order[:first_short] == ["L"] * 3
        assert long.done[1].batch == 1 and short.done[1].batch == 2


def test_a_cancelled_request_frees_its_row(events):
    tp, _ = tp_and_reference()
    cancelled, waiting = Request(list(b"abandoned"), 20, cancel_after=3), Request(list(b"kept"), 4)
    engine = _serve(tp, "llama-gqa", 1, [(1, cancelled), (1, waiting)], events)  # one row
    order = list(events)
    out, _ = _alone(engine, waiting, events)
    if tp.rank == 0:
        completion = cancelled.done[0]
        assert completion.finish_reason == "cancelled" and len(completion.ids) == 3 == len(cancelled.sampled)
        assert waiting.done[0].ids == out[0][0].ids and waiting.done[0].finish_reason == "length"
        assert [r is waiting for r in order] == [False] * 3 + [True] * 4  # it took the row at once


def test_a_stop_string_ends_a_row_its_streamed_text_held_back_and_frees_it(events):
    tp, _ = tp_and_reference()
    engine = Engine(_model("gpt2", tp), ByteTokenizer())
    out, _ = _alone(engine, Request(PROMPTS[0], 12), events)
    stop = tp.bcast_object(out[0][0].text[3:5] if tp.rank == 0 else None)  # as test_generate's stop test
    stopped, waiting = Request(PROMPTS[0], 12, stop=[stop]), Request(PROMPTS[1], 4)
    _serve(tp, "gpt2", 1, [(1, stopped), (1, waiting)], events)
    if tp.rank == 0:
        completion = stopped.done[0]
        text = out[0][0].text
        assert completion.finish_reason == "stop" and completion.text == text[: text.find(stop)]
        assert "".join(stopped.pieces) == completion.text and len(completion.ids) < 12
        assert waiting.done[0].finish_reason == "length" and len(waiting.done[0].ids) == 4


def _prefill_passes(monkeypatch) -> list:
    """Records each forward pass that carries prompts (``ContinuousBatcher._pass``, a decode step riding
    along or not) as ((prompts, tokens), first slot)."""
    passes, run_pass = [], ContinuousBatcher._pass

    def spy(self, stepping, rows, stops, start):
        if rows:
            passes.append(((len(rows), max(stops) - start), start))
        return run_pass(self, stepping, rows, stops, start)

    monkeypatch.setattr(ContinuousBatcher, "_pass", spy)
    return passes


def _agrees_with_alone(engine, request, events):
    out, probe = _alone(engine, request, events)
    if engine.comm.rank == 0:
        completion = request.done[0]
        assert completion.ids == out[0][0].ids and completion.finish_reason == out[0][0].finish_reason
        assert max(max_rel_err(a, b) for a, b in zip(request.sampled, probe.sampled)) <= 1e-10


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_prompt_beginning_with_a_free_rows_tokens_prefills_only_the_rest(name, prefix_caching, events):
    """Two rows. A and B are admitted together; A ends first and its row runs along in B's decode
    steps (writing after what it keeps); C, a chat's next turn after A (A's prompt and answer, then
    more), comes while B decodes and takes A's row; D begins with B's prompt and comes when both
    rows are free: it takes B's row, the higher one. Each gives what it gives alone."""
    tp, _ = tp_and_reference()
    engine = Engine(_model(name, tp), ByteTokenizer())
    a, b = Request(PROMPTS[0], 3), Request(PROMPTS[2], 12)
    answer, _ = _alone(engine, a, events)
    answer = tp.bcast_object(answer[0][0].ids if tp.rank == 0 else None)
    c = Request(PROMPTS[0] + answer + [7, 8, 9], 4)
    d = Request(PROMPTS[2][:5] + [250, 251], 3)
    assert PROMPTS[2][5] != 250 and PROMPTS[0][0] != PROMPTS[2][0]
    _serve(tp, name, 2, [(1, a), (1, b), (4, c), (30, d)], events, prefix_caching, engine)
    for request in (a, b, c, d):
        _agrees_with_alone(engine, request, events)
    if tp.rank == 0:
        order = [r for r in events if r in (b, c)]
        assert order.index(c) < len(order) - 1 - order[::-1].index(b)  # C decoded while B did
        cached = [r.done[0].cached_tokens for r in (a, b, c, d)]
        # C holds A's prompt and A's answer but its last token, which was never fed; D B's first 5
        assert cached == ([0, 0, len(PROMPTS[0]) + 3 - 1, 5] if prefix_caching else [0, 0, 0, 0])


def test_a_prompt_a_row_holds_whole_still_prefills_its_last_token(events):
    tp, _ = tp_and_reference()
    engine = Engine(_model("gpt2", tp), ByteTokenizer())
    first, again = Request(PROMPTS[2], 2), Request(PROMPTS[2], 5)  # the same prompt, after it in one row
    _serve(tp, "gpt2", 1, [(1, first), (1, again)], events, engine=engine)
    _agrees_with_alone(engine, again, events)
    if tp.rank == 0:
        assert again.done[0].cached_tokens == len(PROMPTS[2]) - 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_prefix_a_busy_row_holds_is_copied_into_a_free_row(prefix_caching, events):
    """L decodes in row 0 when S, beginning with L's first four tokens, comes: S takes row 1, which X
    left, and, with prefix caching, gets a copy of L's partly filled block (its first four slots) and
    prefills the rest. X's block outlives its row, cached: T, X's prompt and more, finds X's prompt."""
    tp, _ = tp_and_reference()
    engine = Engine(_model("llama-gqa", tp), ByteTokenizer())
    long, gone, short = Request(PROMPTS[2], 10), Request(PROMPTS[0], 1), Request(PROMPTS[2][:4] + [99, 98], 3)
    later = Request(PROMPTS[0] + [5], 2)
    _serve(tp, "llama-gqa", 2, [(1, long), (1, gone), (3, short), (40, later)], events, prefix_caching, engine)
    order = list(events)
    for request in (long, short, later):
        _agrees_with_alone(engine, request, events)
    if tp.rank == 0:
        assert order.index(short) < len(order) - 1 - order[::-1].index(long)  # S came while L decoded
        assert short.done[0].cached_tokens == (4 if prefix_caching else 0) and long.done[0].cached_tokens == 0
        assert later.done[0].cached_tokens == (len(PROMPTS[0]) if prefix_caching else 0)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_prompts_with_a_cached_prefix_share_a_prefill_after_it(name, events, monkeypatch):
    """Three rows: the first three prompts (a shared system prompt S, then their own) take them and end
    at their first token; the next three, S and their own tokens of different lengths, find S in those
    rows and prefill only their own tokens, together, from slot len(S): one pass at positions len(S)..,
    each request as alone."""
    tp, _ = tp_and_reference()
    model = _model(name, tp)
    engine, prefills = Engine(model, ByteTokenizer()), _prefill_passes(monkeypatch)
    system = [60, 61, 62, 63, 64, 65]
    own = [[1], [2, 3, 4], [5, 6], [7, 8, 9, 10, 11], [12], [13, 14]]
    requests = [events.watch(Request(system + tokens, 1 if i < 3 else 3)) for i, tokens in enumerate(own)]
    batcher = ContinuousBatcher(engine, 3)
    out = batcher.generate(
        [r.ids for r in requests] if tp.rank == 0 else None, [r.params for r in requests] if tp.rank == 0 else None
    )
    assert prefills == [((3, 9), 0), ((3, 5), len(system))]
    for i, request in enumerate(requests):
        alone, probe = _alone(engine, request, events)
        if tp.rank == 0:
            assert out[i][0].ids == alone[0][0].ids and out[i][0].cached_tokens == (0 if i < 3 else len(system))
            assert max(max_rel_err(a, b) for a, b in zip(request.sampled, probe.sampled)) <= 1e-10, f"request {i}"


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(name, prefix_caching, events, monkeypatch):
    """Chunked prefill, 4 prompt tokens an iteration: S (7 tokens) and L (27) admitted together, S
    first; S's prefill ends in the 2nd iteration and it decodes all its tokens while L's prefill goes
    on 4 tokens at a time; then P, L's first 20 tokens and its own, finds them cached and prefills
    its last 5 in two chunks from slot 20 (without prefix caching, all 25 from slot 0). Each request
    gives what it gives alone."""
    tp, _ = tp_and_reference()
    model = _model(name, tp)
    engine, chunks = Engine(model, ByteTokenizer()), _prefill_passes(monkeypatch)
    long_prompt = [int(i) for i in np.random.default_rng(3).integers(0, 256, 27)]
    short, long = Request(PROMPTS[2], 6), Request(long_prompt, 3)
    later = Request(long_prompt[:20] + [250, 251, 252, 253, 254], 2)
    assert long_prompt[20] != 250
    due = [(1, short), (1, long), (40, later)]
    for _, request in due:
        events.watch(request)
    ContinuousBatcher(engine, 2, prefix_caching=prefix_caching, chunk_tokens=4).run(
        Script(due) if tp.rank == 0 else None
    )
    order = list(events)
    # (prompts, tokens) and first slot of each pass: S 4 + 3, then L 1 + 4 a time with the budget's rest, P 4 + 1
    p_chunks = (
        [((1, 4), 20), ((1, 1), 24)] if prefix_caching else [((1, 4), s) for s in range(0, 24, 4)] + [((1, 1), 24)]
    )
    assert chunks == (
        [((1, 4), 0), ((1, 3), 4), ((1, 1), 0)] + [((1, 4), s) for s in range(1, 25, 4)] + [((1, 2), 25)] + p_chunks
    )
    for request in (short, long, later):
        _agrees_with_alone(engine, request, events)
    if tp.rank == 0:
        assert order.index(long) > len(order) - 1 - order[::-1].index(short)  # S done before L's first token
        assert later.done[0].cached_tokens == (20 if prefix_caching else 0) and long.done[0].cached_tokens == 0


def test_a_request_cancelled_during_its_chunked_prefill_frees_its_row_at_once(events, monkeypatch):
    """One row, prefill chunks of 4: a 27-token prompt whose client is gone from the start is dropped
    after its first chunk, answered "cancelled" with no tokens, and the waiting request takes the row."""
    tp, _ = tp_and_reference()
    model = _model("gpt2", tp)
    engine, passes = Engine(model, ByteTokenizer()), _prefill_passes(monkeypatch)
    long_prompt = [int(i) for i in np.random.default_rng(3).integers(0, 256, 27)]
    gone, waiting = Request(long_prompt, 5, cancel_after=0), Request(PROMPTS[2], 3)
    due = [(1, gone), (1, waiting)]
    for _, request in due:
        events.watch(request)
    ContinuousBatcher(engine, 1, chunk_tokens=4).run(Script(due) if tp.rank == 0 else None)
    assert passes == [((1, 4), 0), ((1, 4), 0), ((1, 3), 4)]  # its first chunk, then the waiting one's two
    _agrees_with_alone(engine, waiting, events)
    if tp.rank == 0:
        assert gone.done[0].finish_reason == "cancelled" and gone.done[0].ids == [] and not gone.sampled


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_the_same_prompt_admitted_twice_is_prefilled_once(prefix_caching, events):
    """The n choices of one API request arrive together with one prompt: the first prefills it, the
    others wait one iteration and copy its K/V (all but the last token), each giving what it gives alone."""
    tp, _ = tp_and_reference()
    engine = Engine(_model("llama-gqa", tp), ByteTokenizer())
    choices = [Request(PROMPTS[2], 4) for _ in range(3)]
    other = Request(PROMPTS[0], 3)
    _serve(tp, "llama-gqa", 4, [(1, c) for c in choices] + [(1, other)], events, prefix_caching, engine)
    for request in choices + [other]:
        _agrees_with_alone(engine, request, events)
    if tp.rank == 0:
        shared = len(PROMPTS[2]) - 1 if prefix_caching else 0
        assert [c.done[0].cached_tokens for c in choices] == [0, shared, shared]
        assert other.done[0].cached_tokens == 0
