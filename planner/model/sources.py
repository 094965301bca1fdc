"""Model sources that are not a model file: a Hugging Face config, a torchtitan model, a Python factory.

Each is compiled into a model file that follows the model-file contract (build_model / example_inputs /
loss_fn), written into the plan directory as ``model_source.py`` beside the ``config.json`` it reads, so
everything downstream (the analysis, the generated train.py) only ever loads model files, and a plan
directory still runs where the source's cache is absent. Weights are never fetched: a Hugging Face config
comes from a local file or directory, or through huggingface_hub (its cache, or config.json alone from the
Hub), and models are built on meta.
transformers and torchtitan are optional and imported only by the generated file when it runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from planner.errors import ModelLoadError
from planner.escape import py_str, py_text

SOURCE_FILE = "model_source.py"
CONFIG_FILE = "config.json"
PREFIXES = ("hf:", "torchtitan:", "module:")

# What real training needs and the generated file sets: no KV cache, no returned past, an attention that
# traces and runs fused on GPUs (PyTorch's scaled_dot_product_attention; see hf_settings for the exception).
HF_SETTINGS = {"use_cache": False, "return_dict": True, "attn_implementation": "sdpa"}


def hf_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """HF_SETTINGS for the config's architecture: its attention through scaled_dot_product_attention, or
    transformers' eager attention where the class has no sdpa path (Gemma-2's logit soft-capping: asking
    for sdpa raises), which then runs, traces and is costed as written (matmuls, softmax, the s x s map)."""
    import transformers

    settings = dict(HF_SETTINGS)
    arch = (raw.get("architectures") or [""])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch else None
    if cls is not None and getattr(cls, "_supports_sdpa", True) is False:
        settings["attn_implementation"] = "eager"
    return settings


def _py_dict(settings: dict[str, Any]) -> str:
    """A settings dict (names to strings, numbers, booleans) as a Python literal, each string through py_str."""
    items = (f"{py_str(k)}: {py_str(v) if isinstance(v, str) else repr(v)}" for k, v in settings.items())
    return "{" + ", ".join(items) + "}"


def is_source(spec: str) -> bool:
    return spec.startswith(PREFIXES)


def find_hf_config(name: str, hf_config: str | Path | None = None, revision: str | None = None) -> Path:
    """The config.json for ``hf:NAME``: --hf-config, NAME as a path, a local directory NAME, or the Hub's file.

    A repository id (org/name) goes through huggingface_hub's own API, so its cache layout, its environment
    (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN) and ``revision`` (a branch, tag or commit)
    mean what they mean to every Hugging Face tool: with a network, `hf_hub_download` fetches config.json
    alone (never weights) or confirms the cached copy is current; offline (HF_HUB_OFFLINE=1) or unreachable,
    the revision's cached copy is read (`try_to_load_from_cache`), and a cache without it is an error."""
    tried = []
    for cand in ([Path(hf_config).expanduser()] if hf_config else []) + [Path(name).expanduser()]:
        path = cand / CONFIG_FILE if cand.is_dir() else cand
        tried.append(str(path))
        if path.is_file():
            return path.resolve()
    at = f" at revision {revision}" if revision else ""
    fetch = f"`hf download {name} {CONFIG_FILE}" + (f" --revision {revision}`" if revision else "`")
    if "/" not in name or name.endswith(".json"):
        raise ModelLoadError(
            f"No config.json found for hf:{name} (looked at {', '.join(tried)}). Pass the model's config with "
            "--hf-config PATH (a config.json or the folder holding it), or name a Hugging Face repository "
            "as hf:ORG/NAME."
        )
    _require("huggingface_hub", "hf")
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    cached = try_to_load_from_cache(name, CONFIG_FILE, revision=revision)
    if constants.is_offline_mode():
        if isinstance(cached, str):
            return Path(cached).resolve()
        raise ModelLoadError(
            f"No config.json for hf:{name}{at} in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE is set, so the Hub is not asked (looked at {', '.join(tried)}). Fetch it once with "
            f"{fetch} on a machine with a network (only that file is downloaded), or pass a copy with "
            "--hf-config PATH."
        )
    try:
        # A cached copy makes a failed request fall back to it at once; without one, huggingface_hub retries
        # for up to a minute before giving up (HF_HUB_OFFLINE=1 skips the request on machines without a network).
        return Path(hf_hub_download(name, CONFIG_FILE, revision=revision)).resolve()
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        cause = f"the Hub could not be reached and the cache ({constants.HF_HUB_CACHE}) has no copy ({e})"
    except HfHubHTTPError as e:  # 401/403 gated or private, 404 no such repository or revision
        cause = f"the Hub refused it: {str(e).splitlines()[0]}"
    except (OSError, ValueError) as e:
        cause = f"{type(e).__name__}: {e}"
    raise ModelLoadError(
        f"No config.json for hf:{name}{at}: {cause}. Check the repository id and --revision, log in with "
        f"`hf auth login` for a gated model, fetch it with {fetch}, or pass a copy with --hf-config PATH."
    )


