"""The planner: its memory model against the engine's real bytes, Korthikanti's formula, rejections
with reasons, the well-known plans, calibration files, the command, and predicted against measured
step time on this machine (errors printed; only a loose sanity bound is asserted, never a timing)."""

import json
import os
from dataclasses import replace

import numpy as np
import pytest
from test_model import GEMMA3_BLOCK

from hpc_tp.cli import main
from hpc_tp.comm.mpi import world
from hpc_tp.errors import ConfigError
from hpc_tp.grid import ProcessGrid, factorizations
from hpc_tp.models.config import ModelConfig, load_config
from hpc_tp.nn import attention
from hpc_tp.nn.attention import heads_fit
from hpc_tp.pipeline import PipelineStats, balanced_layers, build_stage, pipeline_forward_backward
from hpc_tp.pipeline.partition import rank_layers
from hpc_tp.plan import choose_layout, search
from hpc_tp.plan.calibration import from_comm_records, from_step_records, load_calibration
from hpc_tp.plan.clusters import CLUSTERS, engine_precision, get_cluster
from hpc_tp.plan.cost import Layout, Link, forward_flops_per_token, hops, predict, stage_collectives, traffic
from hpc_tp.plan.memory import MEGATRON, kv_cache_bytes, layer_activation_bytes, stage_memory
from hpc_tp.plan.placement import compare_placements, launch_cluster, launch_placement
from hpc_tp.plan.search import divisors, structural_reason, variant_reason
from hpc_tp.serve.kv_cache import KVCache
from hpc_tp.train.optim import AdamW
from hpc_tp.train.settings import TrainSettings
from hpc_tp.train.trainer import Trainer

# Tied, learned positions, a vocabulary that no tp > 1 divides, 3 layers (uneven at pp = 2).
GPT = ModelConfig(vocab_size=37, hidden=16, n_layers=3, n_heads=4, max_seq_len=8, dropout=0.1, attn_dropout=0.1)
# Untied, RoPE, SwiGLU, RMSNorm, 2 kv heads: replicated at tp = 4.
LLAMA = ModelConfig(
    vocab_size=29,
    hidden=16,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=24,
    max_seq_len=8,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
)
# Every expert sees every token (top_k = num_experts, capacity >= tokens): the routing, and so what
# an MoE layer keeps, is the capacity bound the planner counts, at any ep.
MOE = ModelConfig(
    vocab_size=37,
    hidden=16,
    n_layers=2,
    n_heads=4,
    max_seq_len=8,
    num_experts=4,
    top_k=4,
    moe_every=2,
    capacity_factor=1.0,
)
# Routed by the weights (top 1 of 4, capacity 1.25): the bound must hold, with tokens dropped or not.
ROUTED = replace(MOE, top_k=1, capacity_factor=1.25, moe_every=1)
# Gemma 3's block: post-norms, GeGLU, query/key norms, heads of 6 apart from hidden, one kv head,
# sliding windows of 3 on three layers of four (fewer softmax tiles kept), soft-capped tied logits.
GEMMA = replace(LLAMA, **GEMMA3_BLOCK, head_dim=6, layer_types=["sliding_attention"] * 3 + ["full_attention"])
# Qwen-MoE: heads apart from hidden with q/k norms, a dense layer among sparse ones, experts narrower
# than it, a sigmoid-gated shared expert, top k unnormalised; every expert sees every token as in MOE.
QWEN_MOE = replace(
    LLAMA,
    n_layers=3,
    head_dim=6,
    qk_norm=True,
    num_experts=4,
    top_k=4,
    capacity_factor=1.0,
    dense_layers=[1],
    expert_ffn_hidden=8,
    shared_expert_ffn_hidden=12,
    normalize_top_k=False,
)
SP = {
    "gpt-sp": replace(GPT, sequence_parallel=True),
    "llama-sp": replace(LLAMA, sequence_parallel=True),
    "moe-sp": replace(MOE, sequence_parallel=True),
}
MODELS = {"gpt": GPT, "llama": LLAMA, "moe": MOE, "qwen-moe": QWEN_MOE, "gemma3": GEMMA, **SP}
MICRO, SEQ, MICRO_BATCHES = 2, 8, 4


def engine_layouts(cfg):
    """(tp, pp, dp, ep) the engine runs, by the planner's own rules (so they are tested too)."""
    return [
        (t, p, d, e)
        for t, p, d in factorizations(world().size)
        if structural_reason(cfg, t, p, d, 4) is None
        for e in (divisors(d) if cfg.num_experts else [1])
        if variant_reason(cfg, t, d, SEQ, cfg.sequence_parallel, e) is None
    ]


# -- memory: exact against the engine -------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "moe-sp", "qwen-moe", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameter_and_optimizer_bytes_are_the_engines(name, dtype):
    cfg, precision = MODELS[name], engine_precision(dtype)
    for tp, pp, dp, ep in engine_layouts(cfg):
        grid = ProcessGrid(tp, pp, dp, world(), ep=ep)
        model = build_stage(cfg, grid, dtype)
        optimizer = AdamW(model.state(), 1e-3)
        states = sum(a.nbytes for kind in (optimizer.exp_avg, optimizer.exp_avg_sq) for a in kind.values())
        layers = balanced_layers(cfg, pp)[grid.coords.pp]
        predicted = stage_memory(
            cfg, tp, pp, grid.coords.pp, layers, MICRO, SEQ, MICRO_BATCHES, "1f1b", False, precision, ep=ep
        )
        assert (predicted.params, predicted.optimizer) == (model.local_bytes(), states), (tp, pp, dp, ep)
        assert predicted.grads == sum(p.grad.nbytes for p in model.parameters()), (tp, pp, dp, ep)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_distributed_optimizer_bytes_are_the_engines(name):
    """With ZeRO-1 the pieces (the moments; at float64 the parameters are their own masters) hold
    1/dp of the optimizer bytes, experts' 1/(dp/ep): exact save the last piece of each bucket,
    which is up to dp - 1 elements shorter."""
    from hpc_tp.module import DEFAULT_BUCKET_BYTES, GradArena
    from hpc_tp.train.distributed_optim import ShardedAdamW
    from hpc_tp.train.grad_sync import ExpertAwareBucketer

    cfg, precision = MODELS[name], engine_precision("float64")
    for tp, pp, dp, ep in engine_layouts(cfg):
        if pp > 1 or dp == 1:  # the tied embedding of pp > 1 stays whole; dp = 1 has nothing to shard
            continue
        grid = ProcessGrid(tp, pp, dp, world(), ep=ep)
        with GradArena(DEFAULT_BUCKET_BYTES, params=True) as arena:
            model = build_stage(cfg, grid, "float64")
        params = model.state()
        optimizer = ShardedAdamW(params, ExpertAwareBucketer(params, grid, arena, shard=True), 1e-3)
        assert optimizer.state_bytes() == sum(
            a.nbytes for piece, _ in optimizer.pieces for a in (piece.exp_avg, piece.exp_avg_sq)
        )
        predicted = stage_memory(
            cfg,
            tp,
            pp,
            0,
            balanced_layers(cfg, pp)[0],
            MICRO,
            SEQ,
            MICRO_BATCHES,
            "1f1b",
            False,
            precision,
            ep=ep,
            optimizer_shards=dp,
        ).optimizer
        slack = 2 * 8 * dp * len(optimizer.pieces)  # two float64 moments per piece, up to dp - 1 short
        assert predicted - slack <= optimizer.state_bytes() <= predicted + slack, (tp, dp, ep, predicted)
    layout = search(GPT, 4, 8, SEQ, get_cluster("cpu-2core"), distributed_optimizer=True).ranked
    assert all(p.layout.distributed_optimizer == (p.layout.dp > 1) for p in layout)
    assert any("zero1" in p.layout.describe() for p in layout)


