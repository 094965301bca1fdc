"""Option types shared by the commands, defined once as `Annotated` aliases, and the helpers they share.

Nothing here imports torch or the planner's heavy modules: `planner --help` must stay fast. Commands import
the library inside their function bodies.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from planner.errors import ConfigError, ModelLoadError

# Schedule and Recompute are the Literal types of the one list of names (planner.names, defined in
# planner.runtime.names); typer offers a Literal's values as the option's choices, so a new schedule or
# recomputation mode is an option value without an edit here.
from planner.names import MAX_TOP_K, Recompute, Schedule

if TYPE_CHECKING:
    from rich.console import Console

    from planner.pipeline import PlanRequest

DEBUG_ENV = "PLANNER_DEBUG"

# Help panels, so that `planner plan --help` groups its many options.
_MODEL = "Model"
_CLUSTER = "Cluster and batch"
_PINS = "Pins (fix a dimension instead of searching it)"
_SEARCH = "Search"
_TRAINING = "Generated training script"
_OUTPUT = "Output"




class DType(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


PlanPathArg = Annotated[
    Path,
    typer.Argument(help="plan.json, or the folder `planner plan --out` wrote.", metavar="PLAN", show_default=False),
]

# --- model ------------------------------------------------------------------------------------------------

ModelFileArg = Annotated[
    Path,
    typer.Argument(
        help="Python file defining build_model(**kwargs) and example_inputs(batch_size, **kwargs).",
        metavar="MODEL_FILE", show_default=False,
    ),
]
def read_config_file(ctx: typer.Context, _param: Any, value: Path | None) -> Path | None:
    """--config FILE: a YAML mapping of the command's options (`global-batch-size: 64`, `model-arg: [layers=4]`)
    that become their defaults; what the command line gives still wins (click's default_map)."""
    if value is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(value.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {value} cannot be read as YAML ({type(e).__name__}: {e}). Pass a YAML "
                          "file of option: value lines, e.g. `global-batch-size: 64`.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {value} holds a {type(data).__name__}, not a mapping. Write one option per "
                          "line, e.g. `gpu: h100-sxm-80gb`.")
    names = {p.name for p in ctx.command.params if p.name and p.name != "config" and p.expose_value}
    defaults: dict[str, Any] = {}
    for key, item in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in names:
            raise ConfigError(
                f"--config {value}: {key!r} is not an option of `planner {ctx.info_name}`. Use the options' long "
                f"names: {', '.join(sorted(n.replace('_', '-') for n in names))}."
            )
        defaults[name] = item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", metavar="FILE", rich_help_panel=_OUTPUT, show_default=False, is_eager=True,
        callback=read_config_file, exists=False,
        help="YAML file of this command's options (long names: `gpu: dgx-h100`, `global-batch-size: 1536`, "
        "`model-arg: [preset=gpt3-175b]`); options given on the command line override it.",
    ),
]
HfConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--hf-config", metavar="PATH", rich_help_panel=_MODEL, show_default=False,
        help="config.json (or its folder) for an hf:NAME model source; default: a local folder NAME, else the "
        "repository's config.json through huggingface_hub (its cache; from the Hub when online, that file alone; "
        "HF_HUB_OFFLINE=1 keeps it to the cache).",
    ),
]
RevisionOpt = Annotated[
    str | None,
    typer.Option(
        "--revision", metavar="REV", rich_help_panel=_MODEL, show_default=False,
        help="Branch, tag or commit of an hf:ORG/NAME repository whose config.json is read (default: main).",
    ),
]
FlavorOpt = Annotated[
    str | None,
    typer.Option(
        "--flavor", metavar="NAME", rich_help_panel=_MODEL, show_default=False,
        help="Flavor of a torchtitan:MODEL source (torchtitan's model-args registry: debugmodel, 8B, 70B ...).",
    ),
]
ModelArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--model-arg", "-a", metavar="KEY=VALUE", rich_help_panel=_MODEL,
        help="Keyword argument for build_model and example_inputs; VALUE is read as a Python literal "
        "(4, 1e-3, 'x', [1, 2]) or else kept as a string. Repeatable.",
    ),
]
BuildFnOpt = Annotated[str, typer.Option(help="Name of the model factory in the file.", rich_help_panel=_MODEL)]
InputsFnOpt = Annotated[
    str, typer.Option(help="Name of the example-inputs function in the file.", rich_help_panel=_MODEL)
]
LossFnOpt = Annotated[
    str | None,
    typer.Option(
        help="Name of a loss function in the file (default: loss_fn if defined, else next-token cross-entropy "
        "for token inputs, else the mean of the output).", rich_help_panel=_MODEL,
    ),
]
DataOpt = Annotated[
    str | None,
    typer.Option(
        "--data",
        help="Name of a data function in the model file, get_batch(step, micro_batch_size, **model_args) -> "
        "inputs, that the generated train.py calls for real batches (default: get_batch if defined, else "
        "synthetic batches from the example-inputs function).", rich_help_panel=_MODEL,
    ),
]
MeasureOpt = Annotated[
    bool | None,
    typer.Option(
        "--measure/--no-measure",
        help="Time each distinct unit on this machine and use the measured times (default: only when the "
        "local CUDA GPU is the target GPU).", rich_help_panel=_MODEL,
    ),
]
DTypeOpt = Annotated[DType, typer.Option(help="Training dtype (mixed precision).", rich_help_panel=_MODEL)]

