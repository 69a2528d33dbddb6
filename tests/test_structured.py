"""Structured output (``serve.structured``): a JSON schema held to by token masks. Random logits
masked by the grammar, over a byte vocabulary and a trained BPE one, always give JSON that validates;
random-weight models asked for a schema answer with JSON that validates, the same tokens at every tp
as with one process (float64), through continuous batching and static batches; a bad
``response_format`` is one line naming the problem."""

import json

import jsonschema
import numpy as np
import pytest
from test_generate import larger_weights
from tp_helpers import tp_and_reference

from hpc_tp.errors import ConfigError
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine
from hpc_tp.serve.http import parse_request
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.serve.structured import Grammar, response_format
from hpc_tp.tokenizer import ByteTokenizer, HFTokenizer

# Bounded everywhere (string lengths, item counts, number ranges), so a whole answer fits a budget.
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "ok"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
        "where": {
            "type": "object",
            "required": ["x"],
            "additionalProperties": False,
            "properties": {"x": {"type": "number"}},
        },
    },
}
CFG = ModelConfig(
    vocab_size=258,
    hidden=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=48,
    max_seq_len=160,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
)


def bpe_tokenizer() -> HFTokenizer:
    """A byte-level BPE trained on JSON-like text: tokens that span several characters (``{"``,
    ``": ``), which the grammar must allow or refuse whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<pad>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    samples = [
        '{"name": "Ann", "age": 31, "tags": ["red"], "ok": true}',
        '{"x": -1.5e3, "y": [null, false]}',
        "plain words, not JSON at all\n",
    ]
    tok.train_from_iterator(samples * 30, trainer)
    return HFTokenizer(tok)


def constrained_sample(grammar: Grammar, tokenizer, seed: int, budget: int = 400) -> str:
    """Tokens drawn at random (random logits, then the mask) until the grammar is complete. Tokens of
    JSON's punctuation get a head start: drawn uniformly among a vocabulary's others, a string would
    close (1 token in ~250) only after hundreds of tokens."""
    rng, mask, ids = np.random.default_rng(seed), grammar.mask_for(tokenizer), []
    punctuation = np.array([set(tokenizer.decode([i])) <= set('{}[]",: ') for i in range(tokenizer.vocab_size)])
    for _ in range(budget):
        logits = mask.apply(rng.standard_normal(tokenizer.vocab_size) * 3 + 4 * punctuation)
        token = int(np.argmax(logits))
        if token == tokenizer.eos_id:
            break
        mask.accept(token)
        ids.append(token)
        if mask.complete:
            break
    else:
        raise AssertionError(f"seed {seed}: no whole answer in {budget} tokens: {tokenizer.decode(ids)!r}")
    return tokenizer.decode(ids)


@pytest.mark.parametrize("make_tokenizer", [ByteTokenizer, bpe_tokenizer], ids=["bytes", "bpe"])
def test_masked_random_logits_always_give_json_that_validates(make_tokenizer):
    tokenizer = make_tokenizer()
    grammar = Grammar.json_schema(PERSON, "schema")
    for seed in range(20):
        jsonschema.validate(json.loads(constrained_sample(grammar, tokenizer, seed)), PERSON)
    any_object = response_format({"type": "json_object"})
    for seed in range(10):
        assert isinstance(json.loads(constrained_sample(any_object, tokenizer, seed)), dict)


def test_the_mask_allows_exactly_what_can_continue_and_forbids_ids_past_the_vocabulary():
    tokenizer = ByteTokenizer()
    mask = Grammar.json_schema({"enum": ["yes", "no"]}, "schema").mask_for(tokenizer)
    assert set(np.flatnonzero(mask.allowed(300))) == {ord('"')}  # 300 > 258: the extra ids are never allowed
    for token in b'"n':
        mask.accept(token)
    assert set(np.flatnonzero(mask.allowed(258))) == {ord("o")} and not mask.complete
    with pytest.raises(ValueError, match="token 120 was not allowed"):
        mask.accept(ord("x"))
    top = Grammar.json_schema({"type": "integer"}, "schema").mask_for(tokenizer)
    top.accept(ord("7"))  # a whole number that could go on: the end of sequence is allowed, not forced
    assert top.allowed(258)[tokenizer.eos_id] and top.allowed(258)[ord("0")] and not top.complete


def _requests(grammar):
    prompts = [list(b"A person: "), list(b"{"), list(b"JSON please\n")]
    params = [
        SamplingParams(max_new_tokens=128, temperature=t, seed=s, grammar=grammar)
        for t, s in ((0.0, None), (1.0, 3), (0.7, 11))
    ]
    return prompts, params


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_schema_request_answers_valid_json_with_the_same_tokens_at_every_tp(batching):
    tp, one = tp_and_reference()
    grammar = response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    prompts, params = _requests(grammar)
    answers = []
    for comm in (tp, one):
        engine = Engine(larger_weights(GPTModel(CFG, comm, seed=4)), ByteTokenizer())
        if batching == "continuous":
            out = ContinuousBatcher(engine, 2).generate(prompts, params)  # 3 requests, 2 rows
            answers.append(None if out is None else [completion for completion, _ in out])
        else:
            out = engine.generate(prompts, params)  # SamplingParams, grammar and all, broadcast from rank 0
            answers.append(None if out is None else out[0])
    if tp.rank == 0:
        for mine, reference in zip(*answers):
            assert mine.finish_reason == "stop" and mine.ids == reference.ids
            jsonschema.validate(json.loads(mine.text), PERSON)


@pytest.mark.mpi(min_size=1)
def test_json_object_answers_a_json_object():
    """Through a BPE vocabulary, whose tokens that close a string (``": ``, ``"}``) a random model
    picks often enough to finish (in 258 bytes a string closes 1 token in ~250); sampled, as this
    random model's greedy answer stays in its first key past the budget (so may a sampled one: these
    seeds finish)."""
    tp, _ = tp_and_reference()
    tokenizer = bpe_tokenizer()
    cfg = ModelConfig(**{**CFG.to_dict(), "vocab_size": tokenizer.vocab_size})
    engine = Engine(larger_weights(GPTModel(cfg, tp, seed=4)), tokenizer)
    grammar = response_format({"type": "json_object"})
    prompts = [tokenizer.encode(p) for p in ("{", "JSON please\n", "x", "name")]
    params = [
        SamplingParams(max_new_tokens=128, temperature=t, seed=s, grammar=grammar)
        for t, s in ((1.0, 3), (0.7, 11), (1.0, 5), (1.0, 6))
    ]
    out = ContinuousBatcher(engine, 3).generate(prompts, params)
    if tp.rank == 0:
        for completion, _ in out:
            assert completion.finish_reason == "stop" and isinstance(json.loads(completion.text), dict)


@pytest.mark.parametrize(
    "value, reason",
    [
        ({"type": "xml"}, "response_format={'type': 'xml'}: expected"),
        ("json", "response_format='json': expected"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema=.*expected"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {}, "strict": "yes"}}, "strict"),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}},
            "must be a JSON schema object, got list",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}}},
            r"schema \(s\): cannot constrain output to this schema: Invalid type: frob",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "(("}}},
            "cannot constrain output to this schema: regex parse error: .*unclosed group",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {"type": "string"}}}},
            "Unimplemented keys",
        ),
    ],
)
def test_a_bad_response_format_is_refused_in_one_line(value, reason):
    body = json.dumps({"prompt": "Hi", "response_format": value}).encode()
    with pytest.raises(ConfigError, match=reason) as refused:
        parse_request(body, ByteTokenizer(), CFG, 16)
    assert "\n" not in str(refused.value)


def test_a_request_carries_its_grammar_and_plain_text_none():
    body = {"prompt": "Hi", "response_format": {"type": "json_object"}}
    assert isinstance(
        parse_request(json.dumps(body).encode(), ByteTokenizer(), CFG, 16).jobs[0].params.grammar, Grammar
    )
    body["response_format"] = {"type": "text"}
    assert parse_request(json.dumps(body).encode(), ByteTokenizer(), CFG, 16).jobs[0].params.grammar is None


def test_a_tokenizer_whose_token_bytes_llguidance_cannot_read_is_refused_at_the_request():
    from tokenizers import Tokenizer, models

    words = HFTokenizer(Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")))  # no decoder
    body = json.dumps({"prompt": "hi", "response_format": {"type": "json_object"}}).encode()
    with pytest.raises(ConfigError, match="llguidance cannot read from this model's tokenizer: .*decoder"):
        parse_request(body, words, CFG, 16)
