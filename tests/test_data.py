"""The data pipeline: tokenizers, the demo addition task, the corpus cache and the sampler."""

import numpy as np
import pytest

from hpc_tp.errors import ConfigError
from hpc_tp.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, load_tokenizer_dir
from hpc_tp.train import data as data_module
from hpc_tp.train.data import DistributedSampler, build_dataset
from hpc_tp.train.tasks import IGNORE, ArithmeticTask

BYTES = ByteTokenizer()


def tiny_hf_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<pad>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["12+34=46\n", "héllo wörld, hello world\n"] * 20, trainer)
    tok.save(str(path))
    return path


# ---- tokenizers ----


def test_byte_tokenizer_round_trip_non_ascii():
    text = "héllo, wörld — 日本 🚀\n"
    ids = BYTES.encode(text)
    assert all(0 <= i < 256 for i in ids) and BYTES.decode(ids) == text
    assert BYTES.decode(ids + [BYTES.eos_id, BYTES.pad_id]) == text  # specials carry no text
    assert BYTES.decode(BYTES.encode("é")[:1]) == "\ufffd"  # a cut character is replaced, not an error
    assert BYTES.vocab_size == 258 and {BYTES.pad_id, BYTES.eos_id} == {256, 257}


def test_hf_tokenizer_round_trip_and_save(tmp_path):
    tok = load_tokenizer(str(tiny_hf_tokenizer(tmp_path / "tokenizer.json")))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok.tokenizer.token_to_id("<|endoftext|>") and tok.pad_id == tok.tokenizer.token_to_id("<pad>")
    text = "héllo 99+1=100\n"
    assert tok.decode(tok.encode(text)) == text

    tok.save(tmp_path / "ckpt")
    again = load_tokenizer_dir(tmp_path / "ckpt")
    assert again.encode(text) == tok.encode(text) and again.identity == tok.identity
    BYTES.save(tmp_path / "bytes")
    assert isinstance(load_tokenizer(str(tmp_path / "bytes")), ByteTokenizer)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="no saved tokenizer"):
        load_tokenizer_dir(tmp_path)


# ---- the addition task ----


def test_task_is_deterministic_and_split_is_disjoint():
    task = ArithmeticTask(digits=2, seed=3)
    train, heldout = task.train_examples(), task.heldout_examples()
    assert train == ArithmeticTask(digits=2, seed=3).train_examples()
    assert train != ArithmeticTask(digits=2, seed=4).train_examples()
    assert len(train) + len(heldout) == 100 * 100 and not set(train) & set(heldout)
    assert 0.05 < len(heldout) / 10_000 < 0.15
    # Fewer examples take a subset of the same split: held-out problems never reach training.
    small = ArithmeticTask(digits=2, seed=3, max_examples=50)
    assert set(small.train_examples()) <= set(train) and len(small.train_examples()) == 50


def test_large_problem_space_is_sampled_disjointly():
    task = ArithmeticTask(digits=5, seed=1, max_examples=2000)
    train, heldout = task.train_examples(), task.heldout_examples()
    assert len(set(train)) == len(set(heldout)) == 2000 and not set(train) & set(heldout)
    assert all(task.check(p, a) for p, a in train[:50])


def test_check():
    task = ArithmeticTask()
    assert task.check("37+58=", "95") and task.check("37+58=", "95\n12+") and task.check("0+0=", "0\n")
    assert not task.check("37+58=", "94") and not task.check("37+58=", "951") and not task.check("37+58=", "")
    reversed_task = ArithmeticTask(reverse_answer=True)
    assert reversed_task.check("37+58=", "59\n") and not reversed_task.check("37+58=", "95")
    assert all(task.check(p, a) for p, a in task.heldout_examples())
    with pytest.raises(ConfigError):
        task.check("hello", "1")


def test_targets_cover_the_answer_only():
    task = ArithmeticTask(max_examples=200)
    ids, targets = task.render(BYTES, seq_len=12)
    assert ids.shape == targets.shape == (200, 12) and ids.dtype == targets.dtype == np.int64
    for row, (prompt, answer) in enumerate(task.train_examples()):
        n = len(prompt)
        assert BYTES.decode(ids[row, :n]) == prompt
        kept = targets[row][targets[row] != IGNORE]
        assert BYTES.decode(kept[:-1]) == answer + "\n" and kept[-1] == BYTES.eos_id
        # The kept targets are exactly the next tokens after the prompt.
        assert (targets[row, n - 1 : n - 1 + len(kept)] == kept).all()
        assert (ids[row, n : n + len(kept) - 1] == kept[:-1]).all()
        assert (targets[row, : n - 1] == IGNORE).all()


def test_seq_len_too_short():
    ArithmeticTask().render(BYTES, seq_len=10)  # "99+99=198\n" + eos: 11 tokens, the last only a target
    with pytest.raises(ConfigError, match="seq_len=9 is too short"):
        ArithmeticTask().render(BYTES, seq_len=9)
    with pytest.raises(ConfigError, match="digits"):
        ArithmeticTask(digits=0)


def test_demo_dataset(tmp_path):
    dataset = build_dataset("demo", 16, BYTES, tmp_path, digits=1)
    assert len(dataset) == len(ArithmeticTask(digits=1).train_examples())
    ids, targets = dataset.get(np.array([0, 3]))
    assert ids.shape == targets.shape == (2, 16)
    with pytest.raises(ConfigError, match="demo task"):
        build_dataset(None, 16, BYTES, tmp_path, colour="red")


