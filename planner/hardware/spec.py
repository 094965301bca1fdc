"""Pydantic schemas for GPU specs, node topologies and clusters (YAML files under hardware_specs/).

Units in the YAML are the ones datasheets use (TFLOP/s, GiB, GB/s, microseconds); the properties
convert to SI so that the cost model works in FLOP/s, bytes and seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from planner.errors import ConfigError

DType = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]

# The most process groups a rank can communicate in: data, tensor and pipeline parallel, and with experts the
# all-to-all group and the experts' replicas (`planner.cost.terms.group_sizes`, which counts a plan's own).
PROCESS_GROUPS = 5

# Allocator fragmentation as a share of the bytes a rank holds, where a spec does not say (`MemoryReserve`).
FRAGMENTATION = 0.05


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Efficiencies(_Strict):
    """Achieved fraction of peak per op class (roofline efficiencies), calibrated per GPU generation."""

    matmul: float = Field(0.75, gt=0, le=1, description="large dense GEMMs, fraction of peak TFLOP/s")
    attention: float = Field(0.55, gt=0, le=1, description="attention kernels, fraction of peak TFLOP/s")
    memory: float = Field(0.80, gt=0, le=1, description="memory-bound ops, fraction of peak bandwidth")
    network: float = Field(0.85, gt=0, le=1, description="collectives, fraction of link bandwidth")
    gemm_half_dim: float = Field(
        256.0,
        ge=0,
        description="GEMM size (smallest dimension, after TP sharding) at which a GEMM reaches "
        "half of `matmul`: efficiency = matmul * d / (d + gemm_half_dim)",
    )


class MemoryReserve(_Strict):
    """Memory a real run loses per GPU beyond its tensors: the one home of what a plan keeps free.

    Two kinds. Bytes outside PyTorch's allocator, kept free by every plan: ``cuda_context_gib +
    nccl_gib_per_group * groups``, with groups the process groups of more than one rank the plan communicates
    in (`planner.cost.terms.comm_reserve_bytes`); `bytes` gives them, a --memory-reserve override replaces
    them. And the caching allocator's fragmentation, a share of what a rank holds (states, activations,
    buffers), which grows with them: `CostOptions.for_cluster` reads it, the one place, and the cost model's
    peak (`planner.cost.memory.memory_report`, `terms.rank_peak_bytes`) adds it.
    """

    cuda_context_gib: float = Field(0.0, ge=0, description="CUDA context and library handles, GiB")
    nccl_gib_per_group: float = Field(0.0, ge=0, description="communication buffers per process group, GiB")
    fragmentation: float = Field(
        FRAGMENTATION, ge=0, lt=0.5,
        description="allocator fragmentation, as a share of the bytes a rank holds (states, activations, buffers)",
    )

    def bytes(self, groups: int) -> int:
        """The bytes outside the allocator a plan communicating in `groups` process groups keeps free."""
        return int((self.cuda_context_gib + self.nccl_gib_per_group * groups) * 2**30)


class TopologySpec(_Strict):
    """How GPUs are wired: inside a node (NVLink/NVSwitch/PCIe) and between nodes (InfiniBand/Ethernet)."""

    gpus_per_node: PositiveInt
    intra_node_link: str = Field(description="e.g. 'NVLink 4 via NVSwitch'")
    intra_node_bandwidth_gbps: PositiveFloat = Field(description="GB/s per GPU, one direction")
    intra_node_latency_us: PositiveFloat
    inter_node_link: str = Field(description="e.g. '8x ConnectX-7 400 Gb/s InfiniBand'")
    inter_node_bandwidth_gbps: PositiveFloat = Field(description="GB/s per GPU, one direction")
    inter_node_latency_us: PositiveFloat

    @property
    def intra_node_bandwidth(self) -> float:
        return self.intra_node_bandwidth_gbps * 1e9

    @property
    def inter_node_bandwidth(self) -> float:
        return self.inter_node_bandwidth_gbps * 1e9

    @property
    def intra_node_latency(self) -> float:
        return self.intra_node_latency_us * 1e-6

    @property
    def inter_node_latency(self) -> float:
        return self.inter_node_latency_us * 1e-6


class Price(_Strict):
    """What one GPU-hour costs to rent, with where and when the figure was read (prices move)."""

    usd_per_gpu_hour: float = Field(gt=0, allow_inf_nan=False)
    source: str = Field(min_length=1)
    date: str = Field(min_length=1, description="when the source was read (YYYY-MM or YYYY-MM-DD)")


class GPUSpec(_Strict):
    """One accelerator: dense (not sparse) peak throughput per dtype, memory and its bandwidth."""

    kind: Literal["gpu"] = "gpu"
    name: str
    display_name: str
    aliases: list[str] = Field(default_factory=list, description="other names that resolve to this spec")
    vendor: str
    peak_tflops: dict[DType, PositiveFloat] = Field(description="dense peak TFLOP/s per dtype")
    # Bounded: 1e300 GiB would overflow the byte count (OverflowError) instead of being a clear spec error.
    memory_gib: PositiveFloat = Field(le=2**20, allow_inf_nan=False, description="GiB per GPU (at most 1 PiB)")
    memory_bandwidth_gbps: PositiveFloat = Field(description="GB/s")
    topology: TopologySpec = Field(description="the usual node this GPU ships in")
    efficiency: Efficiencies = Efficiencies()
    attention_backend: Literal["flash", "efficient", "cudnn", "math"] = Field(
        "flash",
        description="the scaled_dot_product_attention backend torch picks on this GPU for the model's attention: "
        "flash (sm80+), efficient (memory-efficient, sm50+) and cudnn keep q, k, v, the output and the log-sum-exp; "
        "math keeps the s x s probabilities too (planner.cost.memory.activation_bytes)",
    )
    memory_reserve: MemoryReserve = MemoryReserve()
    sources: dict[str, str] = Field(description="datasheet or paper for each number")
    # Not part of what a plan depends on: excluded from dumps, so plans' input digests are unchanged by it.
    price: Price | None = Field(None, exclude=True, description="rental price per GPU-hour, for `planner sweep`")

    @model_validator(mode="after")
    def _has_fp32(self) -> GPUSpec:
        if "fp32" not in self.peak_tflops:
            raise ValueError("peak_tflops must give at least 'fp32'")
        if self.memory_reserve.bytes(PROCESS_GROUPS) >= self.memory_bytes:
            raise ValueError(
                f"memory_reserve ({self.memory_reserve.bytes(PROCESS_GROUPS) / 2**30:.1f} GiB "
                f"with {PROCESS_GROUPS} process groups) leaves nothing of memory_gib {self.memory_gib:g}"
            )
        return self

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def memory_bandwidth(self) -> float:
        return self.memory_bandwidth_gbps * 1e9

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a training dtype; fp32 matmuls use TF32 tensor cores when listed."""
        table = dict(self.peak_tflops)
        if dtype == "fp32" and "tf32" in table:
            return table["tf32"] * 1e12
        if dtype in table:
            return table[dtype] * 1e12
        if dtype in ("bf16", "fp16"):
            other = "fp16" if dtype == "bf16" else "bf16"
            if other in table:
                return table[other] * 1e12
        return table["fp32"] * 1e12


