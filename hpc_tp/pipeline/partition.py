"""Stage partition: which contiguous layers each pipeline stage runs, and the stage's model.

A pipeline is as fast as its slowest stage, so layers are split to balance an estimate of each
stage's work: the blocks' forward flops per token, plus the embedding on the first stage and
the final norm, LM head and cross entropy on the last (for a small model with a large
vocabulary the head can weigh as much as several blocks). An explicit split (``--pp-layers
3,2,3``) overrides the estimate. Every stage runs at least one block.
"""
from __future__ import annotations

from ..errors import ConfigError
from ..models.config import ModelConfig
from ..models.gpt import GPTModel


def stage_costs(cfg: ModelConfig, seq_len: int | None = None) -> tuple[float, float, float]:
    """Forward flops per token of (embedding, one block, final norm + head + loss)."""
    t = cfg.max_seq_len if seq_len is None else seq_len
    h, f, v = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    kv = cfg.n_kv_heads * cfg.head_dim
    matmuls = h * (h + 2 * kv) + h * h + (2 if cfg.activation == "swiglu" else 1) * h * f + f * h
    block = 2 * matmuls + 4 * t * h  # projections, then scores and weighted values over t keys
    embedding = 2 * h                # lookup and position add: memory traffic more than flops
    head = 2 * h * v + 5 * v         # logits, then max, exp, sum and the target pick per vocab entry
    return float(embedding), float(block), float(head)


def stage_layers(n_layers: int, pp: int, weights=None, first_extra: float = 0.0,
                 last_extra: float = 0.0) -> list[range]:
    """Contiguous ranges of layer indices, one per stage: the costliest stage as cheap as it can be,
    and among such splits the most even one (least sum of squared stage costs).

    ``weights``: cost of each layer (default: all equal); ``first_extra`` / ``last_extra``: cost the
    first / last stage carries besides its layers (embedding, head).
    """
    if not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"--pp {pp!r} must be a positive integer")
    if pp > n_layers:
        raise ConfigError(f"--pp {pp} is more pipeline stages than the model's {n_layers} layers: "
                          f"every stage needs at least one layer, use --pp <= {n_layers}")
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
    _, stops = _best_split(n_layers, pp, lambda s, a, b: cost(s, a, b) ** 2 if cost(s, a, b) <= allowed
                           else float("inf"), lambda value, rest: value + rest)
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


def balanced_layers(cfg: ModelConfig, pp: int, seq_len: int | None = None) -> list[range]:
    """The default split of ``cfg`` into ``pp`` stages, from ``stage_costs``."""
    embedding, block, head = stage_costs(cfg, seq_len)
    return stage_layers(cfg.n_layers, pp, [block] * cfg.n_layers, first_extra=embedding, last_extra=head)


def layers_from_counts(counts, n_layers: int, pp: int) -> list[range]:
    """Ranges from an explicit number of layers per stage, checked against the model and --pp."""
    counts = list(counts)
    shown = ",".join(str(c) for c in counts)
    if len(counts) != pp:
        raise ConfigError(f"--pp-layers {shown} names {len(counts)} stages but --pp is {pp}")
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise ConfigError(f"--pp-layers {shown}: every stage needs a positive whole number of layers")
    if sum(counts) != n_layers:
        raise ConfigError(f"--pp-layers {shown} adds up to {sum(counts)} layers but the model has {n_layers}")
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def parse_pp_layers(spec: str, n_layers: int, pp: int) -> list[range]:
    """``"3,2,3"`` -> [range(0, 3), range(3, 5), range(5, 8)]."""
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-layers {spec!r}: expected comma-separated layer counts, one per stage, "
                          f"e.g. 3,2,3") from None
    return layers_from_counts(counts, n_layers, pp)


def build_stage(cfg: ModelConfig, grid, dtype="float64", seed: int = 0, layers_per_stage=None) -> GPTModel:
    """This rank's stage of the model: its layers, the embedding on the first stage, the final
    norm, head and loss on the last; MoE experts spread over the grid's ep group.
    ``layers_per_stage``: None (balanced by cost), a list of layer counts, or a list of ranges
    (as ``stage_layers`` gives)."""
    if layers_per_stage is None:
        ranges = balanced_layers(cfg, grid.pp_size)
    elif all(isinstance(r, range) for r in layers_per_stage):
        ranges = layers_from_counts([len(r) for r in layers_per_stage], cfg.n_layers, grid.pp_size)
        if list(layers_per_stage) != ranges:
            raise ConfigError(f"stage layer ranges {list(layers_per_stage)} are not contiguous from layer 0")
    else:
        ranges = layers_from_counts(layers_per_stage, cfg.n_layers, grid.pp_size)
    return GPTModel(cfg, grid.tp, dtype=dtype, seed=seed, layers=ranges[grid.coords.pp],
                    has_embedding=grid.is_first_stage, has_head=grid.is_last_stage, ep_comm=grid.ep)