# ---- corpus and cache ----


def test_corpus_windows_and_cache_reuse(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world\n" * 5)
    (corpus / "b.txt").write_text("ünïcode text\n" * 3)
    calls = []
    real_write = data_module._write_tokens
    monkeypatch.setattr(data_module, "_write_tokens", lambda *a: (calls.append(1), real_write(*a)))
    barriers = []

    dataset = build_dataset(str(corpus), 8, BYTES, tmp_path / "cache", barrier=lambda: barriers.append(1))
    expected = BYTES.encode("hello world\n" * 5) + [BYTES.eos_id] + BYTES.encode("ünïcode text\n" * 3) + [BYTES.eos_id]
    assert len(dataset) == (len(expected) - 1) // 8 and dataset.tokens.dtype == np.uint16
    ids, targets = dataset.get([0, 2])
    assert ids.dtype == np.int64 and ids[1].tolist() == expected[16:24] and targets[1].tolist() == expected[17:25]
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and calls == [1] and barriers == [1]

    # A second build (any rank) maps the same file; only a changed corpus re-tokenizes.
    mtime = cached[0].stat().st_mtime_ns
    again = build_dataset(str(corpus), 8, BYTES, tmp_path / "cache", rank=1, barrier=lambda: None)
    assert calls == [1] and cached[0].stat().st_mtime_ns == mtime and np.array_equal(again.tokens, dataset.tokens)
    build_dataset(str(corpus), 8, BYTES, tmp_path / "cache")
    assert calls == [1]
    (corpus / "a.txt").write_text("changed\n" * 9)
    build_dataset(str(corpus), 8, BYTES, tmp_path / "cache")
    assert calls == [1, 1] and len(list((tmp_path / "cache").glob("corpus-*.npy"))) == 2
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_corpus_with_hf_tokenizer(tmp_path):
    tok = load_tokenizer(str(tiny_hf_tokenizer(tmp_path / "tokenizer.json")))
    (tmp_path / "c.txt").write_text("hello world, héllo wörld\n" * 10)
    dataset = build_dataset(str(tmp_path / "c.txt"), 4, tok, tmp_path / "cache")
    assert tok.decode(dataset.tokens[:-1]) == "hello world, héllo wörld\n" * 10


def test_corpus_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing.txt does not exist"):
        build_dataset(str(tmp_path / "missing.txt"), 8, BYTES, tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no .txt files"):
        build_dataset(str(tmp_path / "empty"), 8, BYTES, tmp_path / "cache")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        build_dataset(str(tmp_path / "empty.txt"), 8, BYTES, tmp_path / "cache")
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(ConfigError, match=r"short.txt has 3 tokens.*at least 9"):
        build_dataset(str(tmp_path / "short.txt"), 8, BYTES, tmp_path / "cache")
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    barriers = []
    with pytest.raises(ConfigError, match="not UTF-8"):
        build_dataset(str(tmp_path / "latin1.txt"), 2, BYTES, tmp_path / "cache", barrier=lambda: barriers.append(1))
    assert barriers == [1]  # rank 0 still reached the barrier, so the other ranks are not left waiting
    with pytest.raises(ConfigError, match="demo task only"):
        build_dataset(str(tmp_path / "short.txt"), 1, BYTES, tmp_path / "cache", digits=3)


# ---- the sampler ----


def test_sampler_dp_chunks_union_is_the_dp1_batch():
    full = DistributedSampler(100, 12, seed=5)
    shards = [DistributedSampler(100, 12, dp_rank=r, dp_size=4, seed=5) for r in range(4)]
    for step in range(20):
        chunks = [s.indices(step) for s in shards]
        assert all(len(c) == 3 for c in chunks)
        assert np.array_equal(np.concatenate(chunks), full.indices(step))


def test_sampler_resume_equals_uninterrupted():
    uninterrupted = DistributedSampler(50, 8, seed=2)
    stream = [uninterrupted.indices(step) for step in range(30)]
    resumed = DistributedSampler(50, 8, seed=2)
    assert all(np.array_equal(resumed.indices(step), stream[step]) for step in range(17, 30))


def test_sampler_sees_each_sample_once_per_epoch():
    sampler = DistributedSampler(60, 12, seed=0)
    epochs = [np.concatenate([sampler.indices(5 * e + s) for s in range(5)]) for e in range(3)]
    for seen in epochs:
        assert np.array_equal(np.sort(seen), np.arange(60))
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh order every epoch
    assert sampler.epoch(4) == 0 and sampler.epoch(5) == 1
    # A batch that does not divide the dataset straddles epochs and still drops nothing.
    odd = DistributedSampler(10, 4, seed=1)
    stream = np.concatenate([odd.indices(s) for s in range(5)])
    assert np.array_equal(np.sort(stream[:10]), np.arange(10)) and np.array_equal(np.sort(stream[10:]), np.arange(10))


def test_sampler_errors():
    with pytest.raises(ConfigError, match="global batch 10 .*data-parallel size 4"):
        DistributedSampler(100, 10, dp_rank=0, dp_size=4)
    with pytest.raises(ConfigError, match="dp rank 4"):
        DistributedSampler(100, 8, dp_rank=4, dp_size=4)
    with pytest.raises(ConfigError, match="0 samples"):
        DistributedSampler(0, 8)
