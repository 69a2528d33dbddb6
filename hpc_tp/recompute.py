"""Activation recomputation modes, shared by the settings, the pipeline and the planner.

"full": a block keeps only its input and reruns its forward in backward. "selective" (Korthikanti
et al. 2022, section 5): attention keeps Q, K and V but not its softmax outputs or dropout masks,
the [b, heads, s, s] tensors that cost the most memory per FLOP, only each query row's
log-sum-exp ([b, heads, s]); backward makes the softmax again tile by tile from Q K^T and those
statistics (as FlashAttention's backward does), so no layer's whole softmax is rebuilt, and
redraws the dropout masks (``nn.attention``).
"""

from __future__ import annotations

from .errors import ConfigError

MODES = ("none", "selective", "full")


def recompute_mode(value) -> str:
    """One of ``MODES`` from a mode or the old boolean spelling (True: full, False: none)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value in MODES:
        return value
    raise ConfigError(f"--recompute {value!r}: expected {', '.join(MODES)}")
