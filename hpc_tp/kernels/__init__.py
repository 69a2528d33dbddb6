"""Array-level compute: matrix products (MKL, cuBLAS), fused CPU and CUDA kernels, activations and
attention on plain arrays. No Modules, no communicators: the layers above call these."""