# --- cluster and batch ------------------------------------------------------------------------------------

GpuOpt = Annotated[
    str,
    typer.Option(
        help="GPU or cluster spec: a name or alias from `planner hardware list`, or the path of a YAML file.",
        show_default=False, rich_help_panel=_CLUSTER,
    ),
]
NodesOpt = Annotated[int, typer.Option(min=1, help="Number of nodes.", rich_help_panel=_CLUSTER)]
GpusPerNodeOpt = Annotated[
    int | None,
    typer.Option(min=1, help="GPUs per node (default: the spec's node).", rich_help_panel=_CLUSTER),
]
MemoryReserveOpt = Annotated[
    float | None,
    typer.Option(
        "--memory-reserve", min=0, metavar="GIB",
        help="GiB per GPU that every plan keeps free for the CUDA context and NCCL buffers (default: the "
        "spec's memory_reserve; its fragmentation share of what a rank holds applies either way).",
        rich_help_panel=_CLUSTER,
    ),
]
GlobalBatchOpt = Annotated[
    int,
    typer.Option(min=1, help="Samples per optimizer step, over all replicas.", show_default=False,
                 rich_help_panel=_CLUSTER),
]

# --- pins -------------------------------------------------------------------------------------------------

DpOpt = Annotated[int | None, typer.Option("--dp", min=1, help="Data-parallel degree.", rich_help_panel=_PINS)]
EpOpt = Annotated[
    int | None,
    typer.Option(
        "--ep", min=1, help="Expert-parallel degree (MoE): experts sharded over ep of the dp ranks; ep divides dp.",
        rich_help_panel=_PINS,
    ),
]
CpOpt = Annotated[
    int | None,
    typer.Option(
        "--cp", min=1, help="Context-parallel degree: each sample's sequence sharded over cp ranks (attention "
        "all-gathers keys and values); world = dp x cp x tp x pp.",
        rich_help_panel=_PINS,
    ),
]
TpOpt = Annotated[
    int | None, typer.Option("--tp", min=1, help="Tensor-parallel degree (inside a node).", rich_help_panel=_PINS)
]
PpOpt = Annotated[int | None, typer.Option("--pp", min=1, help="Pipeline-parallel degree.", rich_help_panel=_PINS)]
VirtualStagesOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Pipeline stages per pp rank (2+ for interleaved-1f1b, 2 for zero-bubble).",
                 rich_help_panel=_PINS),
]
MicroBatchOpt = Annotated[
    int | None, typer.Option(min=1, help="Samples per micro-batch.", rich_help_panel=_PINS)
]
ScheduleOpt = Annotated[
    Schedule | None, typer.Option(help="Pipeline schedule.", rich_help_panel=_PINS)
]
ZeroStageOpt = Annotated[
    int | None,
    typer.Option(min=0, max=3, help="0 DDP, 1 sharded optimizer, 2 + sharded grads, 3 FSDP.", rich_help_panel=_PINS),
]
RecomputeOpt = Annotated[
    Recompute | None, typer.Option(help="Activation recomputation for every stage.", rich_help_panel=_PINS)
]
RecomputeBlocksOpt = Annotated[
    int | None,
    typer.Option(
        "--recompute-blocks", min=1, metavar="N",
        help="Recompute the first N blocks of every stage fully and keep the rest at the stage's recompute mode "
        "(Megatron-LM's --recompute-method block --recompute-num-layers N; default: chosen per stage where it "
        "fits and is faster).",
        rich_help_panel=_PINS,
    ),
]
SequenceParallelOpt = Annotated[
    bool | None,
    typer.Option("--sequence-parallel/--no-sequence-parallel", help="Shard norms and dropout over the sequence "
                 "with tensor parallelism (default: searched).", show_default=False, rich_help_panel=_PINS),
]
AsyncTpOpt = Annotated[
    bool | None,
    typer.Option("--async-tp/--no-async-tp", help="torch's async TP: sequence parallelism's collectives "
                 "overlapped with the matmuls (torch.compile, NVIDIA GPUs; default: on where it runs).",
                 show_default=False, rich_help_panel=_PINS),
]

