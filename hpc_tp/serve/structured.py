"""Structured output: a request's JSON schema held to by masking, at every step, the tokens that
would leave it (grammar-constrained decoding).

``response_format`` in OpenAI's shapes — ``{"type": "json_object"}`` (any JSON object) or
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` — becomes a ``Grammar``
(``response_format``), carried by the request's ``SamplingParams``. On tp rank 0, where sampling
happens, each row makes its own ``TokenMask`` from it: before a token is sampled from the row's
logits, the tokens the grammar forbids there get -inf; the token chosen advances the row's matcher;
once the grammar can take nothing more, the row stops (finish reason "stop"), and where it is
complete but could go on (a top-level number), the end-of-sequence token is among those allowed.

The grammar engine is llguidance (the one vLLM and SGLang use): a Rust library with no Python
dependencies that compiles a JSON schema to an incremental parser and computes a token mask over
the tokenizer's own vocabulary, in tens of microseconds a token. It takes a ``tokenizers``
tokenizer.json as is and any other vocabulary as a list of token bytes (the byte tokenizer's 258),
and its masks are plain bytes numpy reads. xgrammar needs torch for its masks and Hugging Face's
``transformers`` for its tokenizer info; outlines-core compiles schemas to regular expressions,
which cannot hold ``json_object``'s nesting to any depth.

JSON is held to its compact layout (no whitespace between tokens, ", " and ": " as separators):
free whitespace lets a weak model spend its max_tokens on newlines before the answer closes, a
failure vLLM's ``disable-any-whitespace`` option exists for. An answer cut by max_tokens is
unfinished JSON (finish reason "length"), as with any server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy

from ..errors import ConfigError

# llguidance's JSON options: compact layout (the module docstring says why); schema keywords it does
# not implement are refused rather than ignored, so what it enforces is what the schema says.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
_LLTOKENIZERS: dict[str, object] = {}  # tokenizer identity -> llguidance's view of it (``vocabulary``)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar in llguidance's serialized form: a string, so it travels with SamplingParams
    wherever they are pickled (``Engine.generate`` broadcasts them)."""

    source: str

    @classmethod
    def json_schema(cls, schema, what: str) -> Grammar:
        """The grammar of JSON documents valid against ``schema`` (a dict); ConfigError naming ``what``
        (the request's field) and the problem where the schema is not one llguidance can enforce."""
        import llguidance

        if not isinstance(schema, dict):
            raise ConfigError(f"{what} must be a JSON schema object, got {type(schema).__name__}")
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ConfigError(f"{what}: not a JSON schema: {_one_line(str(e))}") from None
        problem = llguidance.LLMatcher.validate_grammar(source)
        if problem:
            raise ConfigError(f"{what}: cannot constrain output to this schema: {_one_line(problem)}")
        return cls(source)

    def mask_for(self, tokenizer) -> TokenMask:
        """A fresh matcher at the grammar's start, for one row decoded with ``tokenizer``."""
        return TokenMask(self, tokenizer)


class TokenMask:
    """One row's place in its grammar: which tokens may come next, advanced by each token chosen."""

    def __init__(self, grammar: Grammar, tokenizer):
        import llguidance

        self.matcher = llguidance.LLMatcher(vocabulary(tokenizer), grammar.source, log_level=0)
        if self.matcher.is_error():  # the grammar was checked when the request came in
            raise ValueError(f"grammar rejected by llguidance: {self.matcher.get_error()}")

    def allowed(self, vocab: int) -> numpy.ndarray:
        """Bool [vocab]: the tokens the grammar allows next (ids the tokenizer lacks never are)."""
        bits = numpy.unpackbits(numpy.frombuffer(self.matcher.compute_bitmask(), dtype=numpy.uint8), bitorder="little")
        allowed = numpy.zeros(vocab, dtype=bool)
        allowed[: min(vocab, bits.size)] = bits[:vocab]
        return allowed

    def apply(self, logits) -> numpy.ndarray:
        """``logits`` [V] with every token the grammar forbids next at -inf (a new array)."""
        return numpy.where(self.allowed(len(logits)), logits, -numpy.inf)

    def accept(self, token: int):
        """Advance past ``token``, which ``apply`` allowed."""
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} was not allowed by the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar takes nothing more: the answer is whole."""
        return self.matcher.is_stopped()


def response_format(value) -> Grammar | None:
    """The grammar of a request's ``response_format`` (OpenAI's shapes), None for plain text. A
    schema is enforced whether ``strict`` is true or not (OpenAI only promises it when true)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Grammar.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not (
            isinstance(spec, dict)
            and isinstance(spec.get("name"), str)
            and "schema" in spec
            and set(spec) <= {"name", "schema", "strict", "description"}
            and isinstance(spec.get("strict", False), bool)
        ):
            raise ConfigError(
                f'response_format.json_schema={spec!r}: expected {{"name": string, "schema": '
                'object, "strict": true or false}'
            )
        return Grammar.json_schema(spec["schema"], f"response_format.json_schema.schema ({spec['name']})")
    raise ConfigError(
        f'response_format={value!r}: expected {{"type": "text"}}, {{"type": "json_object"}} '
        'or {"type": "json_schema", "json_schema": {...}}'
    )


def vocabulary(tokenizer):
    """llguidance's view of ``tokenizer``, built once per tokenizer (~0.7 s for 49k tokens): a server
    asks for it while parsing a request, so the decoding loop never waits for it. ConfigError where
    llguidance cannot read the tokens' bytes from a tokenizer."""
    import llguidance

    built = _LLTOKENIZERS.get(tokenizer.identity)
    if built is None:
        try:
            if tokenizer.kind == "huggingface":
                # every stop id (the template's end of turn too) may end a grammar that could go on
                built = llguidance.LLTokenizer(
                    tokenizer.tokenizer.to_str(), eos_token=sorted(tokenizer.stop_ids) or None
                )
            else:
                built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)))
        except ValueError as e:
            raise ConfigError(
                f"structured output needs each token's bytes, which llguidance cannot read from "
                f"this model's tokenizer: {_one_line(str(e))}"
            ) from None
        _LLTOKENIZERS[tokenizer.identity] = built
    return built


class _ByteVocabulary:
    """The byte tokenizer as llguidance reads a vocabulary: each id's bytes, special tokens marked by
    a leading 0xFF (a byte no UTF-8 text holds), and the encoder."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, None
        specials = {tokenizer.pad_id: b"<pad>", tokenizer.eos_id: b"<eos>"}
        self.tokens = [bytes([i]) if i < 256 else b"\xff" + specials[i] for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(specials)

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


def _one_line(message: str) -> str:
    return re.sub(r"\s+", " ", message).strip()
