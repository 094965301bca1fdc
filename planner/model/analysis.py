"""analyse_model: build on meta, trace, group into units and count each distinct unit once.

Each distinct unit (by structure and input shapes) is analysed once: counting.py measures its FLOPs, bytes
and activations, tp.py its tensor-parallel pairs; grouping.py decides what the units are.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, cast

from planner.errors import PlannerError
from planner.model.counting import Counts, analyse_callable, flatten_tensors, mixed_precision_mode, tensor_bytes
from planner.model.fused import fused_kernels
from planner.model.graph import GemmShape, ModelGraph, TPPair, Unit
from planner.model.grouping import (
    discover_structure,
    fold_templates,
    group_units,
    model_input_count,
    run_units_once,
    structure_key,
    unit_name,
)
from planner.model.load import DTYPE_BYTES, LoadedModel, build_meta_model, meta_inputs, torch_dtype
from planner.model.moe import correct_counts, ep_granularity, expert_storages, unit_moe_layers
from planner.model.tp import ModuleNames, TPInfo, constant_inputs, embeddings_read_elsewhere, renamer, tp_info
from planner.model.trace import lazy_graph_modules, trace_model, training_error

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch.fx
    import torch.nn as nn

    # What split_and_run returns (Traced.checked): unit root lists, node -> unit index, the split graph, the
    # model's output, the inputs captured per unit index and the unit index -> signature map.
    _Split: TypeAlias = tuple[
        list[list[str]], dict[torch.fx.Node, int], torch.fx.GraphModule, Any, dict[int, tuple[Any, ...]], dict[int, str]
    ]


log = logging.getLogger(__name__)


def analyse_model(loaded: LoadedModel) -> ModelGraph:
    """Build on meta, trace, group into units and analyse each distinct unit once."""

    from planner.processes import model_loaded
    from planner.runtime.meta import meta_without_dynamo

    meta_without_dynamo()  # meta elementwise kernels would import torch._dynamo (planner.runtime.meta)
    model = build_meta_model(loaded)
    model_loaded()  # what the build imported too (a model file may reach transformers' class only here)
    # Mamba mixers run as their fused GPU kernels while traced and counted (planner.model.kernels)
    with fused_kernels(model):
        return _analyse(loaded, model)


def loss_bytes(loaded: LoadedModel, out: Any, inputs: tuple[torch.Tensor, ...], compute: torch.dtype) -> int:
    """Bytes the loss keeps for its backward on the model's (meta) output, plus the most its backward holds at once:
    the run's loss function (the model file's loss_fn, else the runtime's default next-token cross-entropy). A
    cross-entropy over bf16 logits keeps their fp32 log-softmax and its backward two fp32 gradients of the logits'
    size: at vocabulary 128k, 12 bytes per logit. A loss that cannot run on meta (reads a value) counts 0."""
    import torch

    from planner.runtime.loss import default_loss

    fn = loaded.loss_fn or default_loss
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return 0
    try:
        with mixed_precision_mode(compute):
            c = analyse_callable(lambda o: fn(o, *inputs), (out,), [], None)
    except Exception as e:  # noqa: BLE001 - a loss the meta device cannot run is left out of the count, said so
        log.warning("the loss's memory is not counted: its loss function does not run on meta tensors (%s)", e)
        return 0
    return sum(c.saved.values()) + c.bwd_peak


def is_vocab_parallel_loss(loaded: LoadedModel, out: Any, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the run's loss is the next-token cross-entropy on the model's logits, so that under tp it keeps a
    vocabulary-parallel head's logits split (runtime/vocab.py): the default loss on [b, s, vocab] logits of integer
    tokens (the output, its `logits` or a tuple's first, no `loss` of its own), or a loss_fn computing the same."""
    import torch

    from planner.runtime.context import is_next_token_loss
    from planner.runtime.loss import logits_of, output_field

    if loaded.loss_fn is not None and not is_next_token_loss(loaded.loss_fn):
        return False
    if output_field(out, "loss") is not None or not inputs:
        return False
    try:
        logits = logits_of(out)
    except TypeError:
        return False
    tokens = inputs[0]
    return (
        isinstance(logits, torch.Tensor) and not tokens.is_floating_point() and logits.dim() == 3
        and tuple(logits.shape[:2]) == tuple(tokens.shape)
    )