# --- search -----------------------------------------------------------------------------------------------

TopKOpt = Annotated[
    int, typer.Option(min=0, help=f"Runners-up to keep and report (at most {MAX_TOP_K}).",
                      rich_help_panel=_SEARCH),
]
TimeLimitOpt = Annotated[
    float | None,
    typer.Option(min=0.0, help="Seconds each stage-partition ILP may take; 0 for no limit (default: the "
                 "planner's own limit).", rich_help_panel=_SEARCH),
]
NoOverlapOpt = Annotated[
    bool,
    typer.Option("--no-overlap", help="Assume data-parallel gradient sync does not overlap the backward pass.",
                 rich_help_panel=_SEARCH),
]

# --- the generated training script ------------------------------------------------------------------------

SeedOpt = Annotated[int, typer.Option(help="Random seed of the generated script.", rich_help_panel=_TRAINING)]
LrOpt = Annotated[float, typer.Option(help="Learning rate of the generated script.", rich_help_panel=_TRAINING)]
InitFromOpt = Annotated[
    str | None,
    typer.Option(
        "--init-from", metavar="PATH",
        help="Weights the generated script starts from: a Hugging Face folder (save_pretrained's safetensors) or "
        "repo id in the local cache, a torch.distributed.checkpoint folder, or a state_dict file; checked "
        "against the model now. Default: the model's own initialisation.",
        rich_help_panel=_TRAINING, show_default=False,
    ),
]
StepsOpt = Annotated[
    int, typer.Option(min=1, help="Training steps of the generated script.", rich_help_panel=_TRAINING)
]

# --- output -----------------------------------------------------------------------------------------------

OutOpt = Annotated[
    Path, typer.Option("--out", "-o", help="Folder for plan.json, timeline.svg and the scripts.",
                       rich_help_panel=_OUTPUT),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", "-f", help="Overwrite files that hold something else.", rich_help_panel=_OUTPUT)
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print JSON to stdout instead of the tables.", rich_help_panel=_OUTPUT)
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print nothing but errors.", rich_help_panel=_OUTPUT)
]
TimestampOpt = Annotated[
    bool,
    typer.Option("--timestamp", rich_help_panel=_OUTPUT,
                 help="Record the creation time (UTC) in plan.json; the file then differs from run to run."),
]


# --- shared helpers ---------------------------------------------------------------------------------------


@dataclass
class Settings:
    """The global options (`planner --debug --quiet CMD`), kept on the click context for the commands."""

    debug: bool = False
    quiet: bool = False


