"""Expert parallelism: each MoE layer's experts sharded over an ep group of data-parallel ranks.

The plan names every experts module (``EXPERTS``: module -> number of experts). Each is replaced by an
`ExpertParallel` module holding this rank's E/ep experts, called as the model calls its experts:
``experts(hidden [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]`` (Hugging Face's MoE
interface: Mixtral, Qwen-MoE, DeepSeek), or, for torchtitan's ``routed_experts`` (its token reordering
around ``inner_experts``, grouped weights run by ``torch._grouped_mm``), `GroupedExpertParallel`:
``routed_experts(x [B, L, h], top_k_scores [B, L, k], top_k_expert_ids [B, L, k], tokens_per_expert [E])
-> [B, L, h]``, the local ``inner_experts`` called as torchtitan calls it, on tokens sorted by expert with
their counts. Forward:

1. every (token, slot) pair is sent to the rank holding its expert: one ``all_to_all_single`` of the
   token vectors (dispatch), sizes exchanged first (no capacity limit, no token dropped);
2. this rank runs its experts on what it received;
3. the outputs go back the same way (combine), are weighted by the router and summed per token.

Backward is the same two exchanges in reverse (`_AllToAll`). No token is dropped, so the result is the
single-process sum up to the order of floating-point additions. Gloo implements ``all_to_all_single``
with uneven splits on CPU, so the CPU tests run what a GPU run does.

With a pipeline the same swap happens inside each stage: the stage's traced graph calls its experts
modules as modules (`stages.trace` keeps them), so `shard_experts` runs on each piece; the ep group is
ep consecutive ranks of the stage's dp group, so the all-to-all never leaves the stage.

The experts' gradients then differ per ep rank: they are synchronised over the dp/ep ranks holding the
same experts (`parallel.apply_expert_data_parallel`), averaged over dp like every other gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import RunError


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the exchange with the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [int(x) for x in recv.tolist()]


class ExpertParallel(nn.Module):
    """This rank's slice of an experts module, with the token dispatch and combine over the ep group.

    ``local`` runs the local experts on received tokens: a ModuleList of experts (each ``f(x [n, h])``),
    or the model's own stacked-experts module cut to this rank's experts, called with one slot per token
    and weight 1 (the router weights are applied after the combine).
    """

    def __init__(self, local: nn.Module, num_experts: int, ep_rank: int, ep: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.local = local
        self.num_experts, self.ep_rank, self.ep = num_experts, ep_rank, ep
        self.per_rank = num_experts // ep
        self.group = group

    def _run_local(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        if isinstance(self.local, nn.ModuleList):
            out = x.new_zeros(x.shape)
            for j, f in enumerate(self.local):
                # Every local expert runs, on no rows if no token chose it, so its weights always get a
                # gradient (zeros): the gradient sync then reduces the same tensors on every rank.
                rows = (expert == j).nonzero().squeeze(1)
                out = out.index_add(0, rows, f(x.index_select(0, rows)).to(out.dtype))
            return out
        ones = torch.ones((x.shape[0], 1), dtype=x.dtype, device=x.device)
        stacked: torch.Tensor = self.local(x, expert.unsqueeze(1), ones)
        # The stacked module skips experts no token chose: keep every weight in the graph (adds 0).
        return stacked + sum(p.reshape(-1)[:1].sum() for p in self.local.parameters()) * 0.0

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # grouped by expert, hence by destination rank
        token = order // k
        expert = flat[order]
        dest = expert // self.per_rank
        send = torch.bincount(dest, minlength=self.ep)
        in_splits = [int(x) for x in send.tolist()]
        out_splits = _exchange_counts(send, self.group)
        x: torch.Tensor = _AllToAll.apply(  # type: ignore[no-untyped-call]
            hidden.index_select(0, token), out_splits, in_splits, self.group
        )
        local_expert = torch.empty(sum(out_splits), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(local_expert, (expert % self.per_rank).contiguous(), out_splits, in_splits,
                               group=self.group)
        # FSDP averages the experts' gradients over their dp/ep replicas; the rest of the model's over all dp
        # ranks. Scaling the gradient by 1/ep inside the experts (and back by ep on their input) makes theirs
        # the same mean over dp, without a custom divide factor (PREMUL_SUM, which Gloo lacks).
        x = _ScaleGrad.apply(x, float(self.ep))  # type: ignore[no-untyped-call]
        y: torch.Tensor = _ScaleGrad.apply(self._run_local(x, local_expert), 1.0 / self.ep)  # type: ignore[no-untyped-call]
        y = _AllToAll.apply(y, in_splits, out_splits, self.group)  # type: ignore[no-untyped-call]
        # (y * w: an fp32 router weight promotes y to fp32 before rounding back, as torchtitan's combine does.)
        w = top_k_weights.reshape(-1)[order].unsqueeze(1)
        return hidden.new_zeros(hidden.shape).index_add(0, token, (y * w).to(hidden.dtype))


class GroupedExpertParallel(ExpertParallel):
    """torchtitan's routed experts sharded over the ep group: the same dispatch and combine (the routed
    tokens' order, the router weights applied after the combine in fp32, as torchtitan's combine does),
    called as ``routed_experts(x, top_k_scores, top_k_expert_ids, tokens_per_expert)``. ``local`` is its
    ``inner_experts`` cut to this rank's experts, called on the received tokens sorted by local expert with
    the count of each, as torchtitan's local dispatcher calls it."""

    def _run_local(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        # Every local weight stays in the graph (adds 0), so the gradient sync reduces the same tensors on
        # every rank even when no token reached this one.
        keep = sum(p.reshape(-1)[:1].sum() for p in self.local.parameters()) * 0.0
        if x.shape[0] == 0:  # nothing to run (torch._grouped_mm's backward can refuse an empty input)
            return x + keep
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.per_rank)
        y: torch.Tensor = self.local(x.index_select(0, order), counts)
        return torch.empty_like(y).index_copy(0, order, y) + keep

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, top_k_scores: torch.Tensor, top_k_expert_ids: torch.Tensor,
        tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        # tokens_per_expert counts this rank's tokens for all E experts; the received counts per local
        # expert are recomputed after the exchange.
        del tokens_per_expert
        k = top_k_expert_ids.shape[-1]
        flat = x.reshape(-1, x.shape[-1])
        out = super().forward(flat, top_k_expert_ids.reshape(-1, k), top_k_scores.reshape(-1, k))
        return out.view(x.shape)


