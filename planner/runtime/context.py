"""Context parallelism: each sample's sequence sharded over the cp ranks of a (pp, dp, cp, tp) mesh.

What is sharded, as torch's context parallelism (`torch.distributed.tensor.experimental.context_parallel`) and
torchtitan shard it: the tokens and their next-token labels, in torch's head-tail load-balanced order (the
sequence cut into 2 x cp chunks, rank r holding chunks r and 2cp-1-r, so that causal attention costs every rank
the same). Every activation then holds the rank's tokens only. Attention needs every key and value: inside each
`scaled_dot_product_attention` call the cp ranks all-gather them (forward) and reduce-scatter their gradients
(backward).

- On GPUs the attention is torch's own: `context_parallel` (its SDPA patch and ring kernels) with
  `set_rotate_method("allgather")`; `ContextParallel` routes each SDPA call to it, so a traced graph (which calls
  the function it recorded, not the patched name) reaches it too.
- Elsewhere (CPU, gloo; torch's CP dispatches only the flash / memory-efficient / cuDNN kernels) the same
  semantics are ours: keys and values all-gathered by `GatherSequence` (autograd: the gradient of the gathered
  tensor is summed over the cp ranks and each rank keeps its own part), and the causal mask built from the global
  positions of the rank's queries and of the gathered keys.

Positions follow the tokens: while `ContextParallel` is active, `torch.arange` over the whole sequence or the
rank's share of it (a learned position embedding's indices) gives the rank's global positions, and the rows a
model reads from a parameter or buffer of at least `seq` rows by its first `seq` or first `local` rows (a
position table, a rotary table) are the rank's rows. The loss is the mean over the whole sequence
(`ContextParallelLoss`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import RunError
from .loss import logits_of

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
IGNORE = -100  # cross_entropy's ignore_index: the label of a sequence's last token, which predicts nothing
_ACTIVE: ContextParallel | None = None  # the mode of the step that runs (ContextParallel.step)


def recomputed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a checkpointed unit's forward) run under the running step's ContextParallel mode where that mode is
    not active, which is while autograd recomputes it in backward; unchanged without context parallelism."""

    def run(*args: Any, **kwargs: Any) -> Any:
        mode = _ACTIVE
        if mode is None or any(m is mode for m in torch.overrides._get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        with mode:
            return fn(*args, **kwargs)

    return run


def positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions cp rank `rank` holds, in its local order: chunks r and 2cp-1-r of 2 x cp equal chunks
    (torch's `_HeadTailLoadBalancer`)."""
    if seq % (2 * cp):
        raise RunError(
            f"Context parallelism over {cp} ranks cuts the sequence into {2 * cp} equal chunks, which {seq} tokens do "
            "not make. Re-plan (the planner refuses such a cp) or use a sequence length divisible by 2 x CP."
        )
    c = seq // (2 * cp)
    head, tail = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(head, head + c), torch.arange(tail, tail + c)])


def next_token_labels(tokens: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = tokens[:, t + 1]; the last position's label is IGNORE."""
    labels = torch.full_like(tokens, IGNORE)
    labels[:, :-1] = tokens[:, 1:]
    return labels


class GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over the cp group (rank order); backward sums the gathered tensor's gradient over
    the group and keeps this rank's part (a reduce-scatter; an all-reduce on gloo, which has none)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int, dim: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rank, ctx.dim = group, size, rank, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":
            dist.all_reduce(grad, group=ctx.group)
            mine = grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank]
        else:
            chunks = [c.contiguous() for c in grad.chunk(ctx.size, dim=ctx.dim)]
            mine = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(mine, chunks, group=ctx.group)
        return mine.contiguous(), None, None, None, None


