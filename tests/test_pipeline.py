"""Pipeline parallelism: every tp x pp x dp layout gives the losses and gradients of one process.

At 4 ranks: 1x4x1, 2x2x1 and 1x2x2; at 2 ranks: 1x2x1 (tp x pp x dp). Each layout runs GPipe and
1F1B, without, with selective and with full activation recomputation, with dropout and tied embeddings, on a model
whose layer count pp does not divide (some stages get one layer) and with fewer micro-batches
than stages at pp = 4; the interleaved 1F1B schedule runs the same layouts with 2 virtual stages
per rank (3 and 4 at pp = 2); sequence parallelism and MoE layers go through the pipeline too.
The reference is one process looping over the same micro-batches with the same dropout positions.
"""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from hpc_tp.bench.pipeline import bubble_formula, measure_bubble
from hpc_tp.comm.mpi import self_comm, world
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid
from hpc_tp.models import GPTModel, ModelConfig
from hpc_tp.module import GradArena
from hpc_tp.pipeline import (
    PipelineStats,
    balanced_layers,
    build_stage,
    layers_from_counts,
    model_chunks,
    parse_pp_layers,
    pipeline_forward_backward,
    stage_costs,
    stage_layers,
    stage_ops,
    sync_tied_embeddings,
    tied_copy_names,
)
from hpc_tp.pipeline.schedules import BACKWARD, FORWARD
from hpc_tp.train.grad_sync import GradBucketer
from hpc_tp.train.optim import global_grad_norm
from hpc_tp.verify import gradient_errors

TOL = 1e-9
SEED, STEP = 3, 7
MICRO, SEQ = 2, 6
LAYOUTS = {2: [(1, 2, 1)], 4: [(1, 4, 1), (2, 2, 1), (1, 2, 2)]}  # (tp, pp, dp) by world size
# (tp, pp, dp, virtual stages) by world size, for the interleaved schedule.
INTERLEAVED = {2: [(1, 2, 1, 2), (1, 2, 1, 3), (1, 2, 1, 4)], 4: [(1, 4, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2)]}

# Dropout everywhere, tied embeddings, 5 layers (uneven at pp = 2 and 4).
GPT = ModelConfig(vocab_size=37, hidden=16, n_layers=5, n_heads=2, max_seq_len=8, dropout=0.1, attn_dropout=0.1)
# Llama-style: no tying, RMSNorm, RoPE, SwiGLU, grouped-query attention.
LLAMA = ModelConfig(
    vocab_size=29,
    hidden=16,
    n_layers=4,
    n_heads=2,
    n_kv_heads=1,
    ffn_hidden=24,
    max_seq_len=8,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
)


def layouts():
    return LAYOUTS.get(world().size, [])


def interleaved_layouts():
    return INTERLEAVED.get(world().size, [])


def make_micro_batches(cfg, count, seed=0):
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        ids = rng.integers(0, cfg.vocab_size, size=(MICRO, SEQ))
        targets = rng.integers(0, cfg.vocab_size, size=(MICRO, SEQ))
        targets[0, :2] = -100  # ignored targets: the token count is not simply MICRO * SEQ
        batches.append((ids, targets))
    return batches


def token_scale(batches):
    return 1.0 / sum(int((t != -100).sum()) for _, t in batches)


def reference(cfg, batches):
    """One process, the whole batch, micro-batch by micro-batch at the positions the pipeline uses."""
    model = GPTModel(cfg, self_comm(), dtype="float64", seed=SEED)
    scale, loss, count = token_scale(batches), 0.0, 0
    for index, (ids, targets) in enumerate(batches):
        model.rng.set_position(STEP, index * len(ids))
        loss_sum, tokens, ctx = model.forward(ids, targets)
        model.backward(ctx, scale)
        loss, count = loss + loss_sum, count + tokens
    return model, loss, count


