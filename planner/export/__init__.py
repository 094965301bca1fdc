"""A plan in the configuration of the frameworks people train with: `planner export PLAN_DIR --to torchtitan`
(torchtitan.py: the fields of its Trainer.Config a configuration function sets, and the equivalent
`--section.option` flags) or `--to megatron` (megatron.py: Megatron-LM's command-line arguments).

Each maps the plan's degrees, micro-batching, schedule, recomputation and ZeRO stage onto the framework's own
names (checked against lists extracted from their source: tests/fixtures/frameworks/) and refuses, with the
reason, what the framework cannot express (PlannerError: ExportError)."""

from __future__ import annotations

import re

from planner.plan import Plan

# A unit that is one repeated block: a single module of a container, "layers.3" / "model.layers.3".
_BLOCK = re.compile(r"^[\w.]*\.\d+$")


def stage_modules(plan: Plan) -> list[list[str]]:
    """The modules of each pipeline stage, in pipeline order."""
    return [list(s.modules) for s in sorted(plan.stages, key=lambda s: s.index)]


def blocks_per_stage(plan: Plan) -> list[int]:
    """How many repeated blocks (transformer layers) each pipeline stage holds, in pipeline order."""
    return [
        sum(1 for u in s.units if "+" not in u and _BLOCK.match(u)) for s in sorted(plan.stages, key=lambda s: s.index)
    ]


def seq_len(plan: Plan) -> int | None:
    """Tokens per sample, where the plan's model takes tokens."""
    return plan.tokens_per_sample