class ContextParallel(TorchFunctionMode):
    """While active: SDPA over the cp group's keys and values, and the model's positions made the rank's (see the
    module's docstring). `tables`: the parameters and buffers of the rank's stages that may be position tables."""

    def __init__(
        self, group: dist.ProcessGroup, cp: int, rank: int, seq: int, device: torch.device,
        tables: Iterable[torch.Tensor] = (), mesh: Any = None,
    ) -> None:
        super().__init__()
        self.group, self.cp, self.rank, self.seq = group, cp, rank, seq
        self.local = seq // cp
        self.pos = positions(seq, cp, rank)
        # the gathered keys' global positions: every rank's share, in rank order
        self.key_pos = torch.cat([positions(seq, cp, r) for r in range(cp)])
        self.buffers = {id(t) for t in tables}
        self.device = device
        self.torch_cp: Any = None  # torch's context_parallel context (GPUs)
        if device.type == "cuda" and mesh is not None:
            from torch.distributed.tensor.experimental import context_parallel
            from torch.distributed.tensor.experimental._attention import set_rotate_method

            set_rotate_method("allgather")
            # torch shards its buffers itself; ours are sharded already (the same head-tail order), so it is
            # given one of the whole sequence's length only to make its load balancer for that length.
            dummy = torch.zeros(1, seq, device=device)
            self.torch_cp = context_parallel(mesh, buffers=[dummy], buffer_seq_dims=[1], no_restore_buffers={dummy})

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Active for one step's forward and backward: torch's context_parallel (GPUs) and this mode, which
        `recomputed` enters again while a checkpointed unit's forward is recomputed (the autograd engine does not
        carry a torch-function mode into the backward)."""
        global _ACTIVE
        with self.torch_cp if self.torch_cp is not None else contextlib.nullcontext(), self:
            _ACTIVE = self
            try:
                yield
            finally:
                _ACTIVE = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SDPA:
            return self._attention(*args, **kwargs)
        if func is torch.arange:
            out = self._positions(args, kwargs)
            if out is not None:
                return out
        if func is torch.Tensor.__getitem__ and len(args) == 2 and self._is_table(args[0]):
            out = self._table_rows(args[0], args[1])
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _is_table(self, t: Any) -> bool:
        """A parameter (FSDP's unsharded ones too) or one of the stages' buffers, of at least `seq` rows."""
        return (
            isinstance(t, torch.Tensor) and (isinstance(t, nn.Parameter) or id(t) in self.buffers)
            and t.dim() >= 1 and t.shape[0] >= self.seq
        )

    def _positions(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """arange(n) or arange(0, n) with n the whole sequence or the rank's share: the rank's positions."""
        if kwargs.get("start") is not None or kwargs.get("step") not in (None, 1):
            return None
        nums = [a for a in args if isinstance(a, (int, torch.SymInt))]
        if len(nums) != len(args) or not 1 <= len(nums) <= 2 or (len(nums) == 2 and nums[0] != 0):
            return None
        end = kwargs.get("end", nums[-1])
        if end not in (self.seq, self.local):
            return None
        device = kwargs.get("device") or torch.get_default_device()
        return self.pos.to(device=device, dtype=kwargs.get("dtype") or torch.int64)

    def _table_rows(self, table: torch.Tensor, index: Any) -> torch.Tensor | None:
        """table[:n, ...] (or table[...] of exactly seq rows) with n the whole sequence or the rank's share: the
        rank's rows, then the rest of the index."""
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if not isinstance(first, slice) or first.start not in (None, 0) or first.step not in (None, 1):
            return None
        stop = first.stop
        if not (stop in (self.seq, self.local) or (stop is None and table.shape[0] == self.seq)):
            return None
        rows = table.index_select(0, self.pos.to(table.device))
        return rows[(slice(None),) + tuple(rest)] if rest else rows

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, **rest: Any,
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise RunError(
                "The model passes attn_mask to scaled_dot_product_attention, which context parallelism cannot "
                "shard (it holds the whole sequence's pairs). Use is_causal=True (or no mask), or re-plan with "
                "--cp 1."
            )
        if q.shape[-2] != self.local:
            raise RunError(
                f"scaled_dot_product_attention got {q.shape[-2]} queries, but each of the {self.cp} cp ranks holds "
                f"{self.local} of the sequence's {self.seq} tokens: the model's attention must take its sequence "
                "from its input. Re-plan with --cp 1."
            )
        if self.torch_cp is not None:
            # torch's context-parallel SDPA (patched into torch.nn.functional while `context_parallel` is active)
            patched: Callable[..., torch.Tensor] = F.scaled_dot_product_attention
            return patched(q, k, v, dropout_p=dropout_p, is_causal=is_causal, **rest)
        keys = GatherSequence.apply(k, self.group, self.cp, self.rank, -2)  # type: ignore[no-untyped-call]
        values = GatherSequence.apply(v, self.group, self.cp, self.rank, -2)  # type: ignore[no-untyped-call]
        mask = None
        if is_causal:
            mask = self.key_pos.to(q.device)[None, :] <= self.pos.to(q.device)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p, **rest)