def _check_model_type(config: Path, model_type: object) -> None:
    """A model_type this transformers knows; else one short paragraph with the closest names (transformers' own
    error lists every known type: 12 KB)."""
    import difflib

    from transformers import CONFIG_MAPPING

    known = sorted(CONFIG_MAPPING.keys())
    if isinstance(model_type, str) and model_type in known:
        return
    close = difflib.get_close_matches(str(model_type), known, n=3) if isinstance(model_type, str) else []
    hint = f" Closest known: {', '.join(close)}." if close else ""
    import transformers

    raise ModelLoadError(
        f"{config} names model_type {str(model_type)[:80]!r}, which transformers {transformers.__version__} does not "
        f"know ({len(known)} types are known).{hint} Fix model_type, or upgrade transformers if the model is newer "
        "than it."
    )


def _require(package: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ModelLoadError(
            f"The {package} package is needed to plan this model source but is not installed. Install it with "
            f"`pip install -e '.[{extra}]'` (or `pip install {package}`), then run the command again."
        )


# Values enter these templates only through planner.escape: py_str for literals, py_text for the docstrings.
_HF_TEMPLATE = '''"""Generated by planner from {spec_text}: a model file reading {config_text} (beside it),
on any machine, with no download.

Settings for training, set here and reported in the plan: {settings_text}.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = {spec}
SETTINGS = {settings}
CONFIG = Path(__file__).with_name({config})


def _config():
    import transformers

    raw = json.loads(CONFIG.read_text())
    config = transformers.AutoConfig.for_model(**raw)
    config.use_cache = SETTINGS["use_cache"]
    config.return_dict = SETTINGS["return_dict"]
    config._attn_implementation = SETTINGS["attn_implementation"]
    return config


def _task(config):
    arch = (getattr(config, "architectures", None) or [""])[0]
    for task in ("ForCausalLM", "ForConditionalGeneration", "ForMaskedLM", "ForImageClassification", "LMHeadModel"):
        if arch.endswith(task):
            return arch, task
    return "", "ForCausalLM"


def build_model(**_):
    import transformers

    config = _config()
    arch, task = _task(config)
    if arch and hasattr(transformers, arch):
        return getattr(transformers, arch)._from_config(config)
    auto = {{"ForConditionalGeneration": "AutoModelForSeq2SeqLM", "ForMaskedLM": "AutoModelForMaskedLM",
            "ForImageClassification": "AutoModelForImageClassification"}}.get(task, "AutoModelForCausalLM")
    return getattr(transformers, auto).from_config(config)


def _seq(config, seq):
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or seq
    return min(seq, limit)


def example_inputs(batch_size, seq={seq}, **_):
    config = _config()
    _, task = _task(config)
    g = torch.Generator().manual_seed(0)
    if task == "ForImageClassification":
        size, channels = config.image_size, getattr(config, "num_channels", 3)
        return (torch.randn(batch_size, channels, size, size, generator=g),)
    seq = _seq(config, seq)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=g)
    if task == "ForConditionalGeneration":
        return (ids, torch.ones(batch_size, seq, dtype=torch.long), ids.roll(1, dims=1))
    if task == "ForMaskedLM":
        return (ids, torch.ones(batch_size, seq, dtype=torch.long))
    return (ids,)


def loss_fn(output, *inputs):
    logits = output.logits if hasattr(output, "logits") else output
    if logits.dim() == 2:  # classification: labels drawn from the inputs' seed
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits.float(), labels)
    ids = inputs[-1] if len(inputs) == 3 else inputs[0]  # decoder inputs for encoder-decoders
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
'''


def compile_source(
    spec: str, out_dir: str | Path, hf_config: str | Path | None = None, seq: int = 2048, flavor: str | None = None,
    revision: str | None = None,
) -> Path:
    """Write the model file for ``spec`` (hf:NAME, hf:path/config.json, torchtitan:MODEL with ``flavor``,
    module:pkg.mod:factory) into ``out_dir``; its path."""
    out = Path(out_dir)
    if spec.startswith("hf:"):
        name = spec[3:]
        config = find_hf_config(name, hf_config, revision)
        try:
            raw = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{config} is not a readable JSON config ({e}). Pass a model's config.json.") from None
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise ModelLoadError(
                f"{config} has no \"model_type\", so transformers cannot tell which model it describes. Pass the "
                "config.json of a Hugging Face model (it names model_type and architectures)."
            )
        _require("transformers", "hf")
        _check_model_type(config, raw["model_type"])
        out.mkdir(parents=True, exist_ok=True)
        if config.resolve() != (out / CONFIG_FILE).resolve():
            shutil.copyfile(config, out / CONFIG_FILE)
        settings = hf_settings(raw)
        text = _HF_TEMPLATE.format(
            spec=py_str(spec), spec_text=py_text(spec), config=py_str(CONFIG_FILE), config_text=py_text(CONFIG_FILE),
            settings=_py_dict(settings), settings_text=py_text(str(settings)), seq=int(seq),
        )
        path = out / SOURCE_FILE
        path.write_text(text)
        return path.resolve()
    if spec.startswith("torchtitan:"):
        return _compile_titan(spec, out, flavor, seq)
    if spec.startswith("module:"):
        return _compile_factory(spec, out)
    raise ModelLoadError(
        f"Unknown model source {spec!r}. Use a model file, hf:NAME, torchtitan:MODEL --flavor NAME, or "
        "module:pkg.mod:factory."
    )


_FACTORY_TEMPLATE = '''"""Generated by planner from {spec_text}: build_model and example_inputs come from {module_text}.
"""

import importlib

SOURCE = {spec}
SETTINGS = {{}}
_mod = importlib.import_module({module})
build_model = getattr(_mod, {factory})
example_inputs = getattr(_mod, {inputs})
if hasattr(_mod, "loss_fn"):
    loss_fn = _mod.loss_fn
'''


def _compile_factory(spec: str, out: Path) -> Path:
    """module:pkg.mod:factory -> a model file importing the factory and the module's example_inputs."""
    import importlib.util

    module, _, factory = spec[len("module:") :].partition(":")
    if not module or not factory.isidentifier():
        raise ModelLoadError(
            f"{spec!r} is not module:pkg.mod:factory. Name an importable module and the function in it that "
            "returns the nn.Module, e.g. module:mypkg.models:build_gpt."
        )
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ModelLoadError(
            f"Module {module!r} of {spec} cannot be imported. Install its package in this environment (pip "
            "install -e .) or add its folder to PYTHONPATH."
        )
    out.mkdir(parents=True, exist_ok=True)
    path = out / SOURCE_FILE
    path.write_text(_FACTORY_TEMPLATE.format(
        spec=py_str(spec), spec_text=py_text(spec), module=py_str(module), module_text=py_text(module),
        factory=py_str(factory), inputs=py_str("example_inputs"),
    ))
    return path.resolve()


# What the generated torchtitan file sets for training on any device: a causal attention that needs no
# mask object (torchtitan's default FlexAttention wants a BlockMask from its data loader and compiles a
# kernel; PyTorch's scaled_dot_product_attention with is_causal traces and runs on CPU and GPU alike), and
# rotary tables sized to the training sequence rather than the flavor's maximum (131072 positions for
# Llama 3: 64 MiB of complex numbers per layer otherwise), as torchtitan's trainer does itself.
TITAN_SETTINGS = {"attention": "sdpa_causal", "rope_max_seq_len": "seq"}

_TITAN_TEMPLATE = '''"""Generated by planner from {spec_text} --flavor {flavor_text}: torchtitan's config, on meta.

No tokenizer, no weights, no download: the model comes from torchtitan.models.{model_text}.model_registry.
Settings for training, set here and reported in the plan: {settings_text}.
"""

import dataclasses
import importlib

import torch
import torch.nn.functional as F

SOURCE = {spec}
MODEL = {model}
FLAVOR = {flavor}
SETTINGS = {settings}


def _autocast_off_on_meta():
    """torchtitan's MoE router computes its gate under torch.autocast(device_type=x.device.type), and the meta
    device the planner traces and checks on has no autocast ("unsupported autocast device_type 'meta'"): on
    meta, and only there, the region runs without autocast (the gate in the model's dtype instead of fp32).
    torch.autocast on the run's device is unchanged."""
    init = torch.autocast.__init__
    if getattr(init, "planner_meta", False):
        return

    def __init__(self, device_type, *args, **kwargs):
        if device_type == "meta":
            device_type = "cpu"
            if len(args) >= 2:
                args = (args[0], False, *args[2:])
            else:
                kwargs["enabled"] = False
        init(self, device_type, *args, **kwargs)

    __init__.planner_meta = True
    torch.autocast.__init__ = __init__


_autocast_off_on_meta()


def _config(seq):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = importlib.import_module("torchtitan.models." + MODEL).model_registry(FLAVOR).model
    for layer in config.layers:
        attention = getattr(layer, "attention", None)
        if attention is None:
            continue
        attention.inner_attention = ScaledDotProductAttention.Config()
        attention.rope = dataclasses.replace(attention.rope, max_seq_len=seq)
    return config


def build_model(seq={seq}, **_):
    return _config(seq).build()


def example_inputs(batch_size, seq={seq}, seed=0, **_):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, {vocab}, (batch_size, seq), generator=g),)


def loss_fn(output, *inputs):
    """Next-token cross-entropy, as torchtitan's CrossEntropyLoss (fp32 logits, mean over tokens)."""
    tokens = inputs[0]
    return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
'''


def titan_flavors(model: str) -> dict[str, object]:
    """torchtitan's flavor registry of ``model`` (its ``<model>_configs`` dict: flavor -> config factory)."""
    import importlib

    registry = importlib.import_module(f"torchtitan.models.{model}")
    for name in sorted(vars(registry)):
        value = getattr(registry, name)
        if name.endswith("_configs") and isinstance(value, dict) and value:
            return value
    return {}


def _titan_models() -> list[str]:
    import torchtitan.models

    return sorted(getattr(torchtitan.models, "_supported_models", ()))


def _compile_titan(spec: str, out: Path, flavor: str | None, seq: int) -> Path:
    """torchtitan:MODEL --flavor NAME -> a model file building torchtitan's config for that flavor on meta.

    Only decoder language models (torchtitan's Decoder: token embeddings, a ModuleDict of blocks, norm,
    lm_head) are accepted: the generated file feeds them token ids and a next-token loss."""
    model = spec[len("torchtitan:") :]
    _require("torchtitan", "titan")
    try:
        known = _titan_models()
    except ImportError as e:
        raise ModelLoadError(
            f"torchtitan is installed but cannot be imported ({e}). Reinstall it with `pip install -e '.[titan]'` "
            "(it needs triton, spmd-types and tyro), then run the command again."
        ) from None
    if model not in known:
        raise ModelLoadError(
            f"torchtitan has no model {model!r}. Known models: {', '.join(known)}. Pass one of them, e.g. "
            "torchtitan:llama3 --flavor 8B."
        )
    try:
        flavors = titan_flavors(model)
    except Exception as e:  # torchtitan's own import errors name what is missing
        raise ModelLoadError(f"torchtitan.models.{model} cannot be imported here: {type(e).__name__}: {e}") from None
    if not flavor or flavor not in flavors:
        said = f"has no flavor {flavor!r}" if flavor else "needs a flavor"
        raise ModelLoadError(
            f"torchtitan:{model} {said}. Known flavors: {', '.join(flavors)}. Pass one with --flavor, e.g. "
            f"--flavor {next(iter(flavors), 'debugmodel')}."
        )
    from torchtitan.models.common.decoder import Decoder

    config = __import__(f"torchtitan.models.{model}", fromlist=["model_registry"]).model_registry(flavor).model
    attentions = [layer.attention for layer in config.layers if getattr(layer, "attention", None) is not None]
    if not isinstance(config, Decoder.Config) or not all(hasattr(a, "rope") for a in attentions):
        raise ModelLoadError(
            f"torchtitan:{model} --flavor {flavor} is not a decoder language model with rotary attention "
            f"({type(config).__qualname__}), which is what the planner builds from torchtitan. Plan it from a "
            "model file whose build_model() returns it and whose example_inputs() makes its inputs."
        )
    windowed = [i for i, a in enumerate(attentions) if getattr(a, "sliding_window_size", None) is not None]
    if windowed:
        # gpt_oss: its attention rescales by learned per-head sinks (FlexAttention's out_transform) and its
        # even layers see a sliding window; the causal SDPA the planner sets has neither, so the planned and
        # trained model would not be the one named.
        raise ModelLoadError(
            f"torchtitan:{model} --flavor {flavor} has sliding-window attention (layers {windowed[:4]}, window "
            f"{attentions[windowed[0]].sliding_window_size}) with learned attention sinks, which need torchtitan's "
            "FlexAttention and its data loader's masks; the planner replaces attention by causal "
            "scaled_dot_product_attention, which has neither, so it refuses this model rather than plan a "
            "different one. Plan it from a model file whose build_model() keeps its attention and whose "
            "example_inputs() makes the inputs that attention needs."
        )
    out.mkdir(parents=True, exist_ok=True)
    settings = {**TITAN_SETTINGS, "rope_max_seq_len": int(seq)}
    text = _TITAN_TEMPLATE.format(
        spec=py_str(spec), spec_text=py_text(spec), model=py_str(model), model_text=py_text(model),
        flavor=py_str(flavor), flavor_text=py_text(flavor), settings=_py_dict(settings),
        settings_text=py_text(str(settings)), seq=int(seq), vocab=int(config.vocab_size),
    )
    path = out / SOURCE_FILE
    path.write_text(text)
    return path.resolve()
