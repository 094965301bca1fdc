"""One exception type per kind of user mistake; the CLI maps each to a clean message and exit code 2."""


class PlannerError(Exception):
    """Base class: a problem with the user's input, with a message that says how to fix it."""


class ModelLoadError(PlannerError):
    """The model file cannot be imported or does not follow the model-file contract."""


class TraceError(PlannerError):
    """Neither torch.fx nor torch.export could follow the model."""


class SpecError(PlannerError):
    """A hardware or cluster spec is unknown or malformed."""


class InfeasibleError(PlannerError):
    """No configuration satisfies the constraints (degrees, batch divisibility, memory)."""


class PlanError(PlannerError):
    """A plan file is malformed, of another schema version, or inconsistent with the request."""


class LayoutRefusedError(PlanError):
    """The plan-time check found that the model cannot run in the chosen layout (another layout may)."""


class CheckpointError(PlannerError):
    """Weights to start from that are not the planned model's (other names, other shapes) or cannot be read."""


class ExportError(PlannerError):
    """A plan that the framework it is exported to cannot express (a schedule, an uneven split it lacks)."""


class ConfigError(PlannerError):
    """Command-line options contradict each other or name impossible values."""