def settings(ctx: typer.Context | None) -> Settings:
    """The global options of this invocation (defaults, with $PLANNER_DEBUG, outside one)."""
    found = ctx.find_object(Settings) if ctx is not None else None
    return found if found is not None else Settings(debug=bool(os.environ.get(DEBUG_ENV)))


def is_quiet(ctx: typer.Context, local: bool = False) -> bool:
    """--quiet given to the command or to `planner` itself."""
    return local or settings(ctx).quiet


def stdout_console() -> Console:
    """A console on the current stdout (created per call: test runners swap sys.stdout).

    Off a terminal, rich draws no colour or animation; it then lays tables out at 120 columns (or $COLUMNS)
    rather than 80 so that piped reports stay readable.
    """
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, soft_wrap=False, width=120)
    return console


def stderr_console() -> Console:
    """Progress and status go to stderr, so that `--json` output on stdout stays clean."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def examples_epilog(examples: list[str]) -> str:
    """The examples block at the end of a command's --help; click's \\b keeps its lines from being rewrapped."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in examples)


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """['layers=4', "name='x'", 'tag=abc'] -> {'layers': 4, 'name': 'x', 'tag': 'abc'}.

    Values are Python literals when they parse as one (ast.literal_eval, which runs no code), else strings.
    """
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(
                f"--model-arg {item!r} is not KEY=VALUE with KEY a Python identifier. Write it like "
                "--model-arg layers=4 or --model-arg preset=gpt3-175b."
            )
        try:
            out[key] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            out[key] = raw
        digits = raw.strip().lstrip("+-").replace("_", "")
        problem = unstorable(out[key])
        if digits.isdigit() and len(digits) > MAX_INT_DIGITS:  # Python itself refuses to read it as a number
            problem = f"an integer of more than {MAX_INT_DIGITS} digits"
        if problem:
            raise ConfigError(
                f"--model-arg {key}: {problem}. plan.json stores model arguments as JSON, and `planner emit` "
                "rebuilds the script from it, so a value must survive that unchanged: numbers (finite), strings, "
                "true/false, None, lists and dicts with string keys. Pass it in one of those forms."
            )
    return out


MAX_INT_DIGITS = 1000  # far above any model size; Python refuses to print integers of more than 4300 digits


def unstorable(value: Any, depth: int = 0) -> str:
    """Why `value` would not come back unchanged from plan.json ('' when it would)."""
    import math

    if depth > 32:
        return "it nests more than 32 levels deep"
    if value is None or isinstance(value, bool):
        return ""
    if isinstance(value, int):
        return f"an integer of more than {MAX_INT_DIGITS} digits" if value.bit_length() > 3 * MAX_INT_DIGITS else ""
    if isinstance(value, float):
        return "" if math.isfinite(value) else f"{value!r} is not a finite number"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "it holds bytes that are not UTF-8 text"
        return ""
    if isinstance(value, list):
        return next((why for why in (unstorable(v, depth + 1) for v in value) if why), "")
    if isinstance(value, dict):
        key = next((k for k in value if not isinstance(k, str)), None)
        if key is not None:
            return f"the dict key {key!r} is not a string (JSON would turn it into one)"
        return next((why for why in (unstorable(v, depth + 1) for v in value.values()) if why), "")
    if isinstance(value, tuple):
        return "a tuple comes back from plan.json as a list: write it as a list [...]"
    return f"a {type(value).__name__} has no JSON form"


