"""Stage partition: which layers each pipeline rank runs, and the rank's model.

The model is cut into pp * V contiguous chunks (V virtual stages per rank, ``--virtual-stages``;
V = 1: one chunk per rank, its stage). Rank r holds chunks r, r + pp, r + 2 pp, ...: with V > 1
its layers are not contiguous, which is what lets the interleaved schedule pass a micro-batch
around the ring V times in smaller steps. Parameter names keep the whole model's layer indices,
so a checkpoint does not depend on the layout.

A pipeline is as fast as its slowest chunk, so layers are split to balance an estimate of each
chunk's work: each block's forward flops per token (a sliding-window layer's attention covers its
window, an MoE layer's MLP its top-k experts), plus the embedding on the first chunk and
the final norm, LM head and cross entropy on the last (for a small model with a large
vocabulary the head can weigh as much as several blocks). An explicit split (``--pp-layers
3,2,3``, one count per chunk) overrides the estimate. Every chunk runs at least one block.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..models.config import ModelConfig
from ..models.gpt import GPTModel


def mlp_flops_per_row(cfg: ModelConfig, width: int | None = None) -> float:
    """One row through an MLP of ``width`` (default: the dense one)."""
    f = cfg.ffn_hidden if width is None else width
    return 2.0 * ((2 if cfg.gated_mlp else 1) * cfg.hidden * f + f * cfg.hidden)


def layer_flops_per_token(cfg: ModelConfig, layer: int, seq: int, expert_rows_per_token: float | None = None) -> float:
    """Forward flops per token of block ``layer`` (a global index) at sequence ``seq``: its projections,
    its scores and weighted values over the keys it sees (a sliding-window layer: its window only), and
    its MLP. An MoE layer's MLP is ``expert_rows_per_token`` expert rows (default: top_k, the model's
    flops), its router and its shared expert with that expert's gate."""
    h = cfg.hidden
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    window = cfg.window_of(layer)
    keys = min(seq, window) if window else seq
    attention = 2 * (h * (q + 2 * kv) + q * h) + 4 * keys * q
    if not cfg.is_moe_layer(layer):
        return attention + mlp_flops_per_row(cfg)
    rows = cfg.top_k if expert_rows_per_token is None else expert_rows_per_token
    experts = rows * mlp_flops_per_row(cfg, cfg.expert_ffn_hidden) + 2 * h * cfg.num_experts
    shared = cfg.shared_expert_ffn_hidden
    if shared:
        experts += mlp_flops_per_row(cfg, shared) + 2 * h
    return attention + experts


def edge_costs(cfg: ModelConfig) -> tuple[float, float]:
    """Forward flops per token of the embedding (first stage) and of the final norm + head + loss (last)."""
    embedding = 2 * cfg.hidden  # lookup and position add: memory traffic more than flops
    head = 2 * cfg.hidden * cfg.vocab_size + 5 * cfg.vocab_size  # logits, then max, exp, sum and the target pick
    return float(embedding), float(head)


def stage_costs(cfg: ModelConfig, seq_len: int | None = None) -> tuple[float, list[float], float]:
    """Forward flops per token of (the embedding, each block in order, the final norm + head + loss):
    blocks differ where some have a sliding window or experts."""
    t = cfg.max_seq_len if seq_len is None else seq_len
    embedding, head = edge_costs(cfg)
    return embedding, [layer_flops_per_token(cfg, i, t) for i in range(cfg.n_layers)], head


def stage_layers(
    n_layers: int, pp: int, weights=None, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[range]:
    """Contiguous ranges of layer indices, one per stage: the costliest stage as cheap as it can be,
    and among such splits the most even one (least sum of squared stage costs).

    ``weights``: cost of each layer (default: all equal); ``first_extra`` / ``last_extra``: cost the
    first / last stage carries besides its layers (embedding, head).
    """
    if not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"--pp {pp!r} must be a positive integer")
    if pp > n_layers:
        raise ConfigError(
            f"--pp {pp} is more pipeline stages than the model's {n_layers} layers: "
            f"every stage needs at least one layer, use --pp <= {n_layers}"
        )
    weights = [1.0] * n_layers if weights is None else [float(w) for w in weights]
    if len(weights) != n_layers:
        raise ConfigError(f"{len(weights)} layer weights given for a model of {n_layers} layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(stage, start, stop):
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == pp - 1 else 0.0)
        return prefix[stop] - prefix[start] + extra

    worst, _ = _best_split(n_layers, pp, cost, max)
    allowed = worst * (1 + 1e-12)
    _, stops = _best_split(
        n_layers,
        pp,
        lambda s, a, b: cost(s, a, b) ** 2 if cost(s, a, b) <= allowed else float("inf"),
        lambda value, rest: value + rest,
    )
    return [range(a, b) for a, b in zip([0] + stops[:-1], stops)]


def _best_split(n_layers, pp, value, combine):
    """Dynamic programme over (stage, first layer): the split minimising ``combine`` of the stages'
    ``value(stage, start, stop)``; every stage takes at least one layer. Returns (best, stops)."""
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(pp + 1)]
    take = [[0] * (n_layers + 1) for _ in range(pp + 1)]
    best[pp][n_layers] = 0.0
    for s in range(pp - 1, -1, -1):
        for start in range(s, n_layers - (pp - 1 - s)):
            for stop in range(start + 1, n_layers - (pp - 1 - s) + 1):
                total = combine(value(s, start, stop), best[s + 1][stop])
                if total < best[s][start]:
                    best[s][start], take[s][start] = total, stop
    stops, start = [], 0
    for s in range(pp):
        start = take[s][start]
        stops.append(start)
    return best[0][0], stops