def held_activations(cfg, tp, pp, dp, ep, schedule, recompute, virtual_stages=1):
    """(predicted, measured) activation bytes of this rank's stage over a few micro-batches."""
    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(0, cfg.vocab_size, (MICRO, SEQ)), rng.integers(0, cfg.vocab_size, (MICRO, SEQ)))
        for _ in range(MICRO_BATCHES)
    ]
    grid = ProcessGrid(tp, pp, dp, world(), ep=ep)
    model = build_stage(cfg, grid, "float64", virtual_stages=virtual_stages)
    stats = PipelineStats()
    m = MICRO_BATCHES // dp
    pipeline_forward_backward(model, batches[grid.coords.dp * m :][:m], grid, 1.0, schedule, recompute, stats=stats)
    layers = rank_layers(balanced_layers(cfg, pp, virtual_stages=virtual_stages), pp, grid.coords.pp)
    predicted = stage_memory(
        cfg, tp, pp, grid.coords.pp, layers, MICRO, SEQ, m, schedule, recompute, engine_precision("float64"), ep=ep
    )
    return predicted.activations, stats.peak_bytes


# GPipe only changes how many micro-batches are in flight: checked on the two dense models.
SCHEDULES = [("1f1b", "none"), ("1f1b", "selective"), ("1f1b", "full")]
ACTIVATION_CASES = [(name, *case) for name in MODELS for case in SCHEDULES] + [
    (name, "gpipe", "none") for name in ("gpt", "llama")
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name, schedule, recompute", ACTIVATION_CASES)
def test_activation_bytes_are_what_the_pipeline_holds(name, schedule, recompute, monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", 3)  # seq 8: causal softmax kept in blocks of 3, 3 and 2 queries
    cfg = MODELS[name]
    for tp, pp, dp, ep in engine_layouts(cfg):
        predicted, measured = held_activations(cfg, tp, pp, dp, ep, schedule, recompute)
        assert predicted == measured, (tp, pp, dp, ep, world().rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_interleaved_activation_bytes_are_what_the_pipeline_holds(recompute, monkeypatch):
    """Two chunks per rank: the passes alive at the peak mix chunks of different cost (the first
    holds the embedding, the last the head), replayed from the schedule."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 3)
    for cfg in (LLAMA, replace(GPT, n_layers=6)):
        for tp, pp, dp, ep in engine_layouts(cfg):
            if pp > 1 and 2 * pp <= cfg.n_layers and (MICRO_BATCHES // dp) % pp == 0:
                predicted, measured = held_activations(cfg, tp, pp, dp, ep, "1f1b", recompute, virtual_stages=2)
                assert predicted == measured, (cfg.n_layers, tp, pp, dp, world().rank)


@pytest.mark.mpi(min_size=1)
def test_routed_moe_activations_stay_within_the_capacity_bound():
    for tp, pp, dp, ep in engine_layouts(ROUTED):
        predicted, measured = held_activations(ROUTED, tp, pp, dp, ep, "1f1b", False)
        assert measured <= predicted, (tp, pp, dp, ep, world().rank)


@pytest.mark.mpi(min_size=1)
def test_kv_cache_bytes_are_the_caches():
    comm = world()
    for cfg in (GPT, LLAMA):
        if not heads_fit(cfg.n_heads, cfg.n_kv_heads, comm.size):
            continue
        grid = ProcessGrid(comm.size, 1, 1, comm)
        model = build_stage(cfg, grid, "float32")
        cache = KVCache.for_model(model, batch=3, max_len=7)
        assert cache.nbytes == kv_cache_bytes(cfg, comm.size, cfg.n_layers, 3, 7, 4)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_megatron_list_gives_korthikanti_formula(t):
    # Their section 4: s b h (34 + 5 a s / h) at t = 1; s b h (10 + 24 / t + 5 a s / (h t)) with tp.
    s, b, h, a = 2048, 2, 1024, 16
    cfg = ModelConfig(vocab_size=64, hidden=h, n_layers=1, n_heads=a, max_seq_len=s)
    assert layer_activation_bytes(cfg, b, s, t, 2, MEGATRON) == s * b * h * (10 + 24 // t) + 5 * a * s * s * b // t
    # With sequence parallelism the replicated 10 s b h are divided by t too: s b h (34 / t) + 5 a s^2 b / t.
    sp = replace(cfg, sequence_parallel=True)
    assert layer_activation_bytes(sp, b, s, t, 2, MEGATRON) == s * b * h * 34 // t + 5 * a * s * s * b // t


def test_recompute_and_1f1b_bound_activations():
    cfg, precision = load_config("gpt2"), engine_precision("float32")
    kept = [
        stage_memory(cfg, 1, 4, 0, range(3), 4, 1024, 16, schedule, again, precision).activations
        for schedule, again in (("gpipe", False), ("1f1b", False), ("1f1b", True))
    ]
    assert kept[0] == 4 * kept[1]  # 16 micro-batches in flight against pp - stage = 4
    assert kept[2] < kept[1] / 10  # a block's input against everything it saves


# -- search -----------------------------------------------------------------------------------------------


def test_every_rejected_layout_has_its_reason():
    cfg = ModelConfig(vocab_size=258, hidden=48, n_layers=2, n_heads=6, max_seq_len=32)
    peaks = sorted(p.peak_memory for p in search(cfg, 8, 12, 32, get_cluster("cpu-2core")).ranked)
    cluster = get_cluster("cpu-2core").with_overrides(device_mem=peaks[len(peaks) // 2])
    plan = search(cfg, 8, 12, 32, cluster)
    by_kind = {r.kind for r in plan.rejected}
    assert by_kind == {"heads", "layers", "batch", "memory"}
    for r in plan.rejected:
        t, p, d = r.layout["tp"], r.layout["pp"], r.layout["dp"]
        expected = {"heads": 6 % t != 0, "layers": p > 2, "batch": 12 % d != 0}
        if r.kind == "memory":
            assert "does not fit" in r.reason and r.need_bytes > cluster.device_mem
        else:
            assert expected[r.kind] and f"={t if r.kind == 'heads' else p if r.kind == 'layers' else d}" in r.reason
    for p in plan.ranked:
        assert p.peak_memory <= cluster.device_mem and 12 % (p.layout.dp * p.layout.micro_batch) == 0
    assert [p.step_s for p in plan.ranked] == sorted(p.step_s for p in plan.ranked)


def test_sequence_parallel_and_expert_parallel_layouts():
    # seq 30: tp = 4 cannot shard it; 4 experts: ep = 8 cannot spread them.
    cfg = ModelConfig(vocab_size=258, hidden=48, n_layers=2, n_heads=4, max_seq_len=30, num_experts=4, top_k=2)
    plan = search(cfg, 8, 16, 30, get_cluster("cpu-2core"), micro_batches=(2,), recompute=(False,))
    reasons = {r.kind: r for r in plan.rejected}
    assert "tp=4 with sequence parallelism" in reasons["sequence"].reason
    assert "num_experts=4 is not divisible by ep=8" in reasons["experts"].reason
    by_layout = {
        (p.layout.tp, p.layout.pp, p.layout.dp, p.layout.sequence_parallel, p.layout.ep): p for p in plan.ranked
    }
    plain, sp = by_layout[(2, 1, 4, False, 1)], by_layout[(2, 1, 4, True, 1)]
    ops = {(c.group, c.op) for c in sp.collectives}
    assert {("tp", "all_gather"), ("tp", "reduce_scatter")} <= ops
    assert plain.memory[0].activations > sp.memory[0].activations
    spread = by_layout[(1, 1, 8, False, 2)]
    assert {("ep", "all_to_all"), ("expert_dp", "all_reduce")} <= {(c.group, c.op) for c in spread.collectives}
    experts = [by_layout[(1, 1, 8, False, ep)].memory[0] for ep in (1, 2, 4)]
    assert experts[0].params > experts[1].params > experts[2].params  # E / ep experts per rank


def test_gpt3_175b_on_1536_a100s_keeps_tp_in_a_node():
    cluster = get_cluster("dgx-a100")
    plan = search(load_config("gpt3-175b"), 1536, 1536, 2048, cluster, micro_batches=(1, 2))
    best = plan.ranked[0]
    print(
        f"\ngpt3-175b, 1536 A100 80GB: {best.layout.describe()}, step {best.step_s:.2f} s, "
        f"{best.model_flops_per_device / 1e12:.0f} TFLOP/s per GPU, {best.peak_memory / 2**30:.1f} GiB"
    )
    assert best.layout.tp == 8 and best.layout.pp > 1  # tp fills the NVLink node; 175B needs stages too
    assert best.peak_memory <= cluster.device_mem
    # Model FLOP/s per GPU below the assumed sustained rate, and not absurdly below it.
    assert 0.3 * 312e12 * 0.7 < best.model_flops_per_device < 312e12 * 0.7
    assert all(p.layout.tp <= 8 for p in plan.ranked[:5])
    assert any(r.kind == "memory" and r.layout["tp"] == 1 and r.layout["pp"] == 1 for r in plan.rejected)


def test_tp_groups_that_straddle_nodes_use_the_network():
    cfg, cluster = load_config("llama2-7b"), get_cluster("dgx-a100")
    inside, straddling = Layout(8, 1, 2, 1), Layout(16, 1, 1, 1)
    assert not inside.spans_nodes("tp", 8) and inside.spans_nodes("dp", 8)
    assert straddling.spans_nodes("tp", 8) and Layout(6, 1, 2, 1).spans_nodes("tp", 8)
    a, b = (predict(cfg, lay, 16, 4096, cluster) for lay in (inside, straddling))
    assert b.tp_s > 5 * a.tp_s


def test_choose_layout_returns_trainer_settings():
    cfg = load_config("tiny", hidden=64, n_layers=4, vocab_size=258)
    choice = choose_layout(cfg, 4, 16, 32)
    assert set(choice) == {"tp", "pp", "dp", "micro_batch", "recompute", "schedule", "virtual_stages", "reason"}
    assert choice["tp"] * choice["pp"] * choice["dp"] == 4 and 16 % (choice["dp"] * choice["micro_batch"]) == 0
    assert choice["reason"].startswith("fastest of")
    with pytest.raises(ConfigError, match="no layout of 4 ranks"):
        choose_layout(cfg, 4, 16, 32, get_cluster("cpu-2core").with_overrides(device_mem=1000))


def test_choose_layout_keeps_the_asked_ep_and_runs_sequence_parallel_models_at_tp_1():
    moe = load_config("tiny", hidden=64, n_layers=4, vocab_size=258, num_experts=4, top_k=2)
    for ep in (2, 4):
        choice = choose_layout(moe, 4, 16, 32, ep=ep)
        assert choice["dp"] % ep == 0, choice  # the engine's grid needs ep | dp
    # seq 7: no tp > 1 divides it, so only tp = 1 runs; there sequence parallelism is off in the engine.
    sp = load_config("tiny", hidden=64, n_layers=4, vocab_size=258, sequence_parallel=True)
    assert choose_layout(sp, 1, 16, 32)["tp"] == 1
    assert choose_layout(sp, 2, 16, 7)["tp"] == 1


# Three heads (no tp = 2) and wide GEMMs whose gradients dp = 2 would all-reduce: at 2 ranks of
# cpu-2core the pipeline wins, and with 2 sequences (m = 2 at pp = 2) its bubble is large.
BUBBLY = ModelConfig(vocab_size=258, hidden=192, n_layers=8, n_heads=3, max_seq_len=32)


def test_choose_layout_interleaves_where_the_bubble_dominates():
    choice = choose_layout(BUBBLY, 2, 2, 32)
    assert (choice["pp"], choice["schedule"], choice["virtual_stages"]) == (2, "1f1b", 4), choice
    # An explicit V keeps the search to layouts that run it; 1 turns interleaving off.
    assert choose_layout(BUBBLY, 2, 2, 32, virtual_stages=2)["virtual_stages"] == 2
    assert choose_layout(BUBBLY, 2, 2, 32, virtual_stages=1)["virtual_stages"] == 1
    with pytest.raises(ConfigError, match="--virtual-stages 0: expected a positive integer"):
        choose_layout(BUBBLY, 2, 2, 32, virtual_stages=0)
    with pytest.raises(ConfigError, match=r"no layout of 1 ranks .* at --virtual-stages 2, which needs pp > 1"):
        choose_layout(BUBBLY, 1, 2, 32, virtual_stages=2)


@pytest.mark.parametrize(
    "world_size, global_batch, layers",
    [(1, 2, 8), (2, 3, 8), (2, 2, 2)],
    ids=["one-rank", "odd-micro-batches", "a-layer-per-stage"],
)
def test_choose_layout_runs_one_chunk_where_interleaving_is_impossible(world_size, global_batch, layers):
    """No pipeline; 3 micro-batches (or 1) that pp = 2 does not divide; as many layers as stages."""
    choice = choose_layout(replace(BUBBLY, n_layers=layers), world_size, global_batch, 32)
    assert choice["virtual_stages"] == 1 and (world_size == 1 or choice["pp"] == 2), choice


def plan_settings(**changes):
    base = dict(
        model="tiny",
        model_overrides=dict(hidden=48, n_layers=8, n_heads=4, max_seq_len=32),
        seq_len=32,
        global_batch=4,
        steps=2,
        warmup=1,
        lr=3e-3,
        dtype="float64",
        eval_problems=4,
        samples=0,
        progress=False,
    )
    return TrainSettings(**{**base, **changes})


@pytest.mark.mpi(min_size=1)
def test_plan_auto_trains_the_chosen_virtual_stages():
    """--plan auto sets V with the rest of the layout (V > 1 on 2 ranks here: pp = 2 with a bubble
    worth shrinking) and trains exactly as the same layout given by hand; an explicit V holds."""
    comm = world()
    planned = Trainer(plan_settings(plan="auto"), comm)
    s = planned.settings
    if comm.size == 2:
        assert s.pp == 2 and s.virtual_stages > 1, s
    if comm.size == 1:
        assert s.virtual_stages == 1
    assert len(planned.model.layer_ids) == 8 // s.pp  # this rank's chunks hold its share of the layers
    by_hand = plan_settings(
        tp=s.tp,
        pp=s.pp,
        dp=s.dp,
        micro_batch=s.micro_batch,
        recompute=s.recompute,
        schedule=s.schedule,
        virtual_stages=s.virtual_stages,
    )
    first, second = ([r["loss"] for r in t.run().records] for t in (planned, Trainer(by_hand, comm)))
    assert first == second
    assert Trainer(plan_settings(plan="auto", virtual_stages=1), comm).settings.virtual_stages == 1


# -- calibration and the cost formulas -----------------------------------------------------------------


def test_ring_formulas():
    assert traffic("all_reduce", 4) == 1.5 and traffic("all_gather", 4) == 0.75 and traffic("p2p", 2) == 1
    assert hops("all_reduce", 8) == 6 and hops("reduce_scatter", 8) == 3 and hops("all_reduce", 1) == 0
    assert Link(1e-5, 1e9).time("all_reduce", 4, 1e6) == pytest.approx(4e-5 + 1.5e-3)


def test_comm_fit_recovers_alpha_and_bandwidth(tmp_path):
    alpha, bw, ranks = 7e-6, 3e9, 4
    records = [
        {"op": op, "ranks": ranks, "bytes": n, "project_time_s": hops(op, ranks) * alpha + traffic(op, ranks) * n / bw}
        for op in ("all_reduce", "p2p")
        for n in (64, 4096, 2**20, 2**24)
    ]
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(records))
    cal = load_calibration([path])
    for op in ("all_reduce", "p2p"):
        assert cal.links[op].alpha == pytest.approx(alpha, rel=1e-6) and cal.links[op].bw == pytest.approx(bw, rel=1e-6)
    assert cal.network(get_cluster("cpu-2core")).intra["all_reduce"] == cal.links["all_reduce"]
    cpu = get_cluster("cpu-2core")
    assert cal.network(cpu).inter["p2p"] == Link(*cpu.link(True))  # measured on one node: inter stays the preset's


def test_step_record_gives_rate_and_wait():
    record = {
        "benchmark": "step",
        "tp": 2,
        "flops": 6e9,
        "compute_s": 0.1,
        "comm_s": 0.01,
        "dtype": "float32",
        "layers": 2,
        "micro_batch": 2,
        "seq_len": 8,
        "hidden": 16,
    }
    cal = from_comm_records(
        [{"op": "all_reduce", "ranks": 2, "bytes": n, "project_time_s": 1e-5 + n / 1e9} for n in (8, 2**20)]
    ).merge(from_step_records([record]))
    assert cal.steps[0].rate == pytest.approx(3e10) and cal.steps[0].forward_flops == pytest.approx(1e9)
    link = cal.links["all_reduce"]
    expected_wait = (0.01 - 8 * link.time("all_reduce", 2, 2 * 8 * 16 * 4)) / 0.1  # per second of compute
    assert cal.network(get_cluster("cpu-2core"), tp=2).wait == pytest.approx(expected_wait)


@pytest.mark.parametrize("content, message", [("[1, 2]", "expected the JSON"), ("{", "not JSON")])
def test_bad_calibration_files(tmp_path, content, message):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_calibration([path])
    with pytest.raises(ConfigError, match="no such file"):
        load_calibration([tmp_path / "missing.json"])


# -- the command -----------------------------------------------------------------------------------------


def test_plan_command_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--model",
                "llama2-7b",
                "--gpus",
                "16",
                "--cluster",
                "dgx-h100",
                "--global-batch",
                "64",
                "--seq-len",
                "4096",
                "--top",
                "3",
                "--json",
                str(path),
                "--serve-batch",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tp=" in out and "rejected" in out and "KV cache" in out
    data = json.loads(path.read_text())
    assert data["ranked"] and all(r["reason"] for r in data["rejected"])
    top = data["ranked"][0]
    assert top["tp"] * top["pp"] * top["dp"] == 16 and top["tp"] <= 8


def plan_rows(out: str) -> list[list[str]]:
    """The ranked table's rows of ``hpc-tp plan``'s output, split into words."""
    return [
        line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit() and "tp=" in line
    ]


BUBBLY_ARGS = [
    "plan",
    "--model",
    "tiny",
    "--set",
    "hidden=192",
    "--set",
    "n_layers=8",
    "--set",
    "n_heads=3",
    "--set",
    "max_seq_len=32",
    "--gpus",
    "2",
    "--cluster",
    "cpu-2core",
    "--global-batch",
    "2",
    "--seq-len",
    "32",
]


@pytest.mark.parametrize(
    "argv, chunks",
    [([], {"1", "2", "3", "4"}), (["--virtual-stages", "1"], {"1"}), (["--virtual-stages", "1,3"], {"1", "3"})],
    ids=["default-as-plan-auto", "one-chunk", "a-list"],
)
def test_plan_command_searches_virtual_stages_as_plan_auto_does(argv, chunks, tmp_path, capsys):
    """Plain ``hpc-tp plan`` tries V = 1..4 where the engine interleaves, as ``--plan auto`` does, and
    its top row is ``choose_layout``'s; ``--virtual-stages`` limits it. V is its own column."""
    path = tmp_path / "plan.json"
    assert main([*BUBBLY_ARGS, *argv, "--top", "100", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = plan_rows(out)
    shown = {row[-9] for row in rows}  # V, step, tokens/s, TFLOP/s, GiB, (states + act), bubble
    pipelined = {str(r["virtual_stages"]) for r in json.loads(path.read_text())["ranked"] if r["pp"] > 1}
    assert shown - {"-"} == pipelined == chunks, out
    assert not any("V=" in word for row in rows for word in row)  # V only in its column
    if not argv:
        cfg = load_config("tiny", hidden=192, n_layers=8, n_heads=3, max_seq_len=32)
        top = json.loads(path.read_text())["ranked"][0]
        choice = choose_layout(cfg, 2, 2, 32)
        assert {k: top[k] for k in choice if k != "reason"} == {k: v for k, v in choice.items() if k != "reason"}
        assert "in 4 chunks each" in out


def test_plan_validate_measures_the_virtual_stages_it_would_plan(monkeypatch, capsys):
    """``plan --validate`` hands ``validate`` the same V as the plan: 1..4 unless --virtual-stages says."""
    import hpc_tp.launch
    import hpc_tp.plan.validate
    from hpc_tp.plan.calibration import Calibration
    from hpc_tp.plan.search import AUTO_VIRTUAL_STAGES

    asked = []
    monkeypatch.setattr(hpc_tp.launch, "check_launch", lambda: None)
    monkeypatch.setattr(
        hpc_tp.plan.validate,
        "validate",
        lambda *a, virtual_stages, **k: asked.append(virtual_stages) or ([], Calibration()),
    )
    for argv in ([], ["--virtual-stages", "2"]):
        assert main(["plan", "--model", "tiny", "--validate", *argv]) == 0
    assert asked == [AUTO_VIRTUAL_STAGES, (2,)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "0"], "--gpus 0"),
        (["--cluster", "nope"], "nope"),
        (["--set", "oops"], "KEY=VALUE"),
        (["--global-batch", "0"], "global-batch"),
        (["--ep", "0"], "--ep 0"),
        (["--ep", "2"], "has no experts"),
    ],
)
def test_plan_command_errors(argv, message):
    from hpc_tp.cli import build_parser
    from hpc_tp.plan import command

    with pytest.raises(ConfigError, match=message):
        command.run(build_parser().parse_args(["plan", "--model", "tiny", *argv]))


def test_cluster_presets_are_sane():
    for cluster in CLUSTERS.values():
        assert cluster.intra_bw >= cluster.inter_bw and 0 < cluster.gemm_efficiency <= 1
    cpu = get_cluster("cpu-2core")
    assert cpu.rank_flops(4) == pytest.approx(cpu.rank_flops(2) / 2) == pytest.approx(cpu.rank_flops(1) / 2)


# -- predicted against measured, on this machine ---------------------------------------------------------

# A model whose GEMMs outweigh Python's per-call cost, small enough for seconds per launch.
MEASURED = dict(hidden=192, n_layers=2, n_heads=4, max_seq_len=64)
# A few layouts per launch keep it short; `hpc-tp plan --validate` measures every one of a world.
MEASURED_LAYOUTS = {
    1: [Layout(1, 1, 1, 2)],
    2: [Layout(2, 1, 1, 2), Layout(1, 2, 1, 2), Layout(1, 1, 2, 2)],
    4: [Layout(4, 1, 1, 2), Layout(1, 2, 2, 2)],
}
# Interleaving needs pp x V <= layers: 4 layers run pp = 2 at V = 2, one block per chunk.
INTERLEAVED = dict(MEASURED, n_layers=4)
INTERLEAVED_LAYOUTS = {2: [Layout(1, 2, 1, 2, virtual_stages=2)], 4: [Layout(1, 2, 2, 2, virtual_stages=2)]}
BOUND, ATTEMPTS = 0.25, 3
# Rounds per attempt, each (calibrate, train, calibrate) and set against the prediction: the error is
# their median. The interleaved case measures one layout a launch, so it affords 5: under load one
# round in three strays by 30-50% either way (a descheduled rank), and a median of 5 needs three of them.
ROUNDS = {"one-chunk": 3, "interleaved": 5}
# More ranks than cores: the model prices the time-sharing as half the rate per rank, but how long
# a pipeline stage waits for a descheduled peer is the OS's (and the hypervisor's) call. CI's 2-core
# VM measured (1,2,2) at -21..-31% three times where this machine gives +2..+5%.
OVERSUBSCRIBED_BOUND = 0.45


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "case, overrides, layouts",
    [("one-chunk", MEASURED, MEASURED_LAYOUTS), ("interleaved", INTERLEAVED, INTERLEAVED_LAYOUTS)],
    ids=["one-chunk", "interleaved"],
)
def test_predicted_step_time_within_25_percent_of_the_trainer(case, overrides, layouts):
    """Each layout's error is the median over 3 (interleaved: 5) rounds of (calibrate, train,
    calibrate, predict); a layout
    outside the bound is measured again, up to 3 attempts, and passes if one attempt is within it:
    load from other jobs passes, a model 2x off never does. The bound is 25% where every rank has
    a core (on 2 cores: four layouts of 1 and 2 ranks), 45% where ranks outnumber cores."""
    from hpc_tp.plan.validate import format_rows, validate

    comm = world()
    # The cores the ranks have between them (ranks pinned one per core each see a single one).
    cores = len(set().union(*comm.allgather_object(os.sched_getaffinity(0))))
    bound = BOUND if comm.size <= cores else OVERSUBSCRIBED_BOUND
    pending, best = list(layouts.get(comm.size, [])), {}
    if not pending:
        pytest.skip(f"no layout measured at {comm.size} ranks")
    for attempt in range(ATTEMPTS):
        if not pending:
            break
        rows, calibration = validate(
            comm,
            "tiny",
            overrides,
            global_batch=8,
            seq=64,
            micro_batch=2,
            layouts=pending,
            steps=3,
            repeats=ROUNDS[case],
        )
        if comm.rank == 0:
            print(
                f"\n{comm.size} ranks, attempt {attempt + 1}, calibrated: {calibration.describe()}\n{format_rows(rows)}"
            )
        for r in rows:
            assert r["predicted_state_bytes"] == r["measured_state_bytes"]
            if r["layout"] not in best or abs(r["error"]) < abs(best[r["layout"]]["error"]):
                best[r["layout"]] = r
        # Every rank decides as rank 0 does, so the ranks run the same collectives next.
        pending = comm.allgather_object([r["layout"] for r in rows if abs(r["error"]) > bound])[0]
    assert not pending, format_rows([best[layout] for layout in pending])


def test_the_replicated_router_is_not_divided_by_tp():
    """Every tp rank runs each MoE layer's whole router: at tp=2 a rank's compute is half the rest
    plus all of the router (3 x 2 h E FLOPs per token and MoE layer, forward and backward)."""
    cfg, cluster = load_config("gpt2", num_experts=8, top_k=2), get_cluster("dgx-h100")
    one, two = (predict(cfg, Layout(tp, 1, 1, 1), 8, 1024, cluster) for tp in (1, 2))
    router_s = 3 * 2 * cfg.hidden * cfg.num_experts * cfg.n_layers * 8 * 1024 / cluster.rank_flops(1)  # 8 x 1024 tokens
    assert two.compute_s == pytest.approx((one.compute_s - router_s) / 2 + router_s, rel=1e-9)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embedding_gradients_are_summed_between_the_end_stages(tied):
    """pp > 1 with tied embeddings: the first and last stage each hold a copy and all-reduce its
    gradient in a group of two once a step (``pipeline/tied.py``); middle stages send nothing."""
    cfg = replace(GPT, tie_embeddings=tied)
    layout = Layout(2, 3, 1, 1)
    for first, last in ((True, False), (False, False), (False, True)):
        found = [c for c in stage_collectives(cfg, layout, 8, range(1), first, last, 2, 4, 4) if "tied" in c.what]
        if tied and (first or last):
            (c,) = found
            assert (c.group, c.op, c.ranks, c.count, c.per_micro_batch) == ("pp", "all_reduce", 2, 1, False)
            assert c.nbytes == -(-cfg.vocab_size // 2) * cfg.hidden * 4
        else:
            assert not found


@pytest.mark.parametrize("bias", [False, True])
def test_replicated_kv_gradients_are_summed_over_their_replicas(bias):
    """tp = 4 over 2 KV heads: each K and V weight gradient (and bias) is one all-reduce over its 2
    replicas per layer and micro-batch (``ColumnParallelLinear._add_param_grads``), not over tp."""
    cfg, m = replace(LLAMA, bias=bias), 3
    layout = Layout(4, 1, 1, 1)
    found = {
        c.what: c
        for c in stage_collectives(cfg, layout, 8, range(cfg.n_layers), True, True, m, 4, 4)
        if "replicated K/V" in c.what
    }
    expected = {"replicated K/V weight grads": cfg.hidden * cfg.head_dim * 4}
    if bias:
        expected["replicated K/V bias grads"] = cfg.head_dim * 4
    assert {what: c.nbytes for what, c in found.items()} == expected
    assert all(c.ranks == 2 and c.count == 2 * cfg.n_layers * m and c.group == "tp" for c in found.values())
    assert not [
        c
        for c in stage_collectives(cfg, Layout(2, 1, 1, 1), 8, range(cfg.n_layers), True, True, m, 4, 4)
        if "replicated" in c.what
    ]


def test_interleaved_bubble_is_a_vth_of_1f1b():
    """V chunks per rank: the fill and drain pass through 1/V of a stage, so with (all but) equal
    stages the bubble is (p-1)/(V m) of the ideal time instead of (p-1)/m, for V times the p2p
    messages; the first rank keeps pp + (pp-1)/V micro-batches' activations instead of pp."""
    cfg, cluster = load_config("gpt2", vocab_size=64), get_cluster("dgx-a100")  # a cheap head: equal stages
    m, pp = 8, 4
    one, three = (predict(cfg, Layout(1, pp, 1, 1, virtual_stages=v), m, 1024, cluster) for v in (1, 3))
    assert one.layers == three.layers == [3] * pp
    for p, v in ((one, 1), (three, 3)):  # against m times a stage's time (three's has 3x the p2p)
        ideal = p.step_s - p.bubble_s - p.dp_s - p.update_s
        assert p.bubble_s == pytest.approx((pp - 1) / (v * m) * ideal, rel=0.02)
    assert three.bubble_s < one.bubble_s / 2.5
    assert three.step_s < one.step_s
    (p2p_one,), (p2p_three,) = ([c for c in p.collectives if c.op == "p2p"] for p in (one, three))
    assert p2p_three.count == 3 * p2p_one.count == 3 * 2 * m
    # Up to the embedding's bytes, which only chunk 0's passes keep.
    assert three.memory[0].activations == pytest.approx(one.memory[0].activations * (pp + (pp - 1) / 3) / pp, rel=1e-4)
    assert "1f1b V=3" in three.layout.describe()


def test_search_tries_virtual_stages_where_the_engine_runs_them():
    cfg = ModelConfig(vocab_size=258, hidden=48, n_layers=4, n_heads=6, max_seq_len=32)
    ranked = search(cfg, 2, 8, 32, get_cluster("cpu-2core"), virtual_stages=(1, 2, 3)).ranked
    interleaved = [p.layout for p in ranked if p.layout.virtual_stages > 1]
    assert interleaved and all(
        lay.virtual_stages == 2
        and lay.pp == 2
        and lay.schedule == "1f1b"
        and (8 // (lay.dp * lay.micro_batch)) % lay.pp == 0
        for lay in interleaved
    )
    assert len({p.layout.virtual_stages for p in search(cfg, 2, 8, 32, get_cluster("cpu-2core")).ranked}) == 1


def test_validate_measures_every_virtual_stage_count_the_engine_runs():
    """``hpc-tp plan --validate --virtual-stages 1,2`` measures each layout once per V it runs."""
    from hpc_tp.plan.validate import world_layouts

    cfg = load_config("tiny", vocab_size=258, **INTERLEAVED)
    both = world_layouts(cfg, 4, 8, 64, 2, virtual_stages=(1, 2))
    # pp = 4 at V = 2 would need 8 layers; tp = 4 divides the 4 heads.
    assert {(lay.tp, lay.pp, lay.dp, lay.virtual_stages) for lay in both} == {
        (4, 1, 1, 1),
        (2, 2, 1, 1),
        (2, 2, 1, 2),
        (2, 1, 2, 1),
        (1, 4, 1, 1),
        (1, 2, 2, 1),
        (1, 2, 2, 2),
        (1, 1, 4, 1),
    }
    assert world_layouts(cfg, 4, 8, 64, 2) == [lay for lay in both if lay.virtual_stages == 1]


# -- placement: which ranks share a node ------------------------------------------------------------------

W1_TRAINED = load_config("w1", vocab_size=258)  # W1 as hpc-tp train builds it: the byte tokenizer's vocabulary
TWO_PER_NODE = get_cluster("cpu-2core").with_overrides(devices_per_node=2)


def _two_links(intra_bw=5e9, inter_bw=25e6) -> list[dict]:
    """bench comm's ping-pong records inside a node and across, at the given bandwidths."""
    return [
        {"op": op, "ranks": 4, "link": link, "bytes": n, "project_time_s": alpha + n / bw}
        for op, link, alpha, bw in (("p2p_intra", "intra", 5e-5, intra_bw), ("p2p_inter", "inter", 1e-4, inter_bw))
        for n in (2**16, 2**20, 2**22)
    ]


def test_placements_deal_ranks_to_nodes_and_decide_which_groups_cross():
    block, cyclic = Layout(2, 2, 1, 4), Layout(2, 2, 1, 4, placement="cyclic")
    assert block.node_of_rank(2).tolist() == [0, 0, 1, 1] and cyclic.node_of_rank(2).tolist() == [0, 1, 0, 1]
    assert not block.spans_nodes("tp", 2) and block.spans_nodes("pp", 2)
    assert cyclic.spans_nodes("tp", 2) and not cyclic.spans_nodes("pp", 2)
    assert launch_placement(["a", "a", "b", "b"]) == (2, "block")
    assert launch_placement(["a", "b", "a", "b"]) == (2, "cyclic")
    assert launch_placement(["a", "b", "b", "a"]) is None
    assert launch_cluster(TWO_PER_NODE, ["a"] * 4) == (TWO_PER_NODE, "block")
    four = get_cluster("cpu-2core")
    assert launch_cluster(four, ["a", "b", "a", "b"]) == (TWO_PER_NODE, "cyclic")
    with pytest.raises(ConfigError, match="placement 'scatter': expected one of block, cyclic"):
        Layout(2, 2, 1, 4, placement="scatter")


def test_bytes_between_nodes_per_placement_are_every_message_that_crosses():
    """W1 at tp=2 x pp=2 on 2 nodes of 2, m = 2 micro-batches of 4 x 256 tokens: every byte one node
    sends another, counted once, as the benchmark's network counters count them."""
    activation, tokens, m = 4 * 256 * 768 * 4, 4 * 256, 2
    tied = 129 * 768 * 4  # each tp rank's rows of the padded 258-row embedding, summed by the end stages
    by_placement = {
        p.prediction.layout.placement: p.bytes_between_nodes
        for p in compare_placements(W1_TRAINED, Layout(2, 2, 1, 4), 8, 256, TWO_PER_NODE)
    }
    # tp across (both tp groups straddle; a 2-rank all-reduce sends the buffer each way): per stage
    # 4 all-reduces per block x 2 blocks + the embedding's or the head's, per micro-batch; the loss's
    # row max and sum-exp on the last stage; a grad norm per stage; the world's finite check on a ring
    # of 4 ranks whose 4 edges all cross (1.5 x 8 bytes each).
    tp_messages = 2 * m * (4 * 2 + 1) * activation + m * (tokens * 4 + 2 * tokens * 4) + 2 * 16
    assert by_placement["cyclic"] == 2 * tp_messages + 4 * 1.5 * 8
    # tp inside: both pipeline pairs straddle: m activations forward and m gradients back each, the
    # loss broadcast and grad norm (16 bytes, twice), the tied embedding's sum; the finite check's
    # ring crosses twice.
    pairs = 2 * (2 * m * activation + 2 * 2 * 16 + 2 * tied)  # 2 pairs; a 2-rank sum sends n each way
    assert by_placement["block"] == pairs + 2 * 1.5 * 8
    assert by_placement["block"] / 2**20 == pytest.approx(25.5, abs=0.05)
    assert by_placement["cyclic"] / 2**20 == pytest.approx(216.0, abs=0.05)


def test_slow_link_ranks_tp_inside_a_node_first():
    calibration = from_comm_records(_two_links())
    placed = compare_placements(W1_TRAINED, Layout(2, 2, 1, 4), 8, 256, TWO_PER_NODE, calibration)
    assert [(p.prediction.layout.placement, p.tp_spans_nodes) for p in placed] == [("block", False), ("cyclic", True)]
    block, cyclic = (p.prediction for p in placed)
    # The difference is the tp messages priced at 25 MB/s instead of 5 GB/s: most of a second per stage.
    assert cyclic.tp_s > 0.5 and block.tp_s < 0.05 and cyclic.pp_s < block.pp_s
    assert cyclic.step_s > block.step_s + cyclic.tp_s
    # With the link as fast as a node's, the placements cost the same to within the messages' latency.
    even = compare_placements(
        W1_TRAINED, Layout(2, 2, 1, 4), 8, 256, TWO_PER_NODE, from_comm_records(_two_links(inter_bw=5e9))
    )
    assert even[0].prediction.step_s == pytest.approx(even[1].prediction.step_s, rel=0.01)


def test_search_never_proposes_tp_across_nodes_when_tp_inside_fits_whatever_the_placement():
    calibration = from_comm_records(_two_links(inter_bw=5e9))  # even where crossing is free
    block = search(W1_TRAINED, 4, 8, 256, TWO_PER_NODE, calibration, micro_batches=(4,))
    assert {p.layout.tp for p in block.ranked} == {1, 2}
    assert {r.layout["tp"] for r in block.rejected if r.kind == "nodes"} == {4}
    cyclic = search(W1_TRAINED, 4, 8, 256, TWO_PER_NODE, calibration, micro_batches=(4,), placement="cyclic")
    assert {p.layout.tp for p in cyclic.ranked} == {1}  # round-robin: every tp > 1 straddles the nodes
    assert {r.layout["tp"] for r in cyclic.rejected if r.kind == "nodes"} == {2, 4}
    assert all("predicted" in r.reason for r in cyclic.rejected if r.kind == "nodes")


def test_calibration_keeps_the_two_links_apart():
    inter_all_reduce = [
        {"op": "all_reduce", "ranks": 2, "link": "inter", "bytes": n, "project_time_s": 2 * 3e-4 + n / 2e7}
        for n in (2**16, 2**22)
    ]
    step = {
        "benchmark": "step",
        "tp": 4,
        "nodes": 2,
        "ranks_per_node": 2,
        "flops": 6e9,
        "compute_s": 0.1,
        "comm_s": 0.5,
        "dtype": "float32",
        "layers": 2,
        "micro_batch": 2,
        "seq_len": 8,
        "hidden": 16,
    }
    cal = from_comm_records(_two_links() + inter_all_reduce).merge(from_step_records([step]))
    network = cal.network(TWO_PER_NODE, tp=4)
    assert network.intra["p2p"].bw == pytest.approx(5e9) and network.inter["p2p"].bw == pytest.approx(25e6)
    assert network.inter["all_reduce"].bw == pytest.approx(2e7) and network.inter["all_reduce"].alpha == pytest.approx(
        3e-4
    )
    assert network.intra["all_gather"] == network.intra["p2p"]  # not measured: the class's ping-pong prices it
    assert cal.steps[0].ranks == 2 and cal.steps[0].inter
    messages = 4 * 2 * network.inter["all_reduce"].time("all_reduce", 4, 2 * 8 * 16 * 4)
    assert network.wait == pytest.approx((0.5 - messages) / 0.1)  # against the link its messages crossed


def test_plan_command_compares_the_placements(tmp_path, capsys):
    links, out = tmp_path / "links.json", tmp_path / "plan.json"
    links.write_text(json.dumps(_two_links()))
    argv = ["plan", "--model", "w1", "--set", "vocab_size=258", "--cluster", "cpu-2core", "--gpus", "4"]
    argv += ["--gpus-per-node", "2", "--global-batch", "8", "--seq-len", "256", "--micro-batch", "4"]
    assert main([*argv, "--calibration", str(links), "--sequence-parallel", "off", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the top layout on nodes of 2, by placement (fastest first):" in text
    assert text.index("block (tp inside a node)") < text.index("cyclic (tp across nodes)")
    placements = json.loads(out.read_text())["placements"]
    assert [p["placement"] for p in placements] == ["block", "cyclic"]
    assert placements[0]["step_s"] < placements[1]["step_s"] and placements[1]["tp_spans_nodes"]
    assert main([*argv, "--placement", "cyclic", "--top", "1"]) == 0
    top = capsys.readouterr().out.splitlines()[3]  # round-robin: tp > 1 straddles the nodes, so tp = 1 ranks first
    assert top.split()[:2] == ["1", "tp=1"], top


def test_forward_flops_count_the_query_width_and_each_windowed_layers_window_only():
    """Attention's projections and scores are counted over heads x head_dim (Gemma 3's is not the
    hidden size), and a sliding-window layer's scores and weighted values over its window alone."""
    full = ModelConfig(hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=24, ffn_hidden=96, max_seq_len=256)
    windowed = replace(full, sliding_window=48, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    seq, layers = 256, range(4)
    q, kv = 4 * 24, 2 * 24
    projections = 2 * (64 * (q + 2 * kv) + q * 64 + 2 * 64 * 96)  # qkv, out, fc1, fc2 (gelu: one fc1)
    block = projections + 4 * seq * q
    assert forward_flops_per_token(full, seq, layers, False, False) == pytest.approx(4 * block)
    saved = 3 * 4 * (seq - 48) * q  # three local layers see 48 keys, not 256
    assert forward_flops_per_token(windowed, seq, layers, False, False) == pytest.approx(4 * block - saved)
    assert forward_flops_per_token(windowed, 32, layers, False, False) == pytest.approx(
        forward_flops_per_token(full, 32, layers, False, False)
    )  # a sequence shorter than the window: nothing unseen
