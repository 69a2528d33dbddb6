"""Pipeline-parallel inference (``serve.stages``): at pp = 2 (2 ranks) and tp = 2 x pp = 2 (4 ranks) a
static batch and the continuous batcher give one process's tokens and logits (float64, 1e-10), with
tied and untied heads, learned positions and RoPE, sliding-window and MoE layers, and a KV pool small
enough to preempt on stages of different layers; every position's logits reach the sampling rank
alone; ``hpc-tp generate
--pp`` writes one process's completions, replicas included; ``hpc-tp serve --pp 2`` answers the OpenAI
client as one process would; a layout that does not fit is one ConfigError line on every rank."""

import json
from types import SimpleNamespace

import numpy as np
import openai
import pytest
from test_generate import PROMPTS, _model, write_checkpoint
from test_serve import serving
from tp_helpers import max_rel_err

from hpc_tp.cli import main
from hpc_tp.comm.mpi import self_comm
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.models import ModelConfig
from hpc_tp.serve import continuous, generate
from hpc_tp.serve.blocks import PagedLayout
from hpc_tp.serve.continuous import ContinuousBatcher
from hpc_tp.serve.generate import Engine, left_pad
from hpc_tp.serve.kv_cache import KVCache, PagedKVCache
from hpc_tp.serve.loading import check_layout, load_for_inference
from hpc_tp.serve.sampling import SamplingParams
from hpc_tp.serve.stages import PipelineStages
from hpc_tp.tokenizer import ByteTokenizer

# gpt2: tied head (the last stage's own copy of the embedding), learned positions; llama-window: a
# sliding-window stage before a global one (the stages must free KV blocks alike); qwen-moe: 3 layers
# over 2 stages, experts
NAMES = ["gpt2", "llama-gqa", "llama-window", "qwen-moe"]
NEW_TOKENS = [5, 3, 6, 4]


@pytest.fixture
def logits_seen(monkeypatch):
    """The logits each token was chosen from, by the request's seed (which names it), on the rank that samples."""
    seen, pick = {}, generate.next_token

    def spy(logits, params, rng):
        seen.setdefault(params.seed, []).append(np.array(logits))
        return pick(logits, params, rng)

    monkeypatch.setattr(generate, "next_token", spy)
    return seen


def _pipelined(comm, folder, name, pp_layers=None):
    """(grid, PipelineStages) of checkpoint ``name``, written in ``folder`` by every rank, loaded at pp = 2
    and tp = the rest of ``comm``, as ``hpc-tp generate --pp 2 [--pp-layers PP_LAYERS]`` loads it."""
    ckpt = write_checkpoint(folder / name, name, ProcessGrid(tp=comm.size, world=comm), ByteTokenizer())
    args = SimpleNamespace(ckpt=str(ckpt), tp=None, pp=2, pp_layers=pp_layers, dtype="float64", device="cpu")
    grid, model, _ = load_for_inference(args)
    return grid, model


def _params():
    return [SamplingParams(max_new_tokens=n, seed=i) for i, n in enumerate(NEW_TOKENS)]


def _agree(comm, failures: list[str]):
    """Every rank the same verdict: the sampling rank's findings."""
    failures = comm.bcast_object(failures)
    assert not failures, failures


def _compare(got_completions, got_logits, want_completions, want_logits) -> list[str]:
    failures = []
    for i, (got, want) in enumerate(zip(got_completions, want_completions)):
        if (got.ids, got.finish_reason) != (want.ids, want.finish_reason):
            failures.append(f"prompt {i}: tokens {got.ids} {got.finish_reason}, one process {want.ids}")
        errors = [max_rel_err(g, w) for g, w in zip(got_logits[i], want_logits[i])]
        if len(got_logits[i]) != len(want_logits[i]) or max(errors) > 1e-10:
            failures.append(f"prompt {i}: logits off by {max(errors):.2e} over {len(got_logits[i])} tokens")
    return failures