def run_pipeline(cfg, layout, batches, schedule, recompute=False, layers=None, virtual_stages=1):
    """This rank's stage after one step: dp-reduced gradients, tied copies synchronised."""
    tp, pp, dp = layout
    grid = ProcessGrid(tp, pp, dp, world())
    with GradArena(4096) as arena:
        model = build_stage(cfg, grid, "float64", SEED, layers, virtual_stages)
    m = len(batches) // dp
    first = grid.coords.dp * m
    bucketer = GradBucketer(model.state(), grid.dp, arena, average=False)
    bucketer.start()
    final = {}
    params = model.state()

    def on_grads_final(names):
        for name in names:
            assert name not in final, f"{name} reported final twice"
            final[name] = params[name].grad.copy()
        bucketer.mark_ready(*names)

    stats = PipelineStats()
    loss, count = pipeline_forward_backward(
        model,
        batches[first : first + m],
        grid,
        token_scale(batches),
        schedule,
        recompute,
        on_grads_final,
        step=STEP,
        first_sample=first * len(batches[0][0]),
        stats=stats,
    )
    bucketer.finish()
    # Reported gradients were already final: the buckets (summed in place) hold the sums of what was reported.
    assert sorted(final) == sorted(params)
    for name in sorted(final):
        np.testing.assert_allclose(
            params[name].grad,
            grid.dp.all_reduce(final[name]),
            rtol=1e-14,
            atol=0,
            err_msg=f"{name} changed after it was reported final",
        )
    sync_tied_embeddings(model, grid)
    return grid, model, loss, count, stats


def check_against_reference(cfg, batches, grid, model, loss, count):
    ref, ref_loss, ref_count = reference(cfg, batches)
    total = grid.dp.all_reduce_scalar(loss)
    assert abs(total - ref_loss) <= TOL * abs(ref_loss), (total, ref_loss)
    assert int(grid.dp.all_reduce_scalar(count)) == ref_count
    # Every parameter lives on some stage (and only there, save the tied embedding copy).
    names = set().union(*grid.world.allgather_object([n for n, _ in model.named_parameters()]))
    assert names == {n for n, _ in ref.named_parameters()}
    for name, err in gradient_errors(model, ref, grid.tp).items():
        assert err <= TOL, f"stage {grid.coords.pp}: {name} relative error {err:.2e}"
    # The global norm counts the tied matrix once, as one process does.
    ref_norm = math.sqrt(sum(float((p.grad**2).sum()) for p in ref.parameters()))
    norm = global_grad_norm(model.state(), grid, tied_copy_names(model, grid))
    assert abs(norm - ref_norm) <= TOL * ref_norm, (norm, ref_norm)


# -- multi-rank: pipeline == one process ---------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_one_process(schedule, recompute):
    for layout in layouts():
        batches = make_micro_batches(GPT, 3 * layout[2])  # 3 micro-batches per dp rank: fewer than pp = 4
        grid, model, loss, count, _ = run_pipeline(GPT, layout, batches, schedule, recompute)
        check_against_reference(GPT, batches, grid, model, loss, count)


# Interleaved: 9 layers in pp * V chunks (uneven at every V), 2 * pp micro-batches per dp rank.
GPT9 = dataclasses.replace(GPT, n_layers=9)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("recompute", [False, True])
def test_interleaved_pipeline_matches_one_process(recompute):
    for tp, pp, dp, v in interleaved_layouts():
        batches = make_micro_batches(GPT9, 2 * pp * dp)
        grid, model, loss, count, _ = run_pipeline(GPT9, (tp, pp, dp), batches, "1f1b", recompute, virtual_stages=v)
        chunks = balanced_layers(GPT9, pp, virtual_stages=v)
        assert [[model.layer_ids[p] for p in c] for c in model_chunks(model)] == [
            list(c) for c in chunks[grid.coords.pp :: pp]
        ]
        check_against_reference(GPT9, batches, grid, model, loss, count)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule, virtual_stages", [("gpipe", 1), ("1f1b", 1), ("1f1b", 2)])
def test_untied_llama_one_micro_batch_explicit_split(schedule, virtual_stages):
    for layout in layouts():
        pp, cfg = layout[1], LLAMA
        if virtual_stages == 1:
            layers = parse_pp_layers("3,1" if pp == 2 else "1,1,1,1", LLAMA.n_layers, pp)
            batches = make_micro_batches(LLAMA, layout[2], seed=1)  # one micro-batch per dp rank
        else:  # pp micro-batches per dp rank: the fewest the interleaved schedule takes
            cfg = dataclasses.replace(LLAMA, n_layers=2 * pp + 1)
            layers = parse_pp_layers(",".join(["2"] + ["1"] * (2 * pp - 1)), cfg.n_layers, pp, virtual_stages)
            batches = make_micro_batches(cfg, pp * layout[2], seed=1)
        grid, model, loss, count, _ = run_pipeline(
            cfg, layout, batches, schedule, layers=layers, virtual_stages=virtual_stages
        )
        assert list(model.layer_ids) == [i for r in layers[grid.coords.pp :: pp] for i in r]
        assert tied_copy_names(model, grid) == frozenset()
        check_against_reference(cfg, batches, grid, model, loss, count)


