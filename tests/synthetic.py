"""Synthetic units and graphs for solver and cost-model tests (no tracing involved)."""

from __future__ import annotations

from planner.model.graph import ModelGraph, ModelSource, TPPair, Unit


def make_unit(name: str, sig: str, params: int, flops: float, act: int, out: int, core: int = 0) -> Unit:
    return Unit(
        name=name,
        modules=[name],
        kind="block",
        signature=sig,
        params=params,
        param_bytes=2 * params,
        fwd_flops=flops,
        bwd_flops=2 * flops,
        matmul_flops=0.9 * flops,
        attention_flops=0.1 * flops,
        memory_bound_bytes=flops / 100,
        bwd_matmul_flops=1.8 * flops,
        bwd_attention_flops=0.2 * flops,
        bwd_memory_bound_bytes=flops / 50,
        activation_bytes=act,
        attention_core_bytes=core,
        input_bytes=out,
        output_bytes=out,
        tp_pairs=[TPPair(column=[f"{name}.a"], row=f"{name}.b", allreduce_bytes=out)],
        tp_shardable_params=params // 2,
        tp_shardable_flops=0.5 * flops,
        tp_granularity=8,
        gemm_dim=1024,
    )


def make_graph(units: list[Unit]) -> ModelGraph:
    return ModelGraph(
        source=ModelSource(path="/x.py", file_sha256="0" * 64),
        model_class="Synthetic",
        trace_method="fx",
        units=units,
        total_params=sum(u.params for u in units),
        tokens_per_sample=128,
        sample_input_shapes=[[1, 128]],
        distinct_blocks=len({u.signature for u in units}),
        dtype_bytes=2,
    )