def _one_process(name, logits_seen):
    """One process's completions and logits of every prompt, each alone."""
    engine = Engine(_model(name, self_comm()), ByteTokenizer())
    completions = [engine.generate([p], [params])[0][0] for p, params in zip(PROMPTS, _params())]
    logits = {seed: logits_seen.pop(seed) for seed in range(len(PROMPTS))}
    return completions, logits


@pytest.mark.mpi(min_size=2)
def test_every_positions_logits_reach_the_sampling_rank(comm_world, shared_dir):
    """``infer(all_positions=True)`` through the stages: a prefill and two decode steps' logits at every
    position are one process's, on the group's rank 0 alone."""
    _, model = _pipelined(comm_world, shared_dir, "llama-gqa")
    reference = _model("llama-gqa", self_comm())
    tokens, key_mask, positions = left_pad(PROMPTS, 2, pad_id=0)
    width, lens = tokens.shape[1], np.array([len(p) for p in PROMPTS])
    caches = [KVCache.for_model(m, len(PROMPTS), width + 2) for m in (model, reference)]
    calls = [(tokens, positions, key_mask[:, :width])]
    for step in range(2):
        key_mask[:, width + step] = True
        calls.append((np.full((len(PROMPTS), 1), 7 + step), (lens + step)[:, None], key_mask[:, : width + step + 1]))
    failures = []
    for ids, pos, mask in calls:
        got = model.infer(ids, pos, mask, caches[0], all_positions=True)
        want = reference.infer(ids, pos, mask, caches[1], all_positions=True)
        if (got is None) != (model.comm.rank != 0):
            failures.append(f"rank {model.comm.rank} got logits {None if got is None else got.shape}")
        elif got is not None and max_rel_err(got, want) > 1e-10:
            failures.append(f"logits of {ids.shape[1]} positions off by {max_rel_err(got, want):.2e}")
    _agree(model.comm, sum(model.comm.allgather_object(failures), []))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", NAMES)
def test_static_batch_at_pp_2_gives_one_process_tokens_and_logits(name, comm_world, shared_dir, logits_seen):
    grid, model = _pipelined(comm_world, shared_dir, name)
    assert isinstance(model, PipelineStages) and grid.pp_size == 2 and grid.tp_size == comm_world.size // 2
    assert len(model.layers) < model.cfg.n_layers  # each stage holds only its own layers
    out = Engine(model, ByteTokenizer()).generate(PROMPTS if model.comm.rank == 0 else None, _params())
    failures = []
    if model.comm.rank == 0:
        got_logits = {seed: logits_seen.pop(seed) for seed in range(len(PROMPTS))}
        failures = _compare(out[0], got_logits, *_one_process(name, logits_seen))
    _agree(model.comm, failures)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fixed_steps", [None, True], ids=["eager-steps", "bucketed-steps"])
@pytest.mark.parametrize("block_size", [1, 16], ids=["block1", "block16"])
@pytest.mark.parametrize("name", NAMES)
def test_continuous_batcher_at_pp_2_gives_one_process_tokens_and_logits(
    name, block_size, fixed_steps, comm_world, shared_dir, logits_seen, monkeypatch
):
    """Also with the decode steps at their buckets' fixed shapes (``decoding.PagedSteps``), whose
    logits only the sampling rank receives."""
    monkeypatch.setattr(continuous, "KV_BLOCK_SIZE", block_size)
    _, model = _pipelined(comm_world, shared_dir, name)
    batcher = ContinuousBatcher(
        Engine(model, ByteTokenizer()), rows=2, fixed_steps=fixed_steps
    )  # prompts wait for a row
    out = batcher.generate(PROMPTS, _params())
    assert not any(batcher.blocks.refs)  # every block given back, on every stage alike
    failures = []
    if model.comm.rank == 0:
        got_logits = {seed: logits_seen.pop(seed) for seed in range(len(PROMPTS))}
        failures = _compare([c for c, _ in out], got_logits, *_one_process(name, logits_seen))
    _agree(model.comm, failures)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", ["1,2", "2,1"])
