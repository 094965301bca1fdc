"""Former home of the unit analysis, now split by job (issue 12); kept so existing imports keep working.

- planner/model/counting.py: FLOP, byte and saved-activation counting of one unit
- planner/model/grouping.py: structure discovery, partition units and node ownership
- planner/model/tp.py: tensor-parallel pair detection
- planner/model/analysis.py: analyse_model, which wires them together
"""

from planner.model.analysis import analyse_model
from planner.model.counting import analyse_callable, flatten_tensors
from planner.model.grouping import assign_nodes, discover_structure, model_input_count, run_units_once
from planner.model.tp import detect_tp_pairs

__all__ = [
    "analyse_callable",
    "analyse_model",
    "assign_nodes",
    "detect_tp_pairs",
    "discover_structure",
    "flatten_tensors",
    "model_input_count",
    "run_units_once",
]