class ClusterPreset(_Strict):
    """A named cluster node design (DGX A100, DGX H100, a PCIe box) built on a GPU spec."""

    kind: Literal["cluster"] = "cluster"
    name: str
    display_name: str
    aliases: list[str] = Field(default_factory=list, description="other names that resolve to this preset")
    gpu: str = Field(description="name or path of a GPU spec")
    topology: TopologySpec
    sources: dict[str, str]


class ClusterSpec(_Strict):
    """The machine a plan targets: N nodes of G GPUs of one kind, wired as the topology says."""

    name: str
    gpu: GPUSpec
    topology: TopologySpec
    nodes: PositiveInt
    memory_reserve_gib: float | None = Field(
        None, ge=0, description="per-GPU memory reserve in GiB (--memory-reserve); None: from the GPU spec"
    )
    reserved_gib: float = Field(0.0, ge=0, description="reserve already taken off gpu.memory_gib (within_reserve)")
    nccl_reserve_gib_per_group: float = Field(
        0.0, ge=0, description="NCCL buffers per process group each plan keeps free on top (within_reserve)"
    )

    @model_validator(mode="after")
    def _reserve_fits(self) -> ClusterSpec:
        if self.memory_reserve_gib is not None and self.memory_reserve_gib >= self.gpu.memory_gib:
            raise ValueError(
                f"memory reserve {self.memory_reserve_gib:g} GiB is not below the GPU's {self.gpu.memory_gib:g} GiB"
            )
        return self

    @property
    def fixed_reserve_bytes(self) -> int:
        """Bytes per GPU every plan keeps free whatever its degrees: the --memory-reserve override (the whole
        reserve), or the spec's CUDA context."""
        if self.memory_reserve_gib is not None:
            return int(self.memory_reserve_gib * 2**30)
        return self.gpu.memory_reserve.bytes(0)

    def memory_reserve_bytes(self, groups: int) -> int:
        """Bytes per GPU a plan communicating in `groups` process groups of more than one rank keeps free: the
        override, or the spec's fixed share plus its NCCL buffers per group."""
        if self.memory_reserve_gib is not None:
            return self.fixed_reserve_bytes
        return self.gpu.memory_reserve.bytes(groups)

    @property
    def nccl_bytes_per_group(self) -> float:
        """The NCCL buffers per process group that the search still keeps free plan by plan
        (`planner.cost.terms.rank_capacity`): the spec's, once `within_reserve` took the fixed share off the
        capacity; 0 under a --memory-reserve override (the whole reserve) and before `within_reserve`."""
        return self.nccl_reserve_gib_per_group * 2**30

    def within_reserve(self) -> ClusterSpec:
        """The cluster the search plans against: the fixed reserve taken off the GPU's capacity, and the NCCL
        share per process group kept aside for `terms.rank_capacity` to take per plan (none with an override).
        The fragmentation share stays on the spec: the cost model's peak adds it (`CostOptions.for_cluster`)."""
        fixed = self.fixed_reserve_bytes
        per_group = self.nccl_reserve_gib_per_group
        if self.memory_reserve_gib is None:
            per_group += self.gpu.memory_reserve.nccl_gib_per_group
        gpu = self.gpu.model_copy(
            update={
                "memory_gib": (self.gpu.memory_bytes - fixed) / 2**30,
                "memory_reserve": MemoryReserve(fragmentation=self.gpu.memory_reserve.fragmentation),
            }
        )
        return self.model_copy(
            update={
                "gpu": gpu,
                "memory_reserve_gib": 0.0,
                "reserved_gib": self.reserved_gib + fixed / 2**30,
                "nccl_reserve_gib_per_group": per_group,
            }
        )

    def with_memory_reserve(self, gib: float | None) -> ClusterSpec:
        """The cluster with a --memory-reserve override (None: keep the spec's reserve)."""
        if gib is None:
            return self
        if not 0 <= gib < self.gpu.memory_gib:
            own = self.gpu.memory_reserve.bytes(PROCESS_GROUPS) / 2**30
            raise ConfigError(
                f"--memory-reserve {gib:g} GiB is not possible on {self.gpu.display_name} with "
                f"{self.gpu.memory_gib:g} GiB per GPU: give a reserve from 0 up to less than the GPU's memory "
                f"(the spec's own is {own:.2f} GiB)."
            )
        return self.model_copy(update={"memory_reserve_gib": float(gib)})

    @property
    def gpus_per_node(self) -> int:
        return self.topology.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.topology.gpus_per_node
