"""CPU compute kernels: matrix products and the fused memory-bound pieces of a block."""
