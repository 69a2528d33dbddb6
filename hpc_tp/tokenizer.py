"""Tokenizers with one small interface: ``encode``, ``decode``, ``vocab_size``, ``eos_id``, ``pad_id``,
``stop_ids``.

``ByteTokenizer`` needs no files (ids 0..255 are UTF-8 bytes, then ``<pad>`` and ``<eos>``);
``HFTokenizer`` wraps a Hugging Face ``tokenizer.json``. ``save(folder)`` writes a
``tokenizer_config.json`` (plus ``tokenizer.json`` for HF) so a checkpoint carries its tokenizer,
and ``load_tokenizer_dir(folder)`` reads it back. A Hugging Face tokenizer imported with a chat model
also keeps its ``chat`` settings there: the chat template and the special tokens it names
(``serve.chat``).

``eos_id`` is the one end-of-sequence id that training appends and padding uses; ``stop_ids`` are every
id that ends a generation: the model's own list (``generation_config.json``'s ``eos_token_id``, GGUF's
eos/eot/eom ids, kept in the saved config as ``eos_token_ids``), the named ``eos_token`` and ``eos_id``.
A chat template's end-of-turn token joins them when a server or ``generate`` renders chats with it.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from .errors import ConfigError

CONFIG_FILE = "tokenizer_config.json"
HF_FILE = "tokenizer.json"
CHAT_KEYS = ("chat_template", "bos_token", "eos_token")  # what a saved tokenizer keeps for chat
EOS_IDS_KEY = "eos_token_ids"  # the model's end-of-sequence ids, as its own files list them

# Special-token spellings of the common model families, most common first.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; a string no encoding can hold (a lone surrogate, as JSON's "\\ud800"
    gives) is the input's error."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"text is not valid Unicode: {e.reason} at character {e.start}") from None


class ByteTokenizer:
    """Byte-level: every UTF-8 string round-trips, and no vocabulary file is needed."""

    kind = "bytes"
    pad_id = 256
    eos_id = 257
    stop_ids = frozenset({eos_id})
    special_ids: frozenset = frozenset()  # no special tokens in text: a template's markers are plain bytes
    vocab_size = 258
    identity = "bytes-v1"
    chat: dict = {}  # no chat template of its own (``hpc-tp serve --chat-template`` gives one)

    def encode(self, text: str) -> list[int]:
        return list(utf8(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        # Special tokens carry no text; a cut multi-byte character decodes as U+FFFD.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, folder):
        _write_config(folder, {"kind": self.kind})


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer; eos/pad are found by their usual names (else None)."""

    kind = "huggingface"

    def __init__(self, tokenizer: Tokenizer, chat: dict | None = None, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.chat = dict(chat or {})  # chat_template, bos_token, eos_token as the model's files gave them
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        named = tokenizer.token_to_id(self.chat["eos_token"]) if self.chat.get("eos_token") else None
        # The model's own word first; the usual spellings only for a tokenizer that names none.
        self.eos_id = next((i for i in (named, *self.eos_token_ids) if i is not None), None)
        if self.eos_id is None:
            self.eos_id = _first_token_id(tokenizer, _EOS_NAMES)
        self.stop_ids = frozenset(i for i in (self.eos_id, *self.eos_token_ids) if i is not None)
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.pad_id = _first_token_id(tokenizer, _PAD_NAMES)
        self.identity = "hf-" + hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    @classmethod
    def from_file(cls, path, chat: dict | None = None, eos_token_ids=()) -> HFTokenizer:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} does not exist (expected a Hugging Face tokenizer.json)")
        try:
            return cls(Tokenizer.from_file(str(path)), chat, eos_token_ids)
        except Exception as e:  # the Rust library raises a bare Exception with its parser message
            raise ConfigError(f"{path} is not a Hugging Face tokenizer.json: {e}") from None

    # Special tokens are the pipeline's business (it appends eos itself), so none are added here.
    def encode(self, text: str) -> list[int]:
        utf8(text)  # the Rust library cannot take a lone surrogate either
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, folder):
        ids = {EOS_IDS_KEY: self.eos_token_ids} if self.eos_token_ids else {}
        _write_config(folder, {"kind": self.kind, "file": HF_FILE, **self.chat, **ids})
        self.tokenizer.save(str(Path(folder) / HF_FILE))


class TextSoFar:
    """``tokenizer.decode(ids)`` of a sequence growing a token at a time, decoding only the tokens since
    its last whole character (decoding all of them each token costs O(length): 343 us at 2000 tokens
    of SmolLM2's tokenizer, for every row of every decode step).

    The text of ``ids[:read]`` is kept; each token decodes ``ids[prefix:]`` and takes what it adds
    after ``ids[prefix:read]``'s own text. The window starts a run back (``prefix`` < ``read``), so a
    decoder that treats the first token of what it decodes differently (SentencePiece's leading space,
    WordPiece's joins) sees the new tokens in context, as in the whole. ``read`` moves on only when
    the text ends in a whole character (not U+FFFD, a byte sequence cut short). Where the window's text
    does not begin with the run's, the decoder rewrote across the boundary and the whole sequence is
    decoded, so the text is the whole decode either way: SentencePiece's byte-fallback decoder does so
    while a character is cut, showing the whole run of byte tokens as U+FFFD until each is whole."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._kept, self._run = "", ""  # the text of ids[:read], and of ids[prefix:read]
        self._prefix = self._read = 0

    def add(self, token: int) -> str:
        """The whole text after appending ``token``."""
        self.ids.append(token)
        window = self.tokenizer.decode(self.ids[self._prefix :])
        if not window.startswith(self._run):
            return self.tokenizer.decode(self.ids)
        added = window[len(self._run) :]
        text = self._kept + added
        if added and not added.endswith("\ufffd"):
            self._kept, self._prefix, self._read = text, self._read, len(self.ids)
            self._run = self.tokenizer.decode(self.ids[self._prefix :])  # as the next window begins
        return text


def saved_files(tokenizer) -> dict[str, bytes]:
    """The files ``tokenizer.save`` writes, as bytes: what a checkpoint folder keeps beside its weights."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save(folder)
        return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


def load_tokenizer(spec: str):
    """``"bytes"``, a ``tokenizer.json``, or a folder holding a saved tokenizer (or a tokenizer.json)."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            return load_tokenizer_dir(path)
        return HFTokenizer.from_file(path / HF_FILE)
    if not path.exists():
        raise ConfigError(f"tokenizer {spec!r} not found: expected 'bytes' or a path to a tokenizer.json")
    return HFTokenizer.from_file(path)


def load_tokenizer_dir(folder):
    """The tokenizer a folder (e.g. a checkpoint step) was saved with."""
    config_path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path} not found: the folder has no saved tokenizer") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_path} is not valid JSON: {e}") from None
    kind = config.get("kind")
    if kind == ByteTokenizer.kind:
        return ByteTokenizer()
    if kind == HFTokenizer.kind:
        chat = {key: config[key] for key in CHAT_KEYS if isinstance(config.get(key), str)}
        ids = config.get(EOS_IDS_KEY, [])
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ConfigError(f"{config_path}: {EOS_IDS_KEY} must be a list of token ids, got {ids!r}")
        return HFTokenizer.from_file(Path(folder) / config.get("file", HF_FILE), chat, ids)
    raise ConfigError(f"{config_path}: unknown tokenizer kind {kind!r} (expected 'bytes' or 'huggingface')")


def _first_token_id(tokenizer: Tokenizer, names) -> int | None:
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _write_config(folder, config: dict):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
