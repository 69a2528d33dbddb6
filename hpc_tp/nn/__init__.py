"""Transformer building blocks made of tensor-parallel layers: norms, attention split by heads,
the column-then-row MLP, and the pre-LN block."""