def plan_request(
    model_file: Path, model_arg: list[str] | None, *, gpu: str, nodes: int, gpus_per_node: int | None,
    global_batch_size: int, dp: int | None, tp: int | None, pp: int | None, virtual_stages: int | None,
    micro_batch_size: int | None, schedule: Schedule | None, zero_stage: int | None, recompute: Recompute | None,
    sequence_parallel: bool | None, dtype: DType, build_fn: str, inputs_fn: str, loss_fn: str | None, top_k: int,
    time_limit: float | None, no_overlap: bool, seed: int, lr: float, steps: int, data: str | None = None,
    measure: bool | None = None, memory_reserve: float | None = None, hf_config: Path | None = None,
    flavor: str | None = None, ep: int | None = None, revision: str | None = None, cp: int | None = None,
    async_tp: bool | None = None, recompute_blocks: int | None = None,
) -> PlanRequest:
    """The library's PlanRequest from the options `plan` and `dry-run` share; unset pins are searched.

    A model source that is not a file (hf:NAME, torchtitan:MODEL --flavor NAME, module:pkg.mod:factory) is
    compiled into a model file in a temporary folder first (see `compiled_source_files`).
    """
    from planner.model.sources import compile_source, is_source
    from planner.pipeline import PlanRequest

    if top_k > MAX_TOP_K:  # before the model is loaded: refused at once
        raise ConfigError(
            f"--top-k {top_k} is above the most runners-up the planner keeps, {MAX_TOP_K}: each one kept weakens the "
            "search's pruning (thousands would make it solve nearly every candidate, for minutes). Pass --top-k "
            f"{MAX_TOP_K} or less."
        )

    if recompute_blocks is not None:  # before the model is loaded: what needs no model refused at once
        from planner.search.search import check_recompute_blocks
        from planner.search.space import Pins

        check_recompute_blocks(None, Pins(recompute=recompute, recompute_blocks=recompute_blocks))

    if is_source(str(model_file)):
        import atexit
        import shutil
        import tempfile

        args = parse_model_args(model_arg)
        # Compiled into a private folder, never straight into --out: `plan` adds model_source.py (and the
        # config it reads) to the output set, which is written as one unit after the search.
        where = Path(tempfile.mkdtemp(prefix="planner-source-"))
        atexit.register(shutil.rmtree, where, True)
        model_file = compile_source(
            str(model_file), where, hf_config, int(args.get("seq", 2048)), flavor, revision
        )
    elif flavor is not None:
        raise ModelLoadError(
            f"--flavor {flavor} names a torchtitan flavor, but {model_file} is not a torchtitan:MODEL source. "
            "Drop --flavor, or plan torchtitan:MODEL --flavor NAME."
        )

    pins: dict[str, Any] = {
        "dp": dp, "tp": tp, "pp": pp, "virtual_stages": virtual_stages, "micro_batch_size": micro_batch_size,
        "schedule": schedule, "zero_stage": zero_stage,
        "sequence_parallel": sequence_parallel, "recompute": recompute, "ep": ep,
        "cp": cp,
    }
    if async_tp is not None:  # only when given: a request's pins are part of what earlier plans recorded
        pins["tp_overlap"] = async_tp
    if recompute_blocks is not None:
        pins["recompute_blocks"] = recompute_blocks
    # An unset --time-limit leaves PlanRequest's default; 0 asks for none.
    limit: dict[str, Any] = {} if time_limit is None else {"time_limit": time_limit or None}
    return PlanRequest(
        model_path=str(model_file), model_args=parse_model_args(model_arg), build_fn=build_fn, inputs_fn=inputs_fn,
        loss_fn=loss_fn, batch_fn=data, measure=measure, dtype=dtype.value, gpu=gpu, nodes=nodes,
        gpus_per_node=gpus_per_node,
        global_batch_size=global_batch_size, pins={k: v for k, v in pins.items() if v is not None}, top_k=top_k,
        overlap_dp_comm=not no_overlap, seed=seed, lr=lr, steps=steps, memory_reserve_gib=memory_reserve, **limit,
    )


def compiled_source_files(model_file: str | Path, model_path: str) -> dict[str, tuple[str, bool]]:
    """The files a compiled model source (hf:NAME, module:...) consists of, read from where `plan_request`
    compiled it (`model_path`): model_source.py and the config beside it, to write into the plan folder.
    Empty for a user's own model file."""
    from planner.model.sources import CONFIG_FILE, is_source

    if not is_source(str(model_file)):
        return {}
    path = Path(model_path)
    files = {path.name: (path.read_text(encoding="utf-8"), False)}
    if (path.parent / CONFIG_FILE).is_file():
        files[CONFIG_FILE] = ((path.parent / CONFIG_FILE).read_text(encoding="utf-8"), False)
    return files