def shard_batch(batch: tuple[torch.Tensor, ...], cp: int, rank: int) -> tuple[torch.Tensor, ...]:
    """A micro-batch of one [batch, seq] token tensor as the cp rank runs it: (its tokens, their next-token labels,
    the whole sequence's tokens) (the loss reads the last two)."""
    if len(batch) != 1 or batch[0].is_floating_point() or batch[0].dim() != 2:
        raise RunError(
            f"Context parallelism shards one [batch, seq] tensor of token ids, but the batch holds "
            f"{[tuple(t.shape) for t in batch]} ({', '.join(str(t.dtype) for t in batch)}). Re-plan with --cp 1."
        )
    tokens = batch[0]
    idx = positions(tokens.shape[1], cp, rank).to(tokens.device)
    return tokens.index_select(1, idx), next_token_labels(tokens).index_select(1, idx), tokens


def is_next_token_loss(loss_fn: Callable[..., torch.Tensor]) -> bool:
    """Whether a model file's loss_fn(output, tokens) computes the default next-token cross-entropy (the mean over
    every position but the last), tried on two random logits; any error or difference: False."""
    g = torch.Generator().manual_seed(0)
    for b, s, v in ((2, 6, 11), (1, 5, 7)):
        logits = torch.randn(b, s, v, generator=g)
        tokens = torch.randint(0, v, (b, s), generator=g)
        want = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        try:
            got = loss_fn(logits.clone(), tokens.clone())
        except Exception:  # noqa: BLE001 - any failure means: not the default loss
            return False
        if not isinstance(got, torch.Tensor) or got.numel() != 1 or not torch.allclose(got.float(), want, atol=1e-5):
            return False
    return True


class ContextParallelLoss:
    """The loss of one cp rank's micro-batch, called as loss(output, tokens, labels, whole tokens) (`shard_batch`).

    With the default next-token loss (or a loss_fn that computes it, `is_next_token_loss`): the cross-entropy
    summed over the rank's positions, times cp, over the whole sequence's predicted positions; averaged over the cp
    ranks (the gradients' mean over dp x cp, and the reported loss) that is the mean over the whole sequence.
    Another loss_fn is called on the whole sequence's logits, all-gathered over the cp ranks (their gradient
    summed back, so that the mean over the cp ranks is the loss's gradient): exact, at the cost of holding them.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor] | None, group: dist.ProcessGroup, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self.custom = loss_fn if loss_fn is not None and not is_next_token_loss(loss_fn) else None

    def __call__(self, output: Any, tokens: torch.Tensor, labels: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        if self.custom is None:
            b, s = whole.shape
            summed = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
            )
            return summed * (self.cp / (b * (s - 1)))
        gathered = GatherSequence.apply(logits, self.group, self.cp, self.rank, 1)  # type: ignore[no-untyped-call]
        order = torch.cat([positions(whole.shape[1], self.cp, r) for r in range(self.cp)])
        full = gathered.index_select(1, torch.argsort(order).to(gathered.device))  # back to the sequence's order
        return self.custom(full, whole)


def stage_buffers(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The buffers of `modules` (besides parameters, what `ContextParallel` may read a position table from)."""
    return [t for m in modules for t in m.buffers()]