# Sequence parallelism: stages exchange sequence shards [B, T/tp, H] (a whole-sequence message would not fit
# the receive buffers); the MoE layers on the way gather the sequence for their tensor-parallel experts.
SP_GPT = dataclasses.replace(GPT, sequence_parallel=True)
SP_MOE = dataclasses.replace(SP_GPT, num_experts=4, top_k=2, moe_every=2, capacity_factor=1.0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("virtual_stages", [1, 2])
@pytest.mark.parametrize("cfg", [SP_GPT, SP_MOE], ids=["sequence-parallel", "sequence-parallel-moe"])
def test_sequence_parallel_pipeline_matches_one_process(cfg, virtual_stages):
    for layout in layouts():
        if layout[1] * virtual_stages > cfg.n_layers:
            continue
        batches = make_micro_batches(cfg, 3 * layout[2] if virtual_stages == 1 else 2 * layout[1] * layout[2])
        m = len(batches) // layout[2]
        grid, model, loss, count, _ = run_pipeline(
            cfg, layout, batches, "1f1b", recompute=True, virtual_stages=virtual_stages
        )
        assert model.hidden_shape(MICRO, SEQ) == (MICRO, SEQ // layout[0], cfg.hidden)
        check_against_reference(cfg, batches, grid, model, loss, count)
        for moe in model.moe_layers():  # a forward rerun by recomputation is not counted twice
            assert moe.stats.forwards == m


@pytest.mark.mpi(min_size=2)
def test_activation_peak_per_stage():
    """1F1B keeps at most pp - stage micro-batches alive, GPipe all m; recompute holds fewer bytes."""
    tp, pp, dp = layouts()[0]
    m = 2 * pp + 1
    batches = make_micro_batches(GPT, m)
    peaks = {}
    for schedule, recompute in (("gpipe", False), ("1f1b", False), ("1f1b", True)):
        grid, _, _, _, stats = run_pipeline(GPT, (tp, pp, dp), batches, schedule, recompute)
        peaks[schedule, recompute] = stats
    stage = grid.coords.pp
    assert peaks["gpipe", False].peak_micro_batches == m
    assert peaks["1f1b", False].peak_micro_batches == pp - stage
    # Every micro-batch holds the same arrays, so the bytes scale with the count.
    assert peaks["gpipe", False].peak_bytes * (pp - stage) == peaks["1f1b", False].peak_bytes * m
    assert peaks["1f1b", True].peak_micro_batches == pp - stage
    assert peaks["1f1b", True].peak_bytes < peaks["1f1b", False].peak_bytes


@pytest.mark.mpi(min_size=2)
def test_interleaved_activation_peak():
    """Interleaving keeps more passes alive, each through a chunk of 1/V of the rank's layers:
    2 (pp-1-stage) + (V-1) pp + 1 of them, as the symbolic replay counts."""
    tp, pp, dp = layouts()[0]
    v, m = 2, 2 * pp
    cfg = dataclasses.replace(GPT, n_layers=pp * v)  # one layer per chunk
    batches = make_micro_batches(cfg, m * dp)
    grid, _, _, _, stats = run_pipeline(cfg, (tp, pp, dp), batches, "1f1b", virtual_stages=v)
    expected = _replay(pp, m, v)[grid.coords.pp]
    assert stats.peak_micro_batches == expected == 2 * (pp - 1 - grid.coords.pp) + (v - 1) * pp + 1


@pytest.mark.mpi(min_size=2)
def test_tied_copy_starts_identical_and_tied_names():
    tp, pp, dp = layouts()[0]
    grid = ProcessGrid(tp, pp, dp, world())
    model = build_stage(GPT, grid, "float64", SEED)
    full = GPTModel(GPT, self_comm(), dtype="float64", seed=SEED)
    if grid.is_first_stage or grid.is_last_stage:
        assert np.array_equal(model.embed.weight.data, full.embed.weight.data)
    else:
        assert "embed.weight" not in model.state()
    assert tied_copy_names(model, grid) == (frozenset(["embed.weight"]) if grid.is_last_stage else frozenset())


@pytest.mark.mpi(min_size=2)
def test_bubble_benchmark_reports_every_stage():
    tp, pp, dp = layouts()[0]
    grid = ProcessGrid(tp, pp, dp, world())
    records = measure_bubble(GPT, grid, micro_batches=3, micro_batch=2, seq_len=4, repeats=1, warmup=0)
    assert [r["stage"] for r in records] == list(range(pp))
    assert sum(r["layers"] for r in records) == GPT.n_layers
    for r in records:
        assert 0.0 <= r["idle"] < 1.0 and r["busy_s"] <= r["step_s"]
        assert r["formula"] == (pp - 1) / (3 + pp - 1)


@pytest.mark.mpi(min_size=2)
def test_bubble_benchmark_measures_virtual_stages_side_by_side():
    tp, pp, dp = layouts()[0]
    grid = ProcessGrid(tp, pp, dp, world())
    records = measure_bubble(
        GPT9,
        grid,
        micro_batches=4,
        micro_batch=2,
        seq_len=4,
        schedule="1f1b",
        repeats=1,
        warmup=0,
        virtual_stages=(1, 2),
    )
    assert [(r["virtual_stages"], r["stage"]) for r in records] == [(v, s) for v in (1, 2) for s in range(pp)]
    for v in (1, 2):
        assert sum(r["layers"] for r in records if r["virtual_stages"] == v) == GPT9.n_layers
    assert [r["formula"] for r in records if r["stage"] == 0] == [(pp - 1) / (4 + pp - 1), (pp - 1) / (8 + pp - 1)]


# -- one process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_is_a_plain_micro_batch_loop(schedule, recompute):
    batches = make_micro_batches(GPT, 3)
    grid, model, loss, count, stats = run_pipeline(GPT, (1, 1, 1), batches, schedule, recompute)
    ref, ref_loss, ref_count = reference(GPT, batches)
    assert count == ref_count and abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    for name, err in gradient_errors(model, ref, grid.tp).items():
        assert err <= 1e-12, f"{name} relative error {err:.2e}"
    assert stats.peak_micro_batches == (3 if schedule == "gpipe" else 1)


def _replay(pp, m, chunks=1, schedule="1f1b"):
    """Run every rank's op list against its neighbours' messages; returns the peak alive per rank.
    A pass of chunk c on rank s is virtual stage c * pp + s: its forward needs the forward of the
    virtual stage before (rank s - 1, or the last rank's chunk c - 1), its backward the backward of
    the one after, and the last virtual stage's backward its own forward."""
    ops = [stage_ops(schedule, m, pp, s, chunks) for s in range(pp)]
    last = pp * chunks - 1
    done = [set() for _ in range(pp)]
    position, alive, peak = [0] * pp, [0] * pp, [0] * pp
    while any(position[s] < len(ops[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if position[s] == len(ops[s]):
                continue
            op, c, i = ops[s][position[s]]
            stage = c * pp + s
            if op == FORWARD:
                needs = (FORWARD, stage - 1) if stage > 0 else None
            else:
                needs = (FORWARD, stage) if stage == last else (BACKWARD, stage + 1)
            if needs is not None and (needs[0], needs[1] // pp, i) not in done[needs[1] % pp]:
                continue
            done[s].add((op, c, i))
            position[s] += 1
            alive[s] += 1 if op == FORWARD else -1
            peak[s] = max(peak[s], alive[s])
            progressed = True
        assert progressed, f"{schedule} deadlocks at pp={pp}, V={chunks}, m={m}: ranks stopped at {position}"
    for s in range(pp):
        assert sorted(ops[s]) == sorted(
            (op, c, i) for op in (FORWARD, BACKWARD) for c in range(chunks) for i in range(m)
        )
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_never_deadlock_and_bound_activations(schedule):
    for pp in range(1, 7):
        for m in range(1, 10):
            peak = _replay(pp, m, schedule=schedule)
            expected = [m] * pp if schedule == "gpipe" else [min(pp - s, m) for s in range(pp)]
            assert peak == expected, (pp, m, peak)


def test_interleaved_schedule_never_deadlocks_and_bounds_activations():
    for pp in range(2, 7):
        for chunks in range(2, 5):
            for m in range(pp, 4 * pp + 1, pp):
                peak = _replay(pp, m, chunks)
                assert peak == [min(2 * (pp - 1 - s) + (chunks - 1) * pp + 1, m * chunks) for s in range(pp)], (
                    pp,
                    chunks,
                    m,
                    peak,
                )


def test_bubble_formula():
    assert bubble_formula(1, 5) == 0.0
    assert bubble_formula(4, 1) == 0.75
    assert bubble_formula(2, 8) == 1 / 9
    assert bubble_formula(2, 8, virtual_stages=2) == 1 / 17


def test_micro_batches_of_different_shapes_are_refused():
    grid = ProcessGrid(1, 1, 1, world())
    model = build_stage(GPT, grid, "float64", SEED)
    batches = make_micro_batches(GPT, 1) + [(np.zeros((1, SEQ), dtype=int), np.zeros((1, SEQ), dtype=int))]
    with pytest.raises(ValueError, match="share one shape"):
        pipeline_forward_backward(model, batches, grid, 1.0)


def test_stage_split():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 5)]
    # A costly head pushes layers off the last stage; a costly first layer gets a stage of its own.
    assert stage_layers(6, 2, last_extra=2.0) == [range(0, 4), range(4, 6)]
    assert stage_layers(4, 2, weights=[3, 1, 1, 1]) == [range(0, 1), range(1, 4)]
    assert [len(r) for r in stage_layers(12, 12)] == [1] * 12
    assert parse_pp_layers("3,2,3", 8, 3) == [range(0, 3), range(3, 5), range(5, 8)]
    assert layers_from_counts([1, 4], 5, 2) == [range(0, 1), range(1, 5)]


def test_balanced_split_weighs_each_layer():
    """A sliding-window layer's attention covers its window, so at a long sequence four local layers
    cost less than one global one: the default split gives the local half of the model more layers
    (a uniform cost per block split it 4 + 4). An MoE layer's MLP is its top-k experts and router."""
    cfg = ModelConfig(hidden=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=4096, vocab_size=64)
    local_then_global = dataclasses.replace(
        cfg, sliding_window=32, layer_types=["sliding_attention"] * 4 + ["full_attention"] * 4
    )
    _, blocks, _ = stage_costs(local_then_global)
    assert blocks[0] < blocks[4] and len(set(blocks[:4])) == len(set(blocks[4:])) == 1
    assert balanced_layers(cfg, 2) == [range(0, 4), range(4, 8)]
    assert balanced_layers(local_then_global, 2) == [range(0, 6), range(6, 8)]
    moe = dataclasses.replace(cfg, num_experts=4, top_k=2, moe_every=2)
    _, moe_blocks, _ = stage_costs(moe, 64)
    mlp = 2 * (64 * 96 + 96 * 64)  # one row through the dense MLP (gelu: one fc1)
    assert moe_blocks[0] == stage_costs(cfg, 64)[1][0]  # layer 0 stays dense
    assert moe_blocks[1] - moe_blocks[0] == 2 * mlp - mlp + 2 * 64 * 4  # two experts' rows and the router


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: stage_layers(3, 4), ["--pp 4", "3 layers"]),
        (lambda: parse_pp_layers("3,x", 5, 2), ["3,x", "comma-separated"]),
        (lambda: parse_pp_layers("3,2", 5, 3), ["2 stages", "--pp is 3"]),
        (lambda: parse_pp_layers("3,3", 5, 2), ["6 layers", "has 5"]),
        (lambda: parse_pp_layers("5,0", 5, 2), ["positive"]),
        (lambda: pipeline_forward_backward(None, [None], None, 1.0, schedule="zb"), ["zb", "gpipe", "1f1b"]),
        (lambda: parse_pp_layers("3,2", 5, 2, 2), ["2 stages", "--pp 2 x --virtual-stages 2 is 4 chunks"]),
        (lambda: stage_ops("1f1b", 3, 2, 0, 2), ["3 micro-batches", "--virtual-stages 2", "multiple of --pp 2"]),
        (lambda: stage_ops("gpipe", 4, 2, 0, 2), ["--schedule gpipe", "--virtual-stages 2 needs --schedule 1f1b"]),
        (lambda: build_stage(GPT, ProcessGrid(1, 1, 1, world()), virtual_stages=2), ["--virtual-stages 2", "--pp > 1"]),
        (lambda: build_stage(GPT, ProcessGrid(1, 1, 1, world()), virtual_stages=0), ["--virtual-stages 0", "positive"]),
    ],
)
def test_stage_split_errors_name_the_values(call, words):
    with pytest.raises(ConfigError) as error:
        call()
    assert all(w in str(error.value) for w in words), str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.mpi(min_size=2)
def test_bench_pipeline_command_reports_every_stage(capsys, tmp_path):
    import json

    from hpc_tp.cli import main

    config = world().bcast_object(str(tmp_path / "four-layers.json"))  # 4 chunks at pp=2, V=2
    if world().rank == 0:
        Path(config).write_text(json.dumps(dict(hidden=32, n_layers=4, n_heads=4, max_seq_len=64)))
    world().barrier()
    assert (
        main(
            [
                "bench",
                "pipeline",
                "--model",
                config,
                "--pp",
                "2",
                "--micro-batches",
                "2",
                "--repeats",
                "1",
                "--schedule",
                "1f1b",
                "--virtual-stages",
                "1,2",
            ]
        )
        == 0
    )
    if world().rank == 0:
        out = capsys.readouterr().out
        assert "1f1b, pp=2, V=2, m=2: formula idle (p-1)/(V*m+p-1) = 0.200" in out and out.count("  stage ") == 4
