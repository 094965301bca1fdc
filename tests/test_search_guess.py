"""The search's first guess (Search.guess, handed to `on_guess` before any candidate is solved, for the
plan-time check to work on while the search runs): one call, before any best; a plan that fits memory; and
the search's result the same with or without it."""

from __future__ import annotations

from planner.cost.terms import rank_capacity
from planner.hardware.load import load_cluster
from planner.pipeline import PlanRequest, analyse
from planner.search.blocks import even_partition
from planner.search.search import search
from planner.search.space import Pins


def _mlp() -> tuple:
    request = PlanRequest(
        model_path="sample_models/mlp.py", model_args={"layers": 12, "width": 4096, "ffn_cycle": 5},
        gpu="a100-sxm-80gb", nodes=1, global_batch_size=256,
    )
    return analyse(request, cache=False), load_cluster("a100-sxm-80gb", 1)


def _figures(result) -> list[tuple]:
    return [(e.cand, e.partition, e.recompute, e.reported) for e in result.ranked]


def test_the_guess_comes_once_before_any_best_fits_and_changes_nothing():
    graph, cluster = _mlp()
    events: list[tuple[str, object]] = []
    with_guess = search(
        graph, cluster, 256, Pins(), on_best=lambda ev: events.append(("best", ev)),
        on_guess=lambda ev: events.append(("guess", ev)), block_recompute=True,
    )
    kinds = [k for k, _ in events]
    assert kinds[0] == "guess" and kinds.count("guess") == 1 and kinds.count("best") >= 1
    guess = events[0][1]
    assert max(guess.rank_memory.values()) <= rank_capacity(cluster, guess.cand)
    assert sorted(u for stage in guess.partition for u in stage) == list(range(len(graph.units)))
    assert events[-1][1] is with_guess.best
    assert _figures(with_guess) == _figures(search(graph, cluster, 256, Pins(), block_recompute=True))


def test_a_pinned_pipeline_guesses_its_blocks_spread_evenly():
    graph, cluster = _mlp()
    guesses = []
    search(graph, cluster, 256, Pins(pp=4, tp=1), on_guess=guesses.append)
    (guess,) = guesses
    assert guess.cand.pp == 4
    assert guess.partition == even_partition(graph, guess.cand.stages)  # Megatron-LM's layout
    sizes = [len(stage) for stage in guess.partition]
    assert len(sizes) == guess.cand.stages >= 4 and max(sizes) - min(sizes) <= 2


def test_one_stage_candidates_near_the_least_bound_are_solved_first_while_they_can_enter_the_top_k(monkeypatch):
    """GPT-3 13B on 8 H100s: the one-stage candidates near the least bound are solved before the queue's order,
    while their bounds are below the k-th plan's figure, so that the pipelined candidates meet a cutoff from
    their first node and the best one-stage plan is the search's best before any pipelined candidate is solved
    (where it is the final plan, as for most models, the plan-time check gets it at once); the ranking is that
    of the search in bound order."""
    from planner.search import search as search_module

    request = PlanRequest(
        model_path="sample_models/gpt.py", model_args={"preset": "gpt3-13b"}, gpu="h100-sxm-80gb", nodes=1,
        global_batch_size=512,
    )
    graph, cluster = analyse(request, cache=False), load_cluster("h100-sxm-80gb", 1)
    s = search_module.Search(graph, cluster, 512, Pins())
    s.bound_all()
    queued = len(s.heap)
    least = min(s.heap).bound
    s.one_stage_first()
    cutoff = s.cutoff_now()
    assert cutoff is not None and len(s.ranked) == s.top_k + 1
    assert s.solved == queued - len(s.heap) > s.top_k + 1
    assert all(e.cand.stages == 1 and e.objective >= least for e in s.ranked)
    # every one-stage candidate left near the least bound is one that cannot enter the top k
    near = [it for it in s.heap if it.cand.stages == 1 and it.bound <= least * search_module.ONE_STAGE_NEAR]
    assert near and all(it.bound >= cutoff for it in near)
    one_stage = search(graph, cluster, 512, Pins(pp=1)).best
    assert one_stage.cand.stages == 1 and s.ranked[0].cand == one_stage.cand
    assert s.ranked[0].reported == one_stage.reported
    first = search(graph, cluster, 512, Pins())
    monkeypatch.setattr(search_module.Search, "one_stage_first", lambda self: None)
    assert _figures(first) == _figures(search(graph, cluster, 512, Pins()))