def test_an_explicit_layer_split_gives_one_process_tokens_and_logits(split, comm_world, shared_dir, logits_seen):
    """qwen-moe's 3 layers cut by ``--pp-layers``: each stage holds the layers the split names."""
    _, model = _pipelined(comm_world, shared_dir, "qwen-moe", pp_layers=split)
    counts = [int(c) for c in split.split(",")]
    assert len(model.layers) == counts[model.stage.layer_ids[0] > 0]  # the first stage holds layer 0
    out = ContinuousBatcher(Engine(model, ByteTokenizer()), rows=2).generate(PROMPTS, _params())
    failures = []
    if model.comm.rank == 0:
        got_logits = {seed: logits_seen.pop(seed) for seed in range(len(PROMPTS))}
        failures = _compare([c for c, _ in out], got_logits, *_one_process("qwen-moe", logits_seen))
    _agree(model.comm, failures)


@pytest.mark.mpi(min_size=2)
def test_a_small_kv_cache_preempts_alike_on_stages_of_different_layers(comm_world, shared_dir, logits_seen):
    """qwen-moe's 3 layers over 2 stages: --kv-cache-memory buys every rank the blocks of the stage with
    the most layers, so the block tables, and the preemptions, stay the same on both."""
    _, model = _pipelined(comm_world, shared_dir, "qwen-moe")
    assert len(set(model.comm.allgather_object(len(model.layers)))) == 2
    most = max(model.comm.allgather_object(PagedKVCache.unit_bytes(model, PagedLayout.of(model.cfg, 4))))
    # 4 blocks of 4 tokens and the scratch one: 2 rows of up to 12 tokens need 6, so requests are preempted
    engine = Engine(model, ByteTokenizer())
    batcher = ContinuousBatcher(engine, rows=2, block_size=4, kv_cache_memory=5 * most / 2**30)
    assert model.comm.allgather_object(batcher.blocks.usable) == [4] * model.comm.size
    out = batcher.generate(PROMPTS, _params())
    failures = []
    if model.comm.rank == 0:
        if not any(c.preemptions for c, _ in out):
            failures.append("no request was preempted")
        got_logits = {seed: logits_seen.pop(seed) for seed in range(len(PROMPTS))}
        failures += _compare([c for c, _ in out], got_logits, *_one_process("qwen-moe", logits_seen))
    _agree(model.comm, failures)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("flags", [["--pp", "2"], ["--pp", "2", "--tp", "1"]], ids=["pp2", "pp2-tp1"])
def test_generate_command_at_pp_2_writes_one_process_completions(flags, comm_world, shared_dir):
    ckpt = write_checkpoint(shared_dir / "ckpt", "llama-gqa", ProcessGrid(tp=comm_world.size, world=comm_world))
    texts = ["Hello", "pipeline stages", "x", "a longer prompt than others", "ok"]
    if comm_world.rank == 0:
        (shared_dir / "in.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    comm_world.barrier()
    out = shared_dir / "out.jsonl"
    args = ["generate", "--ckpt", str(ckpt), "--prompts", str(shared_dir / "in.jsonl"), "--out", str(out)]
    assert main(args + ["--max-new-tokens", "5", "--batch-size", "2", "--dtype", "float64", *flags]) == 0
    comm_world.barrier()
    got = [json.loads(line) for line in out.read_text().splitlines()]
    want, _ = Engine(_model("llama-gqa", self_comm()), ByteTokenizer()).generate(
        [list(t.encode()) for t in texts], [SamplingParams(max_new_tokens=5)] * len(texts)
    )
    assert [g["completion"] for g in got] == [w.text for w in want]
    group = 2 if "--tp" in flags else comm_world.size  # a replica's ranks: tp x pp
    assert len(got[0]["batch"]["kv_cache_bytes_per_rank"]) == group


@pytest.mark.mpi(min_size=1)
def test_a_layout_that_does_not_fit_is_one_line_on_every_rank(comm_world, shared_dir, capsys):
    ckpt = write_checkpoint(shared_dir / "ckpt", "gpt2", ProcessGrid(tp=comm_world.size, world=comm_world))
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "x", "--pp", "3"]) == 2
    error = capsys.readouterr().err.strip()
    ranks = comm_world.size
    expected = f"--pp 3 is more pipeline stages than the model's 2 layers; on {ranks} rank{'s' if ranks > 1 else ''}: "
    _agree(comm_world, [] if error.startswith("hpc-tp: error: " + expected) and "\n" not in error else [error])


