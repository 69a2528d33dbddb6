"""tokenizer.TextSoFar: a growing sequence's text, decoded a few tokens at a time, equals decoding the
whole sequence after every token, for the decoders published models use (byte-level BPE, SentencePiece
with byte fallback, WordPiece with its clean-up), cut multi-byte characters and special tokens
included; and it decodes only a few tokens a step, not the whole sequence."""

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from hpc_tp.tokenizer import ByteTokenizer, HFTokenizer, TextSoFar

TEXTS = [
    "Hello world, this is a plain sentence.",
    "Caf\u00e9 cr\u00e8me \u2014 na\u00efve r\u00e9sum\u00e9; \u00fcber Stra\u00dfe.",
    "\u6f22\u5b57\u3068\u304b\u306a\u3001\u4e2d\u6587\u5b57\u7b26 and \U0001f600\U0001f680 emoji!",
    "  leading spaces, double  spaces, tabs\tand\nnew lines\n\n",
    "don't stop: it's a test . , ! ? ( x ) [ y ]",
]


def _trained(model, trainer, pre, decoder, normalizer=None) -> HFTokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer, tok.decoder = pre, decoder
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(TEXTS * 20, trainer)
    return HFTokenizer(tok)


def byte_level_bpe():  # GPT-2, Llama 3, SmolLM2, Qwen
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    return _trained(models.BPE(), trainer, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())


def sentencepiece_byte_fallback():  # Llama 2, Mistral, Gemma: "\u2581" for spaces, bytes as <0xNN>
    # single characters and a few pieces; CJK and emoji are not in it, so they come as byte tokens
    # cut mid-character
    pieces = ["</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581"]
    pieces += sorted({c for t in TEXTS for c in t if c.isascii() or c.isalpha() and ord(c) < 0x3000} - {" "})
    pieces += ["\u2581t", "\u2581th", "\u2581the", "is", "\u2581is"]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("i", "s"), ("\u2581", "is")]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["</s>"])
    return HFTokenizer(tok)


def wordpiece():  # BERT: "##" joins, and a clean-up of spaces before punctuation
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    return _trained(
        models.WordPiece(unk_token="[UNK]"), trainer, pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    )


TOKENIZERS = {
    "bytes": ByteTokenizer,
    "byte-level BPE": byte_level_bpe,
    "SentencePiece, byte fallback": sentencepiece_byte_fallback,
    "WordPiece": wordpiece,
}


def _sequences(tokenizer, texts=TEXTS):
    ids = [tokenizer.encode(text) for text in texts]
    special = sorted(tokenizer.stop_ids | getattr(tokenizer, "special_ids", frozenset()))
    together = [i for seq in ids for i in (*seq, *special[:1])]  # the texts run on, a special token between
    return [*ids, together]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_text_after_every_token_is_the_whole_decode(name):
    tokenizer = TOKENIZERS[name]()
    for ids in _sequences(tokenizer):
        text = TextSoFar(tokenizer)
        for n, token in enumerate(ids, 1):
            assert text.add(token) == tokenizer.decode(ids[:n]), (name, n)


def test_a_character_cut_between_tokens_shows_as_u_fffd_until_its_last_byte():
    text, euro = TextSoFar(ByteTokenizer()), "\u20ac".encode()
    assert [text.add(b) for b in b"a" + euro] == ["a", "a\ufffd", "a\ufffd", "a\u20ac"]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_each_token_decodes_a_few_tokens_not_the_whole_sequence(name):
    # Not where SentencePiece's byte tokens cut a character: its decoder shows a whole run of byte
    # tokens as U+FFFD until every character in it is whole, so the text there is the whole decode's.
    tokenizer = TOKENIZERS[name]()
    texts = [t for t in TEXTS if all(c.isascii() or ord(c) < 0x3000 for c in t)]
    lengths = []
    decode = tokenizer.decode
    tokenizer.decode = lambda ids: lengths.append(len(ids)) or decode(ids)
    text, ids = TextSoFar(tokenizer), _sequences(tokenizer, texts)[-1]
    for token in ids:
        text.add(token)
    # the longest window is the longest run of tokens that ends inside a character, plus one run
    assert len(ids) > 50 and len(lengths) >= len(ids) and max(lengths) <= 12, (len(ids), max(lengths))
