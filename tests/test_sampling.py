"""Logits processors and log-probabilities (``serve.sampling``) against plain references on known
logits, and what a row (``generate._Row``) makes of them: EOS ignored, log-probabilities of the tokens
it keeps, text streamed whole characters at a time."""

import math

import numpy as np
import pytest

from hpc_tp.serve.generate import _Row
from hpc_tp.serve.sampling import SamplingParams, next_token, process_logits, token_logprobs
from hpc_tp.tokenizer import ByteTokenizer

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -0.5, 0.0, 1.5, -2.0])


def test_penalties_match_their_definitions_token_by_token():
    prompt, output = [0, 4], [3, 3, 1, 6, 3]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    want = []
    for token, z in enumerate(LOGITS):
        if token in prompt + output:  # CTRL: divide a positive logit, multiply a negative one
            z = z / 1.5 if z > 0 else z * 1.5
        count = output.count(token)  # OpenAI: only the output's tokens, by count and by presence
        want.append(z - 0.4 * count - 0.3 * (count > 0))
    got = process_logits(LOGITS, params, prompt, output)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(LOGITS[:2], [2.0, -1.0])  # the model's logits are left alone


def test_the_processors_hook_runs_after_the_penalties():
    seen = []

    def mask_all_but_five(z, prompt_ids, output_ids):
        seen.append((z.copy(), list(prompt_ids), list(output_ids)))
        return np.where(np.arange(z.size) == 5, z, -np.inf)

    params = SamplingParams(presence_penalty=1.0, processors=[mask_all_but_five])
    assert params.transforms_logits()
    z = process_logits(LOGITS, params, [1], [3])
    assert next_token(z, params, np.random.default_rng(0)) == 5
    assert seen[0][0][3] == LOGITS[3] - 1.0 and seen[0][1:] == ([1], [3])
    assert not SamplingParams(temperature=0.7, min_p=0.1).transforms_logits()


def test_min_p_keeps_exactly_the_tokens_within_its_ratio_of_the_most_likely():
    temperature, min_p = 0.8, 0.2
    probs = np.exp(LOGITS / temperature) / np.exp(LOGITS / temperature).sum()
    allowed = {i for i, p in enumerate(probs) if p >= min_p * probs.max()}
    assert 1 < len(allowed) < len(LOGITS)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=temperature, min_p=min_p)
    drawn = [next_token(LOGITS, params, rng) for _ in range(2000)]
    assert set(drawn) == allowed
    kept = probs[sorted(allowed)] / probs[sorted(allowed)].sum()  # what is left is renormalised
    freq = np.bincount(drawn, minlength=len(LOGITS))[sorted(allowed)] / len(drawn)
    np.testing.assert_allclose(freq, kept, atol=0.04)


def test_logprobs_are_the_log_softmax_and_its_top_k():
    logprob, top = token_logprobs(LOGITS, 2, 3)
    norm = math.log(sum(math.exp(z) for z in LOGITS))
    assert logprob == pytest.approx(0.5 - norm, abs=1e-14)
    assert [t for t, _ in top] == [3, 0, 6]
    np.testing.assert_allclose([lp for _, lp in top], [3.0 - norm, 2.0 - norm, 1.5 - norm], atol=1e-14)
    assert token_logprobs(LOGITS, 2, 0)[1] == [] and len(token_logprobs(LOGITS, 2, 8)[1]) == 8


def test_a_row_reports_the_models_logprobs_of_the_tokens_it_keeps_and_may_ignore_eos():
    tokenizer = ByteTokenizer()
    logits = np.full(tokenizer.vocab_size, -5.0)
    logits[[ord("a"), tokenizer.eos_id]] = 1.0, 4.0  # EOS is the likeliest
    row = _Row(SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1, presence_penalty=2.0), tokenizer, [97])
    for _ in range(3):
        row.step(logits, 0.0)
    # EOS kept thrice (a penalty only moves it from 4 to 2): the row ends by length, its text empty
    assert row.ids == [tokenizer.eos_id] * 3 and row.finish == "length" and row.text == ""
    want = token_logprobs(logits, tokenizer.eos_id, 1)  # the model's, before the penalty
    assert [(e.token, e.logprob, e.top) for e in row.logprobs] == [(tokenizer.eos_id, *want)] * 3
    stopped = _Row(SamplingParams(max_new_tokens=3), tokenizer)
    stopped.step(logits, 0.0)
    assert stopped.finish == "stop" and stopped.ids == [] and stopped.logprobs is None


def test_a_streamed_row_sends_whole_characters_and_its_offsets_count_them():
    tokenizer = ByteTokenizer()
    row = _Row(SamplingParams(max_new_tokens=6, logprobs=0), tokenizer)
    pieces = []
    for byte in "aé€".encode():
        logits = np.zeros(tokenizer.vocab_size)
        logits[byte] = 1.0
        row.step(logits, 0.0)  # greedy: that byte
        pieces.append(row.new_text())
    assert pieces == ["a", "", "é", "", "", "€"] and row.finish == "length"
    assert [e.text_offset for e in row.logprobs] == [0, 1, 1, 2, 2, 2]  # where each token's character starts
    cut = _Row(SamplingParams(max_new_tokens=2), tokenizer)  # the last token cuts a character: the row ends so
    cut.add(ord("b"))
    assert cut.new_text() == "b"
    cut.add("é".encode()[0])
    assert cut.new_text() == "\ufffd" and cut.finish == "length"


@pytest.mark.mpi(min_size=1)
def test_logprobs_and_penalties_at_every_tp_equal_one_process(comm_world):
    """Rank 0 reports log-probabilities from the logits gathered over the vocabulary-parallel head:
    the same, to float64 rounding, at 1, 2 and 4 ranks as in one process; penalised choices alike."""
    from test_generate import _model

    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.serve.continuous import ContinuousBatcher
    from hpc_tp.serve.generate import Engine

    prompts = [list(b"UUUU"), list(b"tp logprobs "), list(b"x")]
    params = [
        SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=4, logprobs=0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(max_new_tokens=5, logprobs=2, temperature=0.8, min_p=0.05, seed=3),
    ]
    batcher = ContinuousBatcher(Engine(_model("llama-gqa", comm_world), ByteTokenizer()), rows=2)
    got = batcher.generate(prompts, params)
    if comm_world.rank != 0:
        return
    want, _ = Engine(_model("llama-gqa", self_comm()), ByteTokenizer()).generate(prompts, params)
    for (completion, _), expected in zip(got, want):
        assert completion.ids == expected.ids
        assert [(e.token, [t for t, _ in e.top]) for e in completion.logprobs] == [
            (e.token, [t for t, _ in e.top]) for e in expected.logprobs
        ]
        values = [[[e.logprob] + [lp for _, lp in e.top] for e in c.logprobs] for c in (completion, expected)]
        np.testing.assert_allclose(*values, rtol=0, atol=1e-12)
