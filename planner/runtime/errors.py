"""The runtime's error types. The generated train.py turns them into a one-paragraph message and exit code 1;
the planner's plan-time check turns them into a PlanError (exit code 2)."""

from __future__ import annotations


class RunError(Exception):
    """A plan, model file or layout that cannot run; the message states the problem and the fix."""


class LayoutError(RunError, ValueError):
    """The plan's constants break a rule of the parallel layout (the message names rule, values and fix)."""
