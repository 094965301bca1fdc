"""Pydantic schemas for GPU specs, node topologies and clusters (YAML files under hardware_specs/).

Units in the YAML are the ones datasheets use (TFLOP/s, GiB, GB/s, microseconds); the properties
convert to SI so that the cost model works in FLOP/s, bytes and seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

DType = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]


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
    sources: dict[str, str] = Field(description="datasheet or paper for each number")

    @model_validator(mode="after")
    def _has_fp32(self) -> GPUSpec:
        if "fp32" not in self.peak_tflops:
            raise ValueError("peak_tflops must give at least 'fp32'")
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

    @property
    def gpus_per_node(self) -> int:
        return self.topology.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.topology.gpus_per_node
