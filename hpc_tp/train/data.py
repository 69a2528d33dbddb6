"""Training samples, built once and read by every rank, and the sampler that deals them out.

``build_dataset`` gives the demo task (``spec`` None or ``"demo"``) or a text corpus (a ``.txt``
file or a folder of them). A corpus is tokenized once, by rank 0, into a memory-mapped ``.npy``
in ``cache_dir`` named by a hash of the files and the tokenizer, so a changed file or tokenizer
makes a new cache and an unchanged one is reused by every later run.

``DistributedSampler`` makes the global batch of every optimizer step a pure function of
(seed, step): a resumed run sees the same samples as an uninterrupted one, and dp rank r takes
the r-th contiguous chunk of the batch that dp=1 would see.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .tasks import ArithmeticTask

CACHE_VERSION = 1  # bump when the cache layout changes
_CHUNK_CHARS = 1 << 20  # text per tokenizer call: bounds memory on large files


def check_tokens(tokens: float, step: int):
    """A step's global batch must hold a target token: its loss is a mean over them."""
    if tokens == 0:
        raise ConfigError(f"step {step}: the global batch has no target tokens to learn from")


class TokenDataset(ABC):
    """Fixed-length samples: ``get(indices)`` gives ids and next-token targets (-100 = ignored),
    both int64 ``[len(indices), seq_len]``."""

    seq_len: int

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def get(self, indices) -> tuple[np.ndarray, np.ndarray]: ...


class TaskDataset(TokenDataset):
    """The demo task's train (or held-out) split, one problem per row; ``task`` evaluates answers."""

    def __init__(self, task: ArithmeticTask, tokenizer, seq_len: int, split: str = "train"):
        self.task, self.seq_len = task, seq_len
        self.ids, self.targets = task.render(tokenizer, seq_len, split)

    def __len__(self):
        return len(self.ids)

    def get(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        return self.ids[indices], self.targets[indices]


class CorpusDataset(TokenDataset):
    """Sample i is the window tokens[i*seq_len : i*seq_len + seq_len + 1]: ids its first seq_len, targets its last."""

    def __init__(self, tokens: np.ndarray, seq_len: int, source: str):
        if len(tokens) < seq_len + 1:
            raise ConfigError(
                f"corpus {source} has {len(tokens)} tokens: one sample of seq_len={seq_len} "
                f"needs at least {seq_len + 1}"
            )
        self.tokens, self.seq_len, self.source = tokens, seq_len, source

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def get(self, indices):
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        windows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], dtype=np.int64)
        return windows[:, :-1], windows[:, 1:]


def build_dataset(
    spec, seq_len: int, tokenizer, cache_dir=None, rank: int = 0, barrier=None, **demo_options
) -> TokenDataset:
    """The demo task (``spec`` None/"demo"; ``demo_options`` go to ``ArithmeticTask``) or a text corpus.

    Every rank calls this with the same arguments; ``barrier`` (e.g. the communicator's) is called
    once by every rank for a corpus, after rank 0 has written the cache.
    """
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len}: expected a positive number of tokens")
    if spec in (None, "demo"):
        try:
            task = ArithmeticTask(**demo_options)
        except TypeError as e:
            raise ConfigError(f"bad demo task option: {e}") from None
        return TaskDataset(task, tokenizer, seq_len)
    if demo_options:
        raise ConfigError(f"options {sorted(demo_options)} apply to the demo task only, not to corpus {spec}")
    if cache_dir is None:
        raise ConfigError(f"corpus {spec} needs a cache_dir for its tokenized copy")
    files = corpus_files(spec)
    cache = Path(cache_dir) / f"corpus-{_cache_key(files, tokenizer)}.npy"

    # Rank 0 must reach the barrier even when tokenizing fails, or the other ranks wait forever.
    failure = None
    if rank == 0 and not cache.exists():
        try:
            _write_tokens(files, tokenizer, cache)
        except Exception as e:
            failure = e
    if barrier is not None:
        barrier()
    if failure is not None:
        raise failure
    if not cache.exists():
        raise ConfigError(
            f"tokenized corpus {cache} not found after rank 0 built it: "
            f"rank 0 failed (see its error) or cache_dir is not visible to every rank"
        )
    return CorpusDataset(np.load(cache, mmap_mode="r"), seq_len, str(spec))


def corpus_files(spec) -> list[Path]:
    """A ``.txt`` file, or every ``.txt`` file under a folder in path order; at least one non-empty."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise ConfigError(f"corpus folder {path} has no .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"corpus {path} does not exist: expected 'demo', a .txt file or a folder of .txt files")
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"corpus {path} is empty: expected UTF-8 text")
    return files


def _cache_key(files: list[Path], tokenizer) -> str:
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    blob = json.dumps([CACHE_VERSION, tokenizer.identity, stats]).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _write_tokens(files: list[Path], tokenizer, cache: Path):
    """Tokenize each file (eos after each when the tokenizer has one) into ``cache``, atomically."""
    end = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    pieces = []
    for f in files:
        for chunk in _read_chunks(f):
            pieces.extend(np.asarray(ids, dtype=np.uint32) for ids in tokenizer.encode_batch(chunk))
        pieces.append(np.asarray(end, dtype=np.uint32))
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    cache.parent.mkdir(parents=True, exist_ok=True)
    temp = cache.with_name(f".tmp-{os.getpid()}-{cache.name}")
    try:
        out = np.lib.format.open_memmap(temp, mode="w+", dtype=dtype, shape=(sum(len(p) for p in pieces),))
        at = 0
        for piece in pieces:
            out[at : at + len(piece)] = piece
            at += len(piece)
        out.flush()
        del out
        os.replace(temp, cache)
    finally:
        temp.unlink(missing_ok=True)


def _read_chunks(path: Path):
    """Batches of whole lines of about _CHUNK_CHARS characters (tokenizers split at whitespace anyway)."""
    batch, size = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                batch.append(line)
                size += len(line)
                if size >= _CHUNK_CHARS:
                    yield ["".join(batch)]
                    batch, size = [], 0
    except UnicodeDecodeError as e:
        raise ConfigError(f"corpus file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if batch:
        yield ["".join(batch)]


class DistributedSampler:
    """Sample indices of each optimizer step for one data-parallel rank.

    The sample stream is epoch 0's permutation, then epoch 1's, ... (each seeded by (seed, epoch));
    step k takes the global batch at stream positions [k*B, (k+1)*B), and dp rank r its r-th chunk.
    A batch may straddle an epoch boundary, so every sample is seen once per epoch and no
    sample is dropped, whatever B and the dataset size.
    """

    def __init__(self, num_samples: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if num_samples < 1:
            raise ConfigError(f"dataset has {num_samples} samples: expected at least one")
        if global_batch < 1 or dp_size < 1 or global_batch % dp_size:
            raise ConfigError(f"global batch {global_batch} is not a positive multiple of data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp rank {dp_rank} is outside 0..{dp_size - 1}")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.local_batch = global_batch // dp_size
        self.dp_rank = dp_rank
        self._permutations: dict[int, np.ndarray] = {}

    def epoch(self, step: int) -> int:
        """The epoch step's first sample belongs to."""
        return step * self.global_batch // self.num_samples

    def indices(self, step: int) -> np.ndarray:
        start = step * self.global_batch + self.dp_rank * self.local_batch
        positions = np.arange(start, start + self.local_batch, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(self.local_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))[offsets[mask]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            # Keep only the newest: steps move forward, and a batch spans few epochs.
            self._permutations = {e: p for e, p in self._permutations.items() if e == epoch - 1}
            self._permutations[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._permutations[epoch]