@pytest.mark.mpi(min_size=2)
def test_a_layer_split_that_does_not_fit_is_one_line_on_every_rank(comm_world, shared_dir, capsys):
    ckpt = write_checkpoint(shared_dir / "ckpt", "gpt2", ProcessGrid(tp=comm_world.size, world=comm_world))
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "x", "--pp", "2", "--pp-layers", "2,1"]) == 2
    error = capsys.readouterr().err.strip()
    expected = "hpc-tp: error: --pp-layers 2,1 adds up to 3 layers but the model has 2"
    _agree(comm_world, [] if error == expected else [error])


def test_layout_errors_name_the_value_and_the_layouts_that_fit():
    cfg = ModelConfig(hidden=72, n_heads=9, n_kv_heads=3, n_layers=4)
    check_layout(cfg, 3, 2, 12)  # fits: nothing said

    def error(tp, pp, ranks):
        with pytest.raises(ConfigError) as bad:
            check_layout(cfg, tp, pp, ranks)
        return str(bad.value)

    assert error(2, 2, 4) == (
        "9 attention heads with 3 kv heads cannot be split over --tp 2; on 4 ranks: --tp 1 --pp 2 (2 replicas)"
    )
    assert error(3, 5, 6) == (
        "--pp 5 is more pipeline stages than the model's 4 layers; on 6 ranks: --tp 3 (2 replicas), --tp 3 --pp 2 (1 replica)"
    )
    assert error(1, 4, 6) == (
        "6 ranks do not split into replicas of --tp 1 x --pp 4 = 4 ranks; on 6 ranks: --tp 1 (6 replicas), "
        "--tp 3 (2 replicas), --tp 1 --pp 2 (3 replicas), --tp 3 --pp 2 (1 replica), --tp 1 --pp 3 (2 replicas)"
    )


@pytest.mark.parametrize("ranks,flags", [(2, []), (4, ["--tp", "1"])], ids=["pp2", "pp2-2-replicas"])
def test_serve_at_pp_2_answers_the_openai_client_as_one_process(tmp_path, ranks, flags):
    ckpt = write_checkpoint(tmp_path / "ckpt", "llama-gqa", ProcessGrid(tp=1, world=self_comm()), ByteTokenizer())
    engine = Engine(_model("llama-gqa", self_comm()), ByteTokenizer())
    # 2 rows a replica: the 6 prompts of one request fill both replicas of 4 ranks
    layout = ["--pp", "2", *flags, "--max-batch", "2"]
    with serving("--ckpt", str(ckpt), *layout, "--dtype", "float64", "--max-model-len", "31", ranks=ranks) as served:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        prompts = [f"stage {i}" + "ab" * i for i in range(6)]
        answer = client.completions.create(model=name, prompt=prompts, max_tokens=6, temperature=0)
        streamed = client.completions.create(model=name, prompt="streamed", max_tokens=5, temperature=0, stream=True)
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    want, _ = engine.generate(
        [list(p.encode()) for p in [*prompts, "streamed"]],
        [SamplingParams(max_new_tokens=6)] * len(prompts) + [SamplingParams(max_new_tokens=5)],
    )
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == [w.text for w in want[:-1]]
    assert text == want[-1].text
