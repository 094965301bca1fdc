"""Bounded search inputs (divisors by factorisation, a batch of 10**12, caps with clear errors) and the
inter-node costing of pipeline hops when dp x tp is smaller than a node (issue 13, points 2 and 9)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.cost.model import Candidate, p2p_link, p2p_time
from planner.errors import ConfigError, InfeasibleError
from planner.hardware.load import load_cluster
from planner.search import space
from planner.search.space import Pins, check_bounds, divisors, enumerate_space, prime_factors
from tests.synthetic import make_graph, make_unit

ROOT = Path(__file__).resolve().parents[1]


@given(st.integers(min_value=1, max_value=5000))
def test_divisors_match_the_definition(n):
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize(
    ("n", "factors"),
    [
        (2**40, {2: 40}),  # a big prime power: 41 divisors; a scan to n would take hours
        (3**25, {3: 25}),
        (10**12, {2: 12, 5: 12}),
        (999_999_999_989, {999_999_999_989: 1}),  # the largest prime below 10**12
        (999_983 * 999_979, {999_979: 1, 999_983: 1}),  # two primes above the trial-division range
        (1, {}),
    ],
)
def test_prime_factors(n, factors):
    assert prime_factors(n) == factors
    expected = 1
    for e in factors.values():
        expected *= e + 1
    assert len(divisors(n)) == expected


def test_bounds_are_clear_errors():
    with pytest.raises(ConfigError, match="global-batch-size .* above the planner's limit"):
        check_bounds(8, space.MAX_GLOBAL_BATCH + 1)
    with pytest.raises(ConfigError, match="GPUs, above the planner's limit"):
        check_bounds(space.MAX_WORLD_SIZE * 2, 8)
    check_bounds(space.MAX_WORLD_SIZE, space.MAX_GLOBAL_BATCH)


def _graph(n: int = 8):
    return make_graph([make_unit(f"b{i}", "blk", 10**6, 1e9, 10**6, 10**5) for i in range(n)])


def test_too_many_candidates_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(space, "MAX_CANDIDATES", 10)
    with pytest.raises(ConfigError, match="more than 10 candidates.*Pin some dimensions"):
        enumerate_space(_graph(), load_cluster("a100-sxm4-80gb", 2), 1024, Pins())


def test_micro_batches_per_replica_are_capped():
    result = enumerate_space(_graph(), load_cluster("a100-sxm4-80gb", 1), 10**6, Pins(dp=8))
    assert result.candidates and all(c.num_micro_batches <= space.MAX_MICRO_BATCHES for c in result.candidates)
    assert any("micro-batches per replica" in why for _, why in result.rejected)


def test_batch_of_a_trillion_answers(tmp_path):
    """Issue 13 point 2: this used to enumerate 10**12 divisor candidates; now it ends with a verdict."""
    proc = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "plan", str(ROOT / "tests" / "fixtures" / "tiny_gpt.py"),
         "--gpu", "cpu", "--gpus-per-node", "4", "--global-batch-size", str(10**12),
         "--out", str(tmp_path / "o"), "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode in (0, 2), proc.stderr
    assert "Traceback" not in proc.stderr
    if proc.returncode == 2:
        assert proc.stderr.startswith("Error: ") and "does not fit" in proc.stderr


def test_pipeline_hop_across_nodes_uses_the_inter_node_link():
    """dp x tp = 2 on 8-GPU nodes with pp 8: pp ranks 3 -> 4 sit on different nodes."""
    cluster = load_cluster("a100-sxm4-80gb", 2)
    topo = cluster.topology
    eff = cluster.gpu.efficiency.network
    cand = Candidate(1, 2, 8, 1, 1, 16, "1f1b", 0, False)
    assert p2p_link(cand, cluster) == (topo.inter_node_bandwidth * eff, topo.inter_node_latency)
    # The same layout inside one node stays on the intra-node link.
    one_node = Candidate(1, 2, 4, 1, 1, 16, "1f1b", 0, False)
    assert p2p_link(one_node, cluster) == (topo.intra_node_bandwidth * eff, topo.intra_node_latency)
    # A vanishing inter-node bandwidth now shows in the hop's time (it used to leave it unchanged).
    slow = cluster.model_copy(
        update={"topology": topo.model_copy(update={"inter_node_bandwidth_gbps": 1e-3})}
    )
    assert p2p_time(1e6, cand, slow) > 100 * p2p_time(1e6, cand, cluster)
    assert p2p_time(1e6, one_node, slow) == p2p_time(1e6, one_node, cluster)


def test_contradicting_pins_name_the_pins():
    """Issue 13 point 8: pins that exclude each other used to report 'constraints: none'."""
    with pytest.raises(InfeasibleError, match="--virtual-stages 3.*zero-bubble.*contradict") as e:
        enumerate_space(_graph(), load_cluster("a100-sxm4-80gb", 1), 64,
                        Pins(pp=2, virtual_stages=3, schedule="zero-bubble"))
    assert "none" not in str(e.value).split("leave")[0]


def test_nothing_fits_names_real_reasons_before_dominated_candidates(monkeypatch):
    """A candidate "dominated by" another is not why nothing fits (the other one was rejected for its own
    reason): an empty space lists the real reasons first."""
    from collections import Counter
    from types import SimpleNamespace

    import planner.search.search as search_module

    rejected = Counter({
        ("dp=2 zero=0", "dominated by ZeRO-1: same compute, less memory"): 1,
        ("gpipe pp=2", "dominated by 1F1B: the same iteration time"): 1,
        ("tp=2 with sp", "only torch.fx with meta values could trace the model"): 3,
    })
    monkeypatch.setattr(search_module, "enumerate_space", lambda *a: SimpleNamespace(candidates=[], rejected=rejected))
    with pytest.raises(InfeasibleError) as e:
        search_module.search(_graph(), load_cluster("a100-sxm4-80gb", 1), 64)
    message = str(e.value)
    assert message.index("tp=2 with sp") < message.index("dp=2 zero=0") < message.index("gpipe pp=2")
