"""A point of the outer search space and the cost model's fixed switches (a leaf of planner.cost)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.hardware.spec import FRAGMENTATION

if TYPE_CHECKING:
    from planner.hardware.spec import ClusterSpec

GiB = 2**30
@dataclass(frozen=True)
class Candidate:
    """One point of the outer search space (everything but the stage partition and recomputation)."""

    dp: int
    tp: int
    pp: int
    virtual_stages: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: str
    zero_stage: int
    sequence_parallel: bool
    ep: int = 1  # expert parallelism: each MoE layer's experts sharded over ep of the dp ranks (ep divides dp)
    # context parallelism: each sample's sequence sharded over cp ranks (world = dp x cp x tp x pp); the cp ranks
    # hold replicated weights, so gradients sync (and ZeRO shards) over the dp x cp ranks (`dp_shard`)
    cp: int = 1
    # torch's async TP (sequence parallelism's all-gather -> matmul and matmul -> reduce-scatter decomposed and
    # overlapped under torch.compile, CUDA symmetric memory); `model.async_tp_exposed`
    tp_overlap: bool = False

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def dp_shard(self) -> int:
        """The ranks holding the same weights, over which gradients are averaged and ZeRO shards states: dp x cp
        (torchtitan's `dp_shard_cp` mesh dimension)."""
        return self.dp * self.cp

    def label(self) -> str:
        sp = ("+sp" if self.sequence_parallel else "") + ("+async" if self.tp_overlap else "")
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (
            f"dp{self.dp}{ep}{cp} tp{self.tp}{sp} pp{self.pp}"
            + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
            + f" mbs{self.micro_batch_size} m{self.num_micro_batches} {self.schedule} zero{self.zero_stage}"
        )


@dataclass(frozen=True)
class CostOptions:
    """Switches of the cost model that are not searched."""

    overlap_dp_comm: bool = True
    workspace_bytes: float = 1.0 * GiB  # CUDA context, cuBLAS/NCCL workspaces, allocator slack
    # allocator fragmentation, as a share of the rest: the spec's memory_reserve.fragmentation (`for_cluster`)
    fragmentation: float = FRAGMENTATION
    ddp_bucket_bytes: float = 25 * 2**20  # torch DDP default bucket; two in flight
    # ZeRO-1/2: the updated weights' all-gather runs during the next iteration's first forward (Megatron-LM
    # --overlap-param-gather, FSDP2's prefetch of the first units); `terms.sync_overlap_window`
    overlap_param_gather: bool = False

    @classmethod
    def for_cluster(
        cls, cluster: ClusterSpec, overlap_dp_comm: bool = True, overlap_param_gather: bool = False
    ) -> CostOptions:
        """The options a plan on `cluster` is costed with: the one place the spec's fragmentation share
        (memory_reserve.fragmentation) is read."""
        return cls(
            overlap_dp_comm=overlap_dp_comm,
            fragmentation=cluster.gpu.memory_reserve.fragmentation,
            overlap_param_gather=overlap_param_gather,
        )


