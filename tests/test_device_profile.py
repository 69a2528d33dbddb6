"""``bench.device_profile``'s sorting of kernels and its summary, on names the profiler records for this
engine's and PyTorch's kernels (the profile itself needs a card: ``make gpu-check``)."""

from hpc_tp.bench import device_profile as P

KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": {"ms": 4.0, "calls": 24},
    "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16": {"ms": 1.0, "calls": 8},
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>": {"ms": 0.5, "calls": 4},
    "flash_fwd<bf16, 2>": {"ms": 0.25, "calls": 4},
    "norm_fwd<bf16>": {"ms": 0.2, "calls": 8},
    "void at::native::vectorized_layer_norm_kernel<c10::BFloat16>": {"ms": 0.1, "calls": 8},
    "hpc_tp_gelu_fwd": {"ms": 0.3, "calls": 4},
    "cupy_sum": {"ms": 0.05, "calls": 16},
    "cupy_add": {"ms": 0.7, "calls": 40},
    "Memcpy DtoD (Device -> Device)": {"ms": 0.1, "calls": 2},
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": {"ms": 0.4, "calls": 8},
}


def test_kernels_sort_into_categories_by_name():
    assert [P.category(name) for name in KERNELS] == [
        "products",
        "products",
        "attention kernels",
        "attention kernels",
        "norms, softmax",
        "norms, softmax",
        "activations",
        "reductions",
        P.OTHER,
        P.OTHER,
        "collectives",
    ]


def test_the_summary_sums_each_category_largest_first():
    row = P.summary({"wall_ms": 9.0, "kernels": KERNELS}, top=2)
    assert list(row["categories"])[:2] == ["products", P.OTHER]
    assert row["categories"]["products"] == {"ms": 5.0, "calls": 32}
    assert row["busy_ms"] == sum(k["ms"] for k in KERNELS.values()) and row["launches"] == 126
    assert [k["kernel"][:17] for k in row["top"]] == ["sm90_xmma_gemm_bf", "cutlass3x_sm90_te"]