def _analyse(loaded: LoadedModel, model: nn.Module) -> ModelGraph:
    import torch
    from torch.fx.passes.split_module import split_module

    batch = trace_batch(model)
    compute = torch_dtype(loaded.source.dtype)
    inputs = meta_inputs(loaded, batch)
    n_in = model_input_count(model, len(inputs))
    structure = discover_structure(model)
    roots, blocks = structure.roots, structure.blocks

    def split_and_run(gm: torch.fx.GraphModule) -> _Split | None:
        groups, node_unit = group_units(gm, roots, blocks, structure.stateless)
        with lazy_graph_modules():
            parts = split_module(gm, model, lambda n: node_unit[n], keep_original_order=True)
        keys = {i: structure_key(model, g, blocks) for i, g in enumerate(groups)}
        templates = fold_templates(parts, groups, keys)
        if templates is None:
            return None  # a folded block that is not a unit repeating another: traced again, unfolded
        try:
            with mixed_precision_mode(compute):
                out, captured, sigs = run_units_once(parts, inputs[:n_in], keys, templates)
        except Exception:
            if not templates:
                raise
            # (a plain symbolic trace's folded block runs as written on meta: where that fails, the unfolded
            # trace's graph runs instead, and any error is the one it raises)
            return None
        return groups, node_unit, parts, out, captured, sigs

    with _batch_norm_inputs(model) as norm_inputs:
        # Repeats of a block are one call each (trace.FOLD_REPEATED_BLOCKS): counted and sharded as the first.
        traced = trace_model(model, inputs[:n_in], loaded.source.path, check=split_and_run, fold=frozenset(blocks))
        if traced.checked is None:
            traced = trace_model(model, inputs[:n_in], loaded.source.path, check=split_and_run)
    checked: _Split = traced.checked
    groups, node_unit, parts, out, captured, unit_sig = checked
    # A batch norm that sees one value per channel in a sample (BatchNorm1d on [batch, features]) refuses a
    # batch of one in training: the smallest micro-batch the model accepts is then 2.
    min_micro_batch = 2 if any(values == 1 for values in norm_inputs.values()) else 1

    dtype_bytes = DTYPE_BYTES[loaded.source.dtype]
    tokens = None
    first = inputs[0]
    if not first.is_floating_point() and first.dim() >= 2:
        tokens = int(first.shape[1])

    # Bytes live across each cut: values produced at or before unit i and used after it.
    produced: dict[object, int] = {}
    last_use: dict[object, int] = {}
    sizes: dict[object, int] = {}
    for node in parts.graph.nodes:
        target = cast(str, node.target)  # a call_module's target is the submodule's name
        if node.op == "placeholder":
            produced[node] = -1
        elif node.op == "call_module" and target.startswith("submod_"):
            produced[node] = int(target.split("_")[1])
        elif node.op == "call_function":  # getitem of a submodule's tuple output
            src = node.args[0]
            produced[node] = produced.get(src, -1)
        for arg in node.all_input_nodes:
            if node.op == "call_module" and target.startswith("submod_"):
                last_use[arg] = max(last_use.get(arg, -1), int(target.split("_")[1]))
            elif node.op == "output":
                last_use[arg] = len(groups)
    for node in parts.graph.nodes:
        target = cast(str, node.target)
        if node.op == "call_module" and target.startswith("submod_"):
            idx = int(target.split("_")[1])
            for arg, val in zip(node.args, captured.get(idx, ())):
                if isinstance(val, torch.Tensor):
                    sizes[arg] = tensor_bytes(val)

    meets = grad_meets(traced.gm, node_unit, model, len(groups))
    params_by_name = dict(model.named_parameters())
    buffers = tuple(model.buffers())
    state_ids = {id(t) for t in (*params_by_name.values(), *buffers)}
    sequence = has_sequence(inputs, captured, out, state_ids)
    names = ModuleNames.of(model)
    # Embeddings whose weight is also read as a whole matrix (Whisper's logits): replicated, whatever a unit found.
    kept_whole = embeddings_read_elsewhere(traced.gm, names)
    root_attrs: dict[int, list[str]] = {}
    for n, u in node_unit.items():
        # (a read that no unit uses, of a parameter a unit's module holds, is that unit's: Jamba's mixer norms,
        # read beside the mixer kept as one call, would be counted twice)
        used = any(x in node_unit for x in n.users)
        if n.op == "get_attr" and str(n.target) in params_by_name and (used or not _under(str(n.target), groups)):
            root_attrs.setdefault(u, []).append(str(n.target))
    units: list[Unit] = []
    analysed: dict[str, Counts] = {}
    tp_by_sig: dict[str, tuple[list[str], TPInfo]] = {}
    seq = tokens
    for i, group in enumerate(groups):
        sub = getattr(parts, f"submod_{i}", None)
        unit_params: dict[str, nn.Parameter] = {}
        for r in group:
            for pn, p in model.get_submodule(r).named_parameters(prefix=r):
                unit_params[pn] = p
        for name in root_attrs.get(i, ()):  # root-level parameters fetched by get_attr
            unit_params.setdefault(name, params_by_name[name])
        # A weight held under two names (T5's shared embedding is also encoder.embed_tokens) counts once.
        by_id: dict[int, tuple[str, nn.Parameter]] = {}
        for pn, p in unit_params.items():
            by_id.setdefault(id(p), (pn, p))
        unit_params = dict(by_id.values())
        args = captured.get(i, ())
        sig = unit_sig[i]
        moe = unit_moe_layers(model, group)
        if sig not in analysed:
            if sub is None:
                analysed[sig] = Counts()
            else:
                tagged = frozenset(expert_storages(model, moe))
                try:
                    with mixed_precision_mode(compute):
                        counts = analyse_callable(sub, args, list(unit_params.values()), seq, buffers, tagged)
                except PlannerError:
                    raise
                except Exception as e:  # noqa: BLE001 - the model's own code failing under autograd, quoted
                    raise training_error(model, inputs, loaded.source.path, group, e) from None
                analysed[sig] = per_sample(counts, batch)
                correct_counts(analysed[sig], moe, seq or 1)  # routed expert work, counted from the structure
                tp_by_sig[sig] = (group, tp_per_sample(
                    tp_info(sub, args, model, names, constant_inputs(parts, i), traced.method), batch
                ))
        c = analysed[sig]
        n_params = sum(p.numel() for p in unit_params.values())
        act = sum(c.saved.values())
        core = sum(v for k, v in c.saved.items() if k in c.attention_core)
        # What enters per sample: torch.export lifts parameters and buffers into inputs, which are not
        # activations (full recompute keeps the unit's input, not its weights).
        in_bytes = sum(tensor_bytes(a) for a in args if isinstance(a, torch.Tensor) and id(a) not in state_ids) // batch
        out_bytes = sum(sizes.get(v, 0) for v, p in produced.items() if p <= i < last_use.get(v, -1)) // batch

        first_group, info = tp_by_sig.get(sig, (group, TPInfo()))
        rename = renamer(first_group, group)
        tp_pairs = [
            TPPair(column=[rename(c) for c in p.column], row=rename(p.row), allreduce_bytes=p.allreduce_bytes)
            for p in info.pairs
        ]
        styles = {rename(k): v for k, v in info.styles.items()}
        refused = [_rename_text(rename, first_group, group, r) for r in info.refused]
        shard_params = info.shard_params
        for name in sorted(set(styles) & set(kept_whole)):
            del styles[name]
            shard_params -= cast("nn.Embedding", model.get_submodule(name)).weight.numel()
            refused.append(kept_whole[name])
        shard_flops = info.shard_flops
        if tp_pairs and info.attention:
            # Attention runs between a sharded q/k/v and its row Linear: split by heads, its explicit
            # QK^T and AV matmuls too, so everything but the unit's unpaired matmuls divides by t. Where
            # no pair covers attention (refused, or none found) it stays whole on every rank.
            shard_flops = max(shard_flops + c.fwd_attention, c.fwd_matmul - info.unpaired_flops + c.fwd_attention)
        if i < len(groups) - 1 and info.gather_bytes:
            styles = {k: v for k, v in styles.items() if v != "colwise_gather"}  # only the model's output
            shard_flops -= info.shard_flops
        units.append(
            Unit(
                name=unit_name(group),
                modules=list(group),
                kind="block" if all(r in blocks for r in group) else "other",
                signature=sig,
                params=n_params,
                param_bytes=sum(p.numel() * p.element_size() for p in unit_params.values()),
                fwd_flops=c.fwd_flops,
                bwd_flops=c.bwd_flops,
                matmul_flops=c.fwd_matmul,
                attention_flops=c.fwd_attention,
                memory_bound_bytes=c.fwd_mem_bytes,
                bwd_matmul_flops=c.bwd_matmul,
                bwd_attention_flops=c.bwd_attention,
                bwd_memory_bound_bytes=c.bwd_mem_bytes,
                activation_bytes=act,
                attention_core_bytes=core,
                sdpa_score_bytes=c.sdpa_scores,
                sdpa_kv_bytes=c.sdpa_kv,
                sdpa_masked=c.sdpa_masked,
                input_bytes=in_bytes,
                op_sac_bytes=c.op_sac_saved,
                op_sac_kept_matmul_flops=c.op_sac_kept_matmul,
                output_bytes=(
                    out_bytes if i < len(groups) - 1 else sum(tensor_bytes(t) for t in flatten_tensors(out)) // batch
                ),
                tp_pairs=tp_pairs,
                tp_shardable_params=shard_params if styles else 0,
                tp_gather_bytes=info.gather_bytes if i == len(groups) - 1 else 0,
                tp_shardable_flops=min(shard_flops, c.fwd_flops),
                tp_styles=styles,
                uses_flash_attention=c.flash,
                expert_params=sum(m.expert_params for m in moe),
                frozen_params=sum(p.numel() for p in unit_params.values() if not p.requires_grad),
                grad_meet=meets.get(i, []),
                experts={m.experts: m.num_experts for m in moe},
                ep_granularity=ep_granularity(moe),
                moe_dispatch_bytes=sum(m.dispatch_bytes(seq or 1, dtype_bytes) for m in moe),
                gemm_dim=info.gemm_dim,
                gemm_shapes=gemm_shapes(info, gather=i == len(groups) - 1),
                tp_granularity=info.granularity,
                tp_head_attrs={rename(k): v for k, v in info.head_attrs.items()},
                tp_fused={rename(k): v for k, v in info.fused.items()},
                tp_transposed=[rename(k) for k in info.transposed],
                tp_copied=[rename(k) for k in info.copied],
                tp_summed=[rename(k) for k in info.summed],
                tp_refused=refused,
                tp_shards_attention=bool(tp_pairs) and info.attention,
            )
        )
    if units:
        split = bool(units[-1].tp_gather_bytes) and is_vocab_parallel_loss(loaded, out, inputs)
        units[-1] = units[-1].model_copy(
            update={"loss_bytes": loss_bytes(loaded, out, inputs, compute) // batch, "loss_parallel": split}
        )
    return ModelGraph(
        source=loaded.source,
        model_class=type(model).__name__,
        trace_method=traced.method,
        units=units,
        total_params=sum(p.numel() for p in model.parameters()),
        tokens_per_sample=tokens,
        sample_input_shapes=[[1, *t.shape[1:]] if t.dim() else [] for t in inputs],
        min_micro_batch=min_micro_batch,
        has_sequence=sequence,
        distinct_blocks=len(analysed),
        structure=structure.found,
        source_spec=getattr(loaded.module, "SOURCE", None) if _compiled(loaded) else None,
        source_settings=dict(getattr(loaded.module, "SETTINGS", {})) if _compiled(loaded) else loaded.settings,
        dtype_bytes=dtype_bytes,
    )


def grad_meets(gm: torch.fx.GraphModule, node_unit: dict[Any, int], model: nn.Module, n: int) -> dict[int, list[int]]:
    """`Unit.grad_meet` of each unit (but the first) with a trained weight whose gradient does not meet a value the
    first unit computed at once: per stage end j = i+1..n, the first unit whose computed values the unit's weights
    meet inside units i..j-1 (n: none), the largest over its weights.

    Zero-bubble's weight step (torch's `stage_backward_weight`) gets a weight's gradient only where the weight's
    part of the autograd graph meets the part that starts at the stage's inputs, the values earlier stages
    computed (`get_param_groups`); model inputs and buffers need no gradient. A node meets the values of unit k
    where it reads, transitively, a value computed in unit k. A weight is a trained parameter read by get_attr (its
    readers use it) or held by a called module (the call uses it). Where a reader of a weight reads a value of the
    first unit, every stage after the first meets it there (the usual case: a block's weights and its input);
    otherwise the weight's descendants are walked (CLIP's text tower, whose embedding of token ids meets the image
    tower only at the logits)."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    low: dict[Any, int] = {}  # the first unit whose computed values the node reads (n: none)
    for node in gm.graph.nodes:
        first = n
        for arg in node.all_input_nodes:
            if arg.op not in ("placeholder", "get_attr"):  # model inputs, weights and buffers: computed by no unit
                first = min(first, node_unit.get(arg, n), low.get(arg, n))
        low[node] = first
    out: dict[int, list[int]] = {}
    for node in gm.graph.nodes:
        u = node_unit.get(node)
        if not u:
            continue  # the first unit's weights: in the first stage, whose backward is not split
        if node.op == "get_attr" and str(node.target) in trained:
            starts = list(node.users)
        elif node.op == "call_module" and any(
            p.requires_grad for p in model.get_submodule(str(node.target)).parameters()
        ):
            starts = [node]
        else:
            continue
        if all(low[x] == 0 for x in starts):
            continue
        # the weight's descendants, by unit: the first unit whose values each unit's descendants read
        by_unit = [n] * n
        seen, todo = set(starts), list(starts)
        while todo:
            x = todo.pop()
            w = node_unit.get(x)
            if w is not None:
                by_unit[w] = min(by_unit[w], low[x])
            for y in x.users:
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        meet, row = n, []
        for w in range(u, n):  # the stage ends after unit w: j = w + 1
            meet = min(meet, by_unit[w])
            row.append(meet)
        old_row = out.get(u)
        out[u] = row if old_row is None else [max(a, b) for a, b in zip(old_row, row, strict=True)]
    return {u: row for u, row in out.items() if any(row)}


def has_sequence(
    inputs: tuple[Any, ...], captured: dict[int, tuple[Any, ...]], out: Any, state_ids: set[int]) -> bool:
    """Whether the model has a sequence for sequence parallelism to split: dimension 1 of the first input, carried
    by the activations between units (or the output) as their dimension 1 with features after it ([batch, seq,
    hidden]), as the generated script's rewrite expects. False where nothing does: a recommender's [batch, 13]
    dense features, an image's channels."""
    import torch

    first = inputs[0]
    if first.dim() < 2:
        return False
    seq = int(first.shape[1])
    model_inputs = {id(t) for t in inputs} | state_ids
    values = [a for args in captured.values() for a in flatten_tensors(args)] + flatten_tensors(out)
    found = any(
        isinstance(t, torch.Tensor) and id(t) not in model_inputs and t.dim() >= 3 and t.shape[1] == seq
        for t in values
    )
    return found


def trace_batch(model: nn.Module) -> int:
    """Samples in the batch the analysis traces and counts (its figures are then divided back to one sample):
    2 where the model holds a batch norm in training mode, whose statistics are over the batch (one sample can
    give one value per channel, which it refuses), else 1."""
    from torch import nn

    norms = (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return 2 if any(m.training for m in norms) else 1


def per_sample(c: Counts, batch: int) -> Counts:
    """Counts of a ``batch``-sample run as per-sample figures (every counted op and saved tensor scales with the
    batch; the weights' share of the memory-bound bytes is divided too, as it is read once per micro-batch)."""
    if batch == 1:
        return c
    for name in ("fwd_flops", "fwd_matmul", "fwd_attention", "fwd_mem_bytes", "bwd_flops", "bwd_matmul",
                 "bwd_attention", "bwd_mem_bytes", "tagged_fwd", "tagged_bwd", "op_sac_kept_matmul"):
        setattr(c, name, getattr(c, name) / batch)
    c.saved = {k: v // batch for k, v in c.saved.items()}
    c.sdpa_scores //= batch
    c.sdpa_kv //= batch
    c.op_sac_saved //= batch
    return c


def gemm_shapes(info: TPInfo, gather: bool) -> list[GemmShape]:
    """The unit's Linears with the split tensor parallelism gives each (`TPInfo.styles`): a column-parallel
    or vocabulary-parallel (`colwise_gather`, the model's output only: `gather`) Linear splits its output
    features, a row-parallel one its input features."""
    split: dict[str, Literal["colwise", "rowwise", "none"]] = {
        "colwise": "colwise", "rowwise": "rowwise", "colwise_gather": "colwise" if gather else "none"
    }
    return [
        GemmShape(tokens=t, in_features=i, out_features=o, split=split.get(s, "none"))
        for t, i, o, s in info.gemm_shapes
    ]


def tp_per_sample(info: TPInfo, batch: int) -> TPInfo:
    """TPInfo of a ``batch``-sample run as per-sample figures (the all-reduced and gathered bytes, the FLOPs)."""
    if batch == 1:
        return info
    for pair in info.pairs:
        pair.allreduce_bytes //= batch
    info.shard_flops /= batch
    info.unpaired_flops /= batch
    info.gather_bytes //= batch
    info.gemm_shapes = [(max(1, t // batch), i, o, s) for t, i, o, s in info.gemm_shapes]
    return info


@contextlib.contextmanager
def _batch_norm_inputs(model: nn.Module) -> Iterator[dict[str, int]]:
    """Record, for each batch norm in training mode the analysis runs, the values per channel in one sample of its
    input (the product of the sizes after the channel dimension): {module name: values}."""
    import torch
    from torch import nn

    seen: dict[str, int] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and not isinstance(x, torch.fx.Proxy) and x.dim() >= 2:
                seen[name] = min(seen.get(name, x[0, 0].numel()), x[0, 0].numel())

        record.planner_trace_neutral = True  # type: ignore[attr-defined]  # nothing on proxies (tracers.py)
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _under(name: str, groups: list[list[str]]) -> bool:
    """Whether a parameter's qualified name lies under one of the units' root modules."""
    return any(name.startswith(r + ".") for g in groups for r in g if r)


def _rename_text(rename: Callable[[str], str], first: list[str], group: list[str], text: str) -> str:
    """A reason written for a unit's first instance, with this instance's module names."""
    for a, b in sorted(zip(first, group), key=lambda p: -len(p[0])):
        if a != b:
            text = text.replace(a + ".", b + ".").replace(a + " ", b + " ")
    return text


def _compiled(loaded: LoadedModel) -> bool:
    """Whether the model file is one planner.model.sources wrote (it names its source and settings)."""
    from planner.model.sources import SOURCE_FILE

    return loaded.source.path.endswith(SOURCE_FILE) and isinstance(getattr(loaded.module, "SOURCE", None), str)
