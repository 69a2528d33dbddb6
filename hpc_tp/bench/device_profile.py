"""Where a step's device time goes: every kernel it launches (cuBLAS's products, this engine's fused
kernels, cupy's elementwise work and reductions, NCCL), timed on the device by CUPTI through
PyTorch's profiler, which records every kernel of the process, whatever library launched it. The
same breakdown for PyTorch's own step says which category holds the difference between the two.

Kernels are sorted into ``CATEGORIES`` by their names (the first pattern that matches, ignoring
case); the rest are the elementwise work between them (adds, casts, copies, scales). Needs torch with
CUDA (``torch_peer.torch_missing``); ``make gpu-check`` runs it where torch imports.
"""

from __future__ import annotations

import time

CATEGORIES = (
    ("attention kernels", ("flash", "fmha", "attention")),
    ("products", ("gemm", "gemv", "xmma", "cutlass", "splitk")),
    ("norms, softmax", ("norm", "softmax")),
    ("activations", ("gelu", "silu", "swiglu")),
    ("collectives", ("nccl",)),
    ("reductions", ("reduce", "sum")),
)
OTHER = "other elementwise"


def kernel_times(step, steps: int = 3) -> dict:
    """Each kernel ``step()`` launches, by name: its device ms and launches a step (the mean of
    ``steps`` after an untimed one), and the step's wall ms under the profiler."""
    import torch  # optional: the profiler is PyTorch's (CUPTI), only where torch imports
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()  # the whole device, so cupy's streams too
    with profile(activities=[ProfilerActivity.CUDA]) as recorded:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = {}
    for event in recorded.key_averages():
        micros = getattr(event, "self_device_time_total", None)
        if micros is None:  # the name before PyTorch 2.4
            micros = getattr(event, "self_cuda_time_total", 0)
        if micros > 0:  # the host's runtime calls are recorded too, with no device time
            kernels[event.key] = {"ms": micros / 1e3 / steps, "calls": event.count / steps}
    return {"wall_ms": 1e3 * wall / steps, "kernels": kernels}


def category(name: str) -> str:
    lowered = name.lower()
    return next((label for label, patterns in CATEGORIES if any(p in lowered for p in patterns)), OTHER)


def by_category(kernels: dict) -> dict[str, dict]:
    """``kernel_times``' kernels summed by ``category``: ms and launches a step, largest first."""
    sums: dict[str, dict] = {}
    for name, kernel in kernels.items():
        total = sums.setdefault(category(name), {"ms": 0.0, "calls": 0.0})
        total["ms"] += kernel["ms"]
        total["calls"] += kernel["calls"]
    return dict(sorted(sums.items(), key=lambda item: -item[1]["ms"]))


def summary(profile: dict, top: int = 6) -> dict:
    """A report row: wall and device-busy ms a step, the categories, the ``top`` kernels by time."""
    kernels = profile["kernels"]
    largest = sorted(kernels.items(), key=lambda item: -item[1]["ms"])[:top]
    return {
        "wall_ms": profile["wall_ms"],
        "busy_ms": sum(k["ms"] for k in kernels.values()),
        "launches": sum(k["calls"] for k in kernels.values()),
        "categories": by_category(kernels),
        "top": [{"kernel": name[:80], **kernel} for name, kernel in largest],
    }
