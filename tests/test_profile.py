"""Profiling distinct units on the CPU: times, one run per distinct unit, the cache, and the search's use."""

import json
import math
import re
from pathlib import Path

import pytest

from planner.measure import profile as prof
from planner.measure.profile import (
    ProfileResult,
    local_device_name,
    profile_cache_dir,
    profile_key,
    profile_model,
    to_cost_profile,
)
from planner.model.analysis import analyse_model
from planner.model.load import load_model_file

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "sample_models" / "gpt.py"
TINY = ROOT / "tests" / "fixtures" / "tiny_gpt.py"
FAST = {"repeats": 2, "warmup": 1}


def _profile_counting(path: Path, cache_dir: Path, **kwargs):
    """Profile with measure_unit wrapped: returns (result, graph, [(unit modules, forward calls)])."""
    loaded = load_model_file(path)
    calls: list[tuple[list[str], int]] = []
    real = prof.measure_unit

    def counting(fn, args, device, repeats, warmup):
        n = [0]

        def counted(*a):
            n[0] += 1
            return fn(*a)

        out = real(counted, args, device, repeats, warmup)
        calls.append((sorted({re.split(r"[._]", name)[0] for name, _ in fn.named_modules() if name}), n[0]))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prof, "measure_unit", counting)
        result = profile_model(loaded, cache_dir=cache_dir, **FAST, **kwargs)
    return result, analyse_model(loaded), calls


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    return _profile_counting(GPT, tmp_path_factory.mktemp("gpt-cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tiny-cache")
    return (*_profile_counting(TINY, cache, micro_batch_sizes=(1, 2)), cache)


@pytest.mark.parametrize("which", ["gpt", "tiny"])
def test_every_distinct_unit_measured_once_with_positive_times(which, request):
    result, graph, calls = request.getfixturevalue(which)[:3]
    sigs = {u.signature for u in graph.units}
    mbs = result.micro_batch_sizes
    assert not result.from_cache and result.dtype == "fp32" and result.device == "cpu"
    # one entry, and one measurement, per (distinct signature, micro-batch size): repeated blocks once
    assert len(result.units) == len(calls) == len(sigs) * len(mbs)
    assert {(u.signature, u.micro_batch_size) for u in result.units} == {(s, m) for s in sigs for m in mbs}
    for _, forwards in calls:
        assert forwards == FAST["repeats"] + FAST["warmup"]
    # the entries name every unit of the graph, each under its own signature
    for u in result.units:
        assert u.fwd_s > 0 and u.bwd_s > 0
        assert len(u.fwd_samples_s) == len(u.bwd_samples_s) == FAST["repeats"]
        assert u.peak_memory_bytes is None  # not tracked on CPU
        assert all(graph.unit(name).signature == u.signature for name in u.units)
    blocks = [u.name for u in graph.units if u.kind == "block"]
    block_entries = [u for u in result.units if u.units == blocks]
    assert len(blocks) >= 2 and len(block_entries) == len(mbs)
    # the block unit was run once per micro-batch size: one call whose submodule holds blocks modules
    assert sum(1 for mods, _ in calls if mods == ["blocks"]) == len(mbs)


def test_result_round_trips_through_json(gpt):
    result = gpt[0]
    again = ProfileResult.model_validate_json(result.model_dump_json())
    assert again == result
    json.loads(result.model_dump_json())  # plain JSON


def test_cache_hit_runs_nothing(tiny, monkeypatch):
    result, _, _, cache = tiny
    path = cache / f"{result.key}.json"
    assert path.is_file()

    def fail(*args, **kwargs):
        raise AssertionError("measured again despite a cache hit")

    monkeypatch.setattr(prof, "measure_unit", fail)
    again = profile_model(load_model_file(TINY), micro_batch_sizes=(2, 1), cache_dir=cache, **FAST)
    assert again.from_cache
    assert again.model_copy(update={"from_cache": False}) == result


def test_unreadable_cache_file_is_measured_again(tmp_path):
    loaded = load_model_file(TINY, {"layers": 1})
    key = profile_key(loaded.source, local_device_name("cpu"), "fp32", [1], **FAST)
    (tmp_path / f"{key}.json").write_text("{not json")
    result = profile_model(loaded, cache_dir=tmp_path, **FAST)
    assert not result.from_cache and result.key == key
    assert ProfileResult.model_validate_json((tmp_path / f"{key}.json").read_text()).key == key


def test_cache_key_depends_on_its_inputs():
    name = local_device_name("cpu")
    base = load_model_file(TINY).source
    key = profile_key(base, name, "fp32", [1], **FAST)
    assert key == profile_key(load_model_file(TINY).source, name, "fp32", [1], **FAST)
    assert key != profile_key(load_model_file(TINY, {"layers": 3}).source, name, "fp32", [1], **FAST)
    assert key != profile_key(base, name, "bf16", [1], **FAST)
    assert key != profile_key(base, name, "fp32", [1, 2], **FAST)
    assert key != profile_key(base, "NVIDIA H100 80GB HBM3", "fp32", [1], **FAST)


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv(prof.CACHE_DIR_ENV, raising=False)
    assert profile_cache_dir() == Path.home() / ".cache" / "planner" / "profiles"
    monkeypatch.setenv(prof.CACHE_DIR_ENV, str(tmp_path))
    assert profile_cache_dir() == tmp_path / "profiles"
    assert profile_cache_dir(tmp_path / "x") == tmp_path / "x"


def test_cost_profile_feeds_the_search(tiny):
    from planner.pipeline import PlanRequest, plan_model

    result, graph, _, _ = tiny
    profile = to_cost_profile(result, graph)
    assert profile.device == result.device_name
    assert set(profile.times) == {(u.signature, m, 1) for u in graph.units for m in (1, 2)}
    assert all(t.source == "measured" and t.fwd > 0 and t.bwd > 0 for t in profile.times.values())
    assert profile.efficiency_scale > 0 and math.isfinite(profile.efficiency_scale)
    request = PlanRequest(
        model_path=str(TINY), gpu="cpu", gpus_per_node=2, global_batch_size=4, pins={"tp": 1, "micro_batch_size": 2}
    )
    plan, _, _ = plan_model(request, graph=graph, profile=profile)
    assert plan.stages and all(s.source == "measured" for s in plan.stages)
    assert plan.predicted.source == "measured"


def test_bad_arguments_raise_config_error():
    from planner.errors import ConfigError

    loaded = load_model_file(TINY)
    with pytest.raises(ConfigError, match="device"):
        profile_model(loaded, device="tpu")
    with pytest.raises(ConfigError, match="positive"):
        profile_model(loaded, micro_batch_sizes=(0,))
