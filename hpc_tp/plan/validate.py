"""Check the planner against the engine on the ranks of this run: calibrate, predict, measure.

Collective over ``world``. Calibration is measured in-process, with every rank busy at once as
during training: the communication benchmark (all-reduce and p2p over the world), the engine's
optimizer update (``measure_update_bw``), and a step benchmark of the block stack on groups of
the layout's tp size. Then the layout (interleaved 1F1B too, at V > 1) trains a few real steps
through the trainer (``Trainer.train_step``; the first ones warm up and are not timed): its
median step time (the slowest rank's) is set against the prediction, as are its parameter and
AdamW state bytes.

A shared machine's speed drifts within seconds, so the compute rate is measured just before and
just after each layout's steps and the prediction takes their mean (load that starts or stops
during the steps then moves both sides), and the layouts are measured in rounds (every layout
once per round, ``repeats`` rounds): a layout's error is the median over rounds of predicted /
measured, each pair taken at the same moment, which a burst of load on one round does not move.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from time import perf_counter

import numpy

from ..bench.comm import benchmark_comm
from ..bench.step import benchmark_step
from ..errors import ConfigError
from ..grid import factorizations
from ..models.config import load_config
from ..module import Parameter, Partition
from ..train.optim import AdamW, sum_of_squares
from ..train.settings import TrainSettings
from ..train.trainer import Trainer
from .calibration import Calibration, from_comm_records, step_rate
from .clusters import engine_precision, get_cluster
from .cost import UPDATE_PASSES, Layout, _update_bytes, predict
from .search import chunk_counts, structural_reason, variant_reason, variants

COMM_SIZES = [2**k for k in range(6, 23, 2)]  # 64 B .. 4 MiB


def measure_update_bw(world, elements: int = 1 << 20, repeats: int = 5, dtype: str = "float32") -> float:
    """The update's rate per rank, all ranks at once, as the bytes/s the cost model divides its update
    bytes by: the engine's own AdamW step, gradient sum of squares and zeroing (``train/optim.py``;
    on CPU one fused loop each, ``train/cpu_optim.py``) on ``elements`` parameters, timed, against
    ``UPDATE_PASSES`` x the bytes ``cost._update_bytes`` counts for them. An elementwise ``c = a + b``
    would not do: the fused AdamW makes one pass where the model counts numpy's eleven, and its
    square roots and divisions, left unfused for exact bits, bound it on some CPUs."""
    shape = (elements // 1024, 1024)
    param = Parameter(numpy.ones(shape, dtype), Partition(shape))
    param.grad[...] = 1e-3
    optimizer = AdamW({"p": param}, 1e-3)
    seconds = []
    for _ in range(repeats + 1):
        world.comm.Barrier()
        start = perf_counter()
        sum_of_squares(param.grad)
        optimizer.step()
        param.grad[...] = 0
        seconds.append(perf_counter() - start)
        param.grad[...] = 1e-3
    modelled = UPDATE_PASSES * _update_bytes(param.data.size, 0, engine_precision(dtype), Layout(1, 1, 1, 1))
    return modelled / max(world.allgather_object(median(seconds[1:])))


def measure_links(world) -> Calibration:
    """All-reduce and p2p over the world, fitted (nothing to measure on one rank)."""
    if world.size == 1:
        return Calibration(sources=["measured in-process"])
    records = benchmark_comm(world, COMM_SIZES, ("all_reduce", "p2p"), iters=4, warmup=1)
    return from_comm_records(records, "measured in-process")


def measure_step_rate(world, cfg, tp: int, micro_batch: int, seq: int, dtype: str = "float32"):
    """The block stack's rate at ``tp``: the world cut into groups of tp ranks, all running at once."""
    group = world.split(color=world.rank // tp, key=world.rank)
    record = benchmark_step(group, cfg, micro_batch, seq, dtype, repeats=5, warmup=1)
    rates = world.allgather_object(step_rate(record, ranks=world.size))
    return replace(rates[0], rate=min(r.rate for r in rates), comm_s=max(r.comm_s for r in rates))


def measure_layout(
    world,
    model: str,
    overrides: dict,
    layout: Layout,
    global_batch: int,
    seq: int,
    dtype: str = "float32",
    steps: int = 3,
    warmup: int = 1,
) -> dict:
    """Median step time (slowest rank) of real training steps, and this layout's state bytes."""
    overrides = {**overrides, "sequence_parallel": layout.sequence_parallel}
    settings = TrainSettings(
        model=model,
        model_overrides=overrides,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        ep=layout.ep,
        micro_batch=layout.micro_batch,
        global_batch=global_batch,
        seq_len=seq,
        steps=steps + warmup,
        dtype=dtype,
        recompute=layout.recompute,
        schedule=layout.schedule,
        virtual_stages=layout.virtual_stages,
        distributed_optimizer=layout.distributed_optimizer,
        progress=False,
    )
    trainer = Trainer(settings, world)
    times, comms = [], []
    for i in range(steps + warmup):
        record = trainer.train_step()
        if i >= warmup:
            times.append(max(world.allgather_object(record["step_s"])))
            comms.append(max(world.allgather_object(record["comm_s"])))
    states = world.allgather_object(
        (trainer.grid.coords.pp, trainer.model.local_bytes(), trainer.optimizer.state_bytes())
    )
    return dict(step_s=median(times), comm_s=median(comms), cfg=trainer.cfg, states=states)


def bracket(before, after):
    """The compute rate over a measurement from the rates just before and just after it: the mean of
    their step times (a harmonic mean of the rates), and of their time in collectives."""
    return replace(before, rate=2 / (1 / before.rate + 1 / after.rate), comm_s=(before.comm_s + after.comm_s) / 2)


def world_layouts(
    cfg,
    world_size: int,
    global_batch: int,
    seq: int,
    micro_batch: int,
    distributed_optimizer: bool = False,
    virtual_stages=(1,),
) -> list[Layout]:
    """Every tp x pp x dp of the world that the model allows at this micro-batch (1F1B at pp > 1),
    with ZeRO-1 at dp > 1 if ``distributed_optimizer``, once per V of ``virtual_stages`` the engine
    runs there (``search``'s own rule)."""
    return [
        Layout(
            t,
            p,
            d,
            micro_batch,
            sequence_parallel=sp,
            distributed_optimizer=distributed_optimizer and d > 1,
            virtual_stages=v,
        )
        for t, p, d in factorizations(world_size)
        if structural_reason(cfg, t, p, d, global_batch) is None and global_batch % (d * micro_batch) == 0
        for sp, ep in variants(cfg, t, d, (cfg.sequence_parallel,), (1,))
        if variant_reason(cfg, t, d, seq, sp, ep) is None
        for v in chunk_counts(cfg, p, global_batch // (d * micro_batch), "1f1b", virtual_stages)
    ]


def validate(
    world,
    model: str = "tiny",
    overrides=None,
    global_batch: int = 8,
    seq: int = 32,
    micro_batch: int = 4,
    layouts=None,
    dtype: str = "float32",
    cluster="cpu-2core",
    steps: int = 3,
    repeats: int = 3,
    warmup: int = 1,
    distributed_optimizer: bool = False,
    virtual_stages=(1,),
) -> tuple[list[dict], Calibration]:
    """Predicted against measured for ``layouts`` (default: ``world_layouts``, so interleaved 1F1B
    at each V of ``virtual_stages`` where it runs). Returns (rows, the last round's calibration); a
    row has the layout, predicted_s and measured_s (medians over rounds), error (the median over
    rounds of predicted / measured, minus 1), errors (each round's), measured_comm_s, and the
    predicted and measured parameter + optimizer bytes of the busiest rank."""
    overrides = dict(overrides or {})
    cfg = load_config(model, **{"vocab_size": 258, **overrides})  # the byte tokenizer's vocabulary
    cluster = get_cluster(cluster) if isinstance(cluster, str) else cluster
    cluster = cluster.with_overrides(precision=engine_precision(dtype))
    if layouts is None:
        layouts = world_layouts(cfg, world.size, global_batch, seq, micro_batch, distributed_optimizer, virtual_stages)
    if not layouts:
        raise ConfigError(f"no layout of {world.size} ranks fits model {model} with global batch {global_batch}")
    if repeats < 1 or steps < 1:
        raise ConfigError(f"validate: repeats {repeats} and steps {steps}: expected positive whole numbers")
    # The step benchmark feeds its blocks a whole sequence, which sequence-parallel blocks would take
    # for a shard: the rate and wait are measured on plain tp blocks (the same GEMMs and bytes).
    plain = replace(cfg, sequence_parallel=False)
    pairs = {layout: [] for layout in layouts}
    for _ in range(repeats):
        calibration = measure_links(world)
        for layout in layouts:
            before = measure_step_rate(world, plain, layout.tp, layout.micro_batch, seq, dtype)
            calibration.mem_bw = measure_update_bw(world, dtype=dtype)
            measured = measure_layout(world, model, overrides, layout, global_batch, seq, dtype, steps, warmup)
            rate = bracket(before, measure_step_rate(world, plain, layout.tp, layout.micro_batch, seq, dtype))
            calibration.steps = [s for s in calibration.steps if s.tp != layout.tp] + [rate]
            pairs[layout].append((predict(cfg, layout, global_batch, seq, cluster, calibration), measured))
    return [_row(layout, pairs[layout]) for layout in layouts], calibration


def _row(layout: Layout, pairs) -> dict:
    predicted, measured = pairs[-1]
    errors = [p.step_s / m["step_s"] - 1 for p, m in pairs]
    return dict(
        layout=layout,
        predicted_s=median(p.step_s for p, _ in pairs),
        measured_s=median(m["step_s"] for _, m in pairs),
        error=median(errors),
        errors=errors,
        measured_comm_s=median(m["comm_s"] for _, m in pairs),
        predicted_state_bytes=max(s.params + s.optimizer for s in predicted.memory.values()),
        measured_state_bytes=max(p + o for _, p, o in measured["states"]),
        prediction=predicted,
    )


def format_rows(rows) -> str:
    lines = [
        f"{'layout':<36} {'V':>2} {'predicted':>10} {'measured':>10} {'error':>7} {'per round':>24} "
        f"{'states pred/meas':>22}"
    ]
    for r in rows:
        rounds = " ".join(f"{e * 100:+.0f}%" for e in r["errors"])
        lines.append(
            f"{r['layout'].describe(chunks=False):<36} {r['layout'].chunks_shown:>2} "
            f"{r['predicted_s'] * 1e3:8.1f}ms {r['measured_s'] * 1e3:8.1f}ms "
            f"{r['error'] * 100:+6.1f}% {rounds:>24} "
            f"{r['predicted_state_bytes']:>10}/{r['measured_state_bytes']:<10}"
        )
    return "\n".join(lines)
