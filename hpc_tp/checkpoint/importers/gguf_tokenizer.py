"""A GGUF file's tokenizer as a Hugging Face tokenizer.json, so every command reads one format.

``tokenizer.ggml.model`` "gpt2": byte-level BPE from the tokens and merges (the pre-tokenizer is
GPT-2's; families whose ``tokenizer.ggml.pre`` names another split regex tokenize some rare
strings differently). "llama": SentencePiece BPE with byte fallback; its merges are rebuilt
from the vocabulary and scores the way Hugging Face's own SentencePiece converter does.
Other tokenizer models are not kept (the caller gets None).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

_CONTROL, _USABLE = 3, (1, 4)  # GGUF token types: control; normal and user-defined
_SPACE = "\u2581"  # SentencePiece's visible space


def tokenizer_json(meta) -> bytes | None:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama") or not tokens:
        return None
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
        tokenizer = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_merges_from_scores(tokens, scores, types),
                unk_token=unk,
                byte_fallback=True,
                fuse_unk=True,
            )
        )
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind_of in zip(tokens, types) if kind_of == _CONTROL]
    )
    return tokenizer.to_str().encode()


def _merges_from_scores(tokens, scores, types) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge; a merge ranks by the
    score of the piece it makes (higher first), ties by the ids of its halves."""
    ids = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in _USABLE}
    merges = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                merges.append((-scores[piece_id], ids[left], ids[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]
