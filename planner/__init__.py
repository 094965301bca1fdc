"""planner: auto-parallelization planner for PyTorch training.

The data flow is one direction (see DESIGN.md): model file -> ModelGraph -> CostProfile -> Plan -> scripts.
"""

__version__ = "0.1.0"