def check_virtual_stages(virtual_stages, pp: int, n_layers: int):
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ConfigError(f"--virtual-stages {virtual_stages!r}: expected a positive integer")
    if virtual_stages > 1 and pp == 1:
        raise ConfigError(
            f"--virtual-stages {virtual_stages} needs a pipeline (--pp > 1): one rank runs its layers in one piece"
        )
    if virtual_stages > 1 and pp * virtual_stages > n_layers:
        raise ConfigError(
            f"--pp {pp} x --virtual-stages {virtual_stages} = {pp * virtual_stages} chunks is more "
            f"than the model's {n_layers} layers: every chunk needs at least one layer"
        )


def balanced_layers(cfg: ModelConfig, pp: int, seq_len: int | None = None, virtual_stages: int = 1) -> list[range]:
    """The default split of ``cfg`` into ``pp * virtual_stages`` chunks, from ``stage_costs``."""
    check_virtual_stages(virtual_stages, pp, cfg.n_layers)
    embedding, blocks, head = stage_costs(cfg, seq_len)
    return stage_layers(cfg.n_layers, pp * virtual_stages, blocks, first_extra=embedding, last_extra=head)


def layers_from_counts(counts, n_layers: int, pp: int, virtual_stages: int = 1) -> list[range]:
    """Ranges from an explicit number of layers per chunk, checked against the model, --pp and
    --virtual-stages."""
    counts = list(counts)
    shown = ",".join(str(c) for c in counts)
    if len(counts) != pp * virtual_stages:
        expected = (
            f"--pp is {pp}"
            if virtual_stages == 1
            else f"--pp {pp} x --virtual-stages {virtual_stages} is {pp * virtual_stages} chunks"
        )
        raise ConfigError(f"--pp-layers {shown} names {len(counts)} stages but {expected}")
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise ConfigError(f"--pp-layers {shown}: every stage needs a positive whole number of layers")
    if sum(counts) != n_layers:
        raise ConfigError(f"--pp-layers {shown} adds up to {sum(counts)} layers but the model has {n_layers}")
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def parse_pp_layers(spec: str, n_layers: int, pp: int, virtual_stages: int = 1) -> list[range]:
    """``"3,2,3"`` -> [range(0, 3), range(3, 5), range(5, 8)]."""
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(
            f"--pp-layers {spec!r}: expected comma-separated layer counts, one per stage "
            f"(per chunk with --virtual-stages), e.g. 3,2,3"
        ) from None
    return layers_from_counts(counts, n_layers, pp, virtual_stages)


def parse_virtual_stages(spec: str) -> tuple[int, ...]:
    """``"1,2"`` -> (1, 2): the chunk counts a benchmark or the planner tries."""
    try:
        counts = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise ConfigError(f"--virtual-stages {spec!r}: expected comma-separated positive integers, e.g. 1,2") from None
    if any(v < 1 for v in counts):
        raise ConfigError(f"--virtual-stages {spec}: every count must be a positive integer")
    return counts


def rank_layers(chunks: list[range], pp: int, rank: int) -> list[int]:
    """The layers of ``rank``: chunks rank, rank + pp, ... of the whole model's ``chunks``."""
    return [layer for chunk in chunks[rank::pp] for layer in chunk]


def chunk_runs(layer_ids) -> list[list[int]]:
    """Positions in ``layer_ids`` (a rank's layers, in order) of each of its chunks: the runs of
    consecutive layer indices (two chunks of one rank are pp > 1 chunks apart, never adjacent)."""
    chunks = []
    for position, layer in enumerate(layer_ids):
        if chunks and layer_ids[position - 1] == layer - 1:
            chunks[-1].append(position)
        else:
            chunks.append([position])
    return chunks


def model_chunks(model) -> list[list[int]]:
    """Positions in ``model.layers`` of each of the rank's chunks."""
    return chunk_runs(model.layer_ids)


def build_stage(
    cfg: ModelConfig, grid, dtype="float64", seed: int = 0, layers_per_stage=None, virtual_stages: int = 1
) -> GPTModel:
    """This rank's part of the model: its chunks' layers, the embedding on the first rank (first
    chunk), the final norm, head and loss on the last (last chunk); MoE experts spread over the
    grid's ep group. ``layers_per_stage``: None (balanced by cost), a list of layer counts, or a
    list of ranges (as ``stage_layers`` gives), one per chunk."""
    pp = grid.pp_size
    check_virtual_stages(virtual_stages, pp, cfg.n_layers)
    if layers_per_stage is None:
        ranges = balanced_layers(cfg, pp, virtual_stages=virtual_stages)
    elif all(isinstance(r, range) for r in layers_per_stage):
        ranges = layers_from_counts([len(r) for r in layers_per_stage], cfg.n_layers, pp, virtual_stages)
        if list(layers_per_stage) != ranges:
            raise ConfigError(f"stage layer ranges {list(layers_per_stage)} are not contiguous from layer 0")
    else:
        ranges = layers_from_counts(layers_per_stage, cfg.n_layers, pp, virtual_stages)
    return GPTModel(
        cfg,
        grid.tp,
        dtype=dtype,
        seed=seed,
        layers=rank_layers(ranges, pp, grid.coords.pp),
        has_embedding=grid.is_first_stage,
        has_head=grid.is_last_stage,
        ep_comm=grid.ep,
    )