def _grouped_experts(mod: nn.Module) -> nn.Module | None:
    """torchtitan's RoutedExperts holds its grouped weights in ``inner_experts`` beside a
    ``token_dispatcher``; that inner module, or None for any other experts module."""
    inner = getattr(mod, "inner_experts", None)
    return inner if isinstance(inner, nn.Module) and hasattr(mod, "token_dispatcher") else None


def _slice_stacked(experts: nn.Module, lo: int, hi: int, total: int) -> nn.Module:
    """The stacked-experts module keeping experts [lo, hi): every weight with a leading dimension of
    `total` is cut, and its expert-count attribute set to hi - lo."""
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.dim() >= 1 and p.shape[0] == total:
            setattr(experts, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
    for attr in ("num_experts", "num_local_experts"):
        if isinstance(getattr(experts, attr, None), int):
            setattr(experts, attr, hi - lo)
    return experts


def shard_experts(
    root: nn.Module, experts: dict[str, int], ep: int, ep_rank: int, group: dist.ProcessGroup
) -> list[ExpertParallel]:
    """Replace each named experts module under `root` by this rank's `ExpertParallel` slice (in place)."""
    owned = dict(root.named_modules())
    done: list[ExpertParallel] = []
    for name, total in experts.items():
        if name not in owned:
            continue  # another pipeline stage's
        mod = owned[name]
        if total % ep:
            raise RunError(f"{name} holds {total} experts, which EP ({ep}) does not divide. Re-plan.")
        per = total // ep
        lo, hi = ep_rank * per, (ep_rank + 1) * per
        inner = _grouped_experts(mod)
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            children = list(mod.children())
            if len(children) != total:
                raise RunError(f"{name} holds {len(children)} experts, the plan says {total}. Re-plan.")
            local: nn.Module = nn.ModuleList(children[lo:hi])
        else:
            local = _slice_stacked(inner if inner is not None else mod, lo, hi, total)
        kind = GroupedExpertParallel if inner is not None else ExpertParallel
        wrapped = kind(local, total, ep_rank, ep, group)
        parent_name, _, leaf = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, leaf, wrapped)
        done.append(wrapped)
    return done
