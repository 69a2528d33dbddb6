"""What a JSON-schema grammar adds to each token a row samples (``serve.structured.TokenMask``): the
mask's computation and its application to the row's logits, then the matcher's advance, against
sampling alone, alternating in one run, for a tokenizer given as a tokenizer.json (or the byte one).

    python benchmarks/grammar_mask.py [--tokenizer bytes|PATH] [--rounds 7] [--answers 20]

Each round samples ``--answers`` whole answers to a small object schema from random logits
(greedy over the allowed tokens: a fixed seed each answer, so both ways pick the same tokens), once
with the mask and once timing ``next_token`` on the same logits without it. Prints one JSON line a
round and the medians: microseconds a token with the grammar and without, and the tokens counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy

from hpc_tp.serve.sampling import SamplingParams, next_token
from hpc_tp.serve.structured import Grammar, vocabulary
from hpc_tp.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    },
}


def answer(grammar, tokenizer, seed: int, masked: bool) -> tuple[float, int]:
    """Seconds spent choosing tokens for one answer, and how many (the object closes the grammar)."""
    rng, mask, params = numpy.random.default_rng(seed), grammar.mask_for(tokenizer), SamplingParams(temperature=0)
    spent, count = 0.0, 0
    while not mask.complete and count < 256:
        logits = rng.standard_normal(tokenizer.vocab_size)
        start = time.perf_counter()
        if masked:
            mask.accept(next_token(mask.apply(logits), params, rng))
        else:
            next_token(logits, params, rng)
        spent += time.perf_counter() - start
        if not masked:  # the same answer both ways: advanced outside the timing
            mask.accept(next_token(mask.apply(logits), params, rng))
        count += 1
    return spent, count


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--answers", type=int, default=20)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    vocabulary(tokenizer)
    print(json.dumps({"vocab": tokenizer.vocab_size, "vocabulary_build_s": round(time.perf_counter() - start, 3)}))
    grammar = Grammar.json_schema(SCHEMA, "schema")
    rows = []
    for r in range(args.rounds):
        row = {}
        for masked in (r % 2 == 0, r % 2 == 1):  # which goes first alternates
            spent, tokens = map(sum, zip(*(answer(grammar, tokenizer, s, masked) for s in range(args.answers))))
            row["masked_us" if masked else "plain_us"] = round(spent / tokens * 1e6, 2)
            row["tokens"] = tokens
        rows.append(row)
        print(json.dumps({"round": r, **row}))
    print(
        json.dumps(
            {
                "median_masked_us": statistics.median(r["masked_us"] for r in rows),
                "median_plain_us": statistics.median(r["plain_us"] for r in rows),
                "tokens": rows[0]["tokens"],
            }
        )
    )


if __name__ == "__main__":
    main()
