"""What the planner knows about a machine: devices, their memory and speed, and two link classes.

A cluster is nodes of ``devices_per_node`` devices. Links inside a node (NVLink, shared memory)
and across nodes (InfiniBand, Ethernet) each get an alpha-beta model: a message of n bytes
costs ``alpha + n / bandwidth`` per hop. ``inter_bw`` is per device, as when every GPU has its
own network adapter (DGX nodes: 8 x 200 Gb/s HDR per node is 25 GB/s per GPU).

``gemm_efficiency`` is the share of ``device_flops`` that large matrix products reach: the
planner counts matrix-product FLOPs, so step time is FLOPs / (device_flops * efficiency). A
calibration (``calibration.py``) replaces these datasheet numbers with measured ones.

``compute_units`` is set for CPU nodes, where a device is a rank and ranks share cores: with
more ranks on a node than cores, each rank gets ``compute_units / ranks`` of the node's compute.

Precision says how many bytes each kind of tensor takes. At float32/float64 this engine keeps
parameters, gradients and both AdamW moments in one dtype (``engine_precision``); GPU training
runs of large models use mixed precision: bf16 weights, fp32 gradients (the engine accumulates a
half model's gradients in float32, ``module.grad_buffer``, as Megatron-LM's main_grad does for
bf16), fp32 master weights and moments: 2 + 4 + 12 = 18 bytes per parameter (the ZeRO paper
counts 16, with 2-byte gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int  # the weights the forward pass reads
    grad_bytes: int
    optimizer_bytes: int  # per parameter: master copy (if any) and the two AdamW moments
    activation_bytes: int  # per saved activation element

    @property
    def training_bytes_per_param(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def engine_precision(dtype: str = "float32") -> Precision:
    """This engine: parameters, gradients, exp_avg and exp_avg_sq all in ``dtype``."""
    size = {"float32": 4, "float64": 8}.get(dtype)
    if size is None:
        raise ConfigError(f"dtype {dtype!r}: the engine trains in float32 or float64")
    return Precision(dtype, size, size, 2 * size, size)


MIXED_BF16 = Precision("bf16 mixed", 2, 4, 12, 2)


@dataclass(frozen=True)
class Cluster:
    name: str
    devices_per_node: int
    device_mem: float  # bytes usable per device
    device_flops: float  # peak FLOP/s per device in the precision trained
    intra_bw: float  # bytes/s, one direction, per device, inside a node
    inter_bw: float  # bytes/s, one direction, per device, across nodes
    intra_alpha: float = 5e-6  # seconds per message hop
    inter_alpha: float = 2e-5
    mem_bw: float = 1e12  # bytes/s of device memory: elementwise work (the optimizer update)
    gemm_efficiency: float = 0.7
    compute_units: int | None = None  # CPU nodes: cores the ranks of a node share
    precision: Precision = MIXED_BF16

    def with_overrides(self, **values) -> Cluster:
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def rank_flops(self, ranks_per_node: float) -> float:
        """Sustained matrix-product FLOP/s one rank gets when ``ranks_per_node`` ranks compute at once
        on a node (on average: ranks waiting in a pipeline bubble yield their core)."""
        share = 1.0
        if self.compute_units is not None and ranks_per_node > self.compute_units:
            share = self.compute_units / ranks_per_node
        return self.device_flops * self.gemm_efficiency * share

    def rank_mem_bw(self, ranks_per_node: int) -> float:
        """Memory bandwidth of one rank: on a CPU node the ranks share the node's."""
        if self.compute_units is None:
            return self.mem_bw
        return self.mem_bw / max(1, ranks_per_node)

    def link(self, inter: bool) -> tuple[float, float]:
        """(alpha seconds, bandwidth bytes/s) of a hop inside a node or across nodes."""
        return (self.inter_alpha, self.inter_bw) if inter else (self.intra_alpha, self.intra_bw)


GB, GiB, TFLOPS = 1e9, 2**30, 1e12

CLUSTERS = {
    # DGX A100 80GB: bf16 dense 312 TFLOP/s, NVLink3 300 GB/s each way, 8 x HDR 200 Gb/s adapters.
    "dgx-a100": Cluster("dgx-a100", 8, 80 * GiB, 312 * TFLOPS, 300 * GB, 25 * GB, mem_bw=2.0e12),
    # DGX H100: bf16 dense 989 TFLOP/s, NVLink4 450 GB/s each way, 8 x NDR 400 Gb/s adapters.
    "dgx-h100": Cluster("dgx-h100", 8, 80 * GiB, 989 * TFLOPS, 450 * GB, 50 * GB, mem_bw=3.35e12),
    # This kind of 2-core CPU machine, numpy/OpenBLAS float32: ~100 GFLOP/s per core (GEMM 2048^3 on
    # one thread), shared-memory MPI ~3-7 GB/s. A "device" is a rank: up to 4 per node (the test
    # suite's largest launch), oversubscribed ranks sharing the two cores.
    "cpu-2core": Cluster(
        "cpu-2core",
        4,
        8 * GiB,
        100e9,
        5 * GB,
        1 * GB,
        intra_alpha=2e-5,
        inter_alpha=5e-5,
        mem_bw=8 * GB,
        gemm_efficiency=0.6,
        compute_units=2,
        precision=engine_precision("float32"),
    ),
}


def get_cluster(name: str) -> Cluster:
    if name not in CLUSTERS:
        raise ConfigError(f"--cluster {name!r}: expected one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name]
