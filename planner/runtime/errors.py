"""The runtime's error types. The generated train.py turns them into a one-paragraph message and exit code 1;
the planner's plan-time check turns them into a PlanError (exit code 2)."""

from __future__ import annotations


class RunError(Exception):
    """A plan, model file or layout that cannot run; the message states the problem and the fix."""


class RefusedLayout(RunError):
    """The model cannot run in this plan's layout (its pipeline split, stage placement or TP degree), though
    another layout of it may: the planner then falls back to the next plan it ranked."""


class LayoutError(RunError, ValueError):
    """The plan's constants break a rule of the parallel layout (the message names rule, values and fix)."""
