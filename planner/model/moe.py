"""Mixture-of-experts layers: where they are, and their routed work counted from the module structure.

On the meta device a router's choices are data, so the loop over experts runs no expert (Mixtral's
grouped kernel has no FLOP formula; a `torch.where` loop cannot run at all): the expert FLOPs the op
counter sees are wrong. Here they are replaced by the exact routed count: every token goes to `top_k`
experts, and an expert's Linear of weight [out, in] costs 2*out*in FLOPs per token forward and twice that
backward (input and weight gradient). Shared experts and the router run on every token as ordinary
modules, so the op counter already counts them exactly.

Two layouts are recognised. Hugging Face (Mixtral, Qwen-MoE, DeepSeek): the block holds `experts` (a list of
expert modules, or stacked 3-D weights) and a router `gate`. torchtitan (`torchtitan.models.common.moe.MoE`:
deepseek_v3, qwen3's MoE flavors, gpt_oss): the block holds `routed_experts` (its token reordering plus
`inner_experts`, the grouped weights [E, out, in] that `torch._grouped_mm` runs, in bf16, for which torch has
no FLOP formula) and a `router` holding `top_k` and its `gate` Linear. There the experts module the planner
names, keeps as a call and shards is `routed_experts`, called as `routed_experts(x, top_k_scores,
top_k_expert_ids, tokens_per_expert)`.

Expert parallelism (`ep`) shards the experts of every MoE layer over a sub-group of the data-parallel
ranks; `MoELayer.dispatch_bytes` is what one all-to-all moves per sample (each routed token's hidden
vector, once to its expert and once back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from planner.model.counting import Counts

# Names a MoE block gives its router (HF Mixtral and DeepSeek: `gate`; torchtitan: `router`) and its experts
# (HF: `experts`; torchtitan: `routed_experts`, whose grouped weights sit in its child `inner_experts`).
_ROUTER_NAMES = ("gate", "router")
_EXPERTS_NAMES = ("experts", "routed_experts")
_INNER_EXPERTS = "inner_experts"
_TOP_K_NAMES = ("top_k", "num_experts_per_tok")


@dataclass(frozen=True)
class MoELayer:
    """One MoE block: its experts module, how many experts, tokens' fan-out and the work per routed token."""

    name: str  # qualified name of the MoE block, e.g. "model.layers.0.mlp"
    experts: str  # qualified name of its experts module ("model.layers.0.mlp.experts")
    num_experts: int
    top_k: int
    hidden: int  # width of the tokens dispatched to the experts
    expert_params: int  # parameters of all experts together (what ep divides)
    fwd_flops_per_token: float  # forward FLOPs of one expert on one token

    def routed_fwd_flops(self, tokens: int) -> float:
        """Forward FLOPs of the experts for `tokens` tokens: each runs top_k experts (no token dropped)."""
        return float(tokens * self.top_k) * self.fwd_flops_per_token

    def dispatch_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """Bytes one all-to-all (dispatch, or combine) moves for `tokens` tokens: top_k copies of each."""
        return tokens * self.top_k * self.hidden * dtype_bytes


def experts_count(mod: nn.Module) -> int:
    """Number of experts an experts module holds: a container's children, or the leading dimension of
    stacked 3-D expert weights (Mixtral's MixtralExperts; torchtitan's GroupedExperts, under its
    RoutedExperts' `inner_experts`), else 0."""
    import torch.nn as nn

    inner = getattr(mod, _INNER_EXPERTS, None)
    if isinstance(inner, nn.Module):
        return experts_count(inner)
    if isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return len(list(mod.children()))
    n = getattr(mod, "num_experts", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    dims = {int(p.shape[0]) for p in mod.parameters(recurse=False) if p.dim() == 3}
    return dims.pop() if len(dims) == 1 else 0


def experts_module(mod: nn.Module) -> tuple[str, nn.Module] | None:
    """(attribute, module) of a block's experts (`experts`, or torchtitan's `routed_experts`), or None."""
    import torch.nn as nn

    return next(((a, m) for a in _EXPERTS_NAMES if isinstance(m := getattr(mod, a, None), nn.Module)), None)


def router_of(mod: nn.Module) -> nn.Module | None:
    """The router child of a MoE block, or None."""
    return next(
        (c for n, c in mod.named_children() if n in _ROUTER_NAMES or "Router" in type(c).__name__), None
    )


def top_k_of(mod: nn.Module) -> int | None:
    router = router_of(mod)
    for src in (mod, router):
        if src is None:
            continue
        for k in _TOP_K_NAMES:
            v = getattr(src, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _matrices(mod: nn.Module) -> list[torch.Tensor]:
    """The 2-D weights of one expert (3-D stacked weights: one expert's slice each). Beside stacked weights a
    2-D parameter [E, out] is the experts' biases (gpt_oss), not a matrix."""
    params = list(mod.parameters())
    stacked = any(p.dim() == 3 for p in params)
    out = []
    for p in params:
        if p.dim() == 3:
            out.append(p[0])
        elif p.dim() == 2 and not stacked:
            out.append(p)
    return out


def _hidden_of(mod: nn.Module, experts: nn.Module) -> int:
    """Width of the tokens a MoE block routes: the router's input features, else the experts' input."""
    router = router_of(mod)
    if router is not None:
        for holder in (router, getattr(router, "gate", None)):  # torchtitan's router holds a `gate` Linear
            w = getattr(holder, "weight", None)
            if w is not None and w.dim() == 2:
                return int(w.shape[1])
    mats = _matrices(experts)
    return int(mats[0].shape[-1]) if mats else 0


def find_moe_layers(model: nn.Module, prefix: str = "") -> list[MoELayer]:
    """Every MoE block under `model` (a block holds an `experts` or `routed_experts` module and a top-k), in
    definition order."""
    import torch.nn as nn

    layers: list[MoELayer] = []
    for name, mod in model.named_modules():
        found = experts_module(mod)
        if found is None:
            continue
        attr, experts = found
        n = experts_count(experts)
        k = top_k_of(mod)
        if not n or not k:
            continue
        if isinstance(experts, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            one = next(iter(experts.children()))
            per_token = sum(2.0 * p.shape[0] * p.shape[1] for p in _matrices(one))
        else:
            per_token = sum(2.0 * p.shape[0] * p.shape[1] for p in _matrices(experts))
        full = ".".join(x for x in (prefix, name) if x)
        layers.append(
            MoELayer(
                name=full,
                experts=f"{full}.{attr}" if full else attr,
                num_experts=n,
                top_k=k,
                hidden=_hidden_of(mod, experts),
                expert_params=sum(p.numel() for p in experts.parameters()),
                fwd_flops_per_token=per_token,
            )
        )
    return layers


def unit_moe_layers(model: nn.Module, roots: list[str]) -> list[MoELayer]:
    """The MoE blocks inside a unit's root modules."""
    found: list[MoELayer] = []
    for r in roots:
        found.extend(find_moe_layers(model.get_submodule(r), r))
    return found


def expert_storages(model: nn.Module, layers: list[MoELayer]) -> set[int]:
    """Storage keys of the expert weights: the op counter attributes ops that read them to the experts."""
    keys: set[int] = set()
    for layer in layers:
        for p in model.get_submodule(layer.experts).parameters():
            keys.add(p.untyped_storage()._cdata)
    return keys


def correct_counts(counts: Counts, layers: list[MoELayer], tokens: int) -> None:
    """Replace the expert matmul FLOPs the meta run counted by the routed count, in place.

    The counter tagged the ops that read an expert weight (`Counts.tagged_fwd`, `tagged_bwd`): forward
    expert matmuls and backward input-gradient matmuls. Those are removed, and the routed work added:
    forward F = tokens * top_k * flops_per_token, backward 2F (input gradient and weight gradient). A
    backward weight-gradient matmul does not read the weight, so the counter cannot see it: its FLOPs equal
    the input gradient's, counted twice by doubling what was tagged.
    """
    if not layers:
        return
    fwd = sum(layer.routed_fwd_flops(tokens) for layer in layers)
    counts.fwd_flops += fwd - counts.tagged_fwd
    counts.fwd_matmul += fwd - counts.tagged_fwd
    counts.bwd_flops += 2.0 * fwd - 2.0 * counts.tagged_bwd
    counts.bwd_matmul += 2.0 * fwd - 2.0 * counts.tagged_bwd


def ep_granularity(layers: list[MoELayer]) -> int:
    """gcd of the expert counts: ep must divide it (every rank of an ep group holds whole experts)."""
    g = 0
    for layer in layers:
        g = math.gcd(g, layer.num_experts)
    return g
