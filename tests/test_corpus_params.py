"""Every corpus model's parameters are counted, each in the unit that runs it (issue 27: PyTorch's own
transformer modules were one opaque call whose weights the memory figures missed): the model's total is
sum(p.numel()) over its parameters, and the units' counts add up to it (a tied weight at most once per name).
CI: the authored models and the corpus; the zoo under `-m corpus`."""

from __future__ import annotations

import pytest
from e2e.hf_plans import AUTHORED, CORPUS, ZOO

pytest.importorskip("transformers")

# Weights read by a unit other than the one whose module holds them (each stage then keeps a copy): whisper's
# logits are `x @ token_embedding.weight.T` in the decoder's last unit.
READ_TWICE = {"whisper_style": "decoder.token_embedding.weight"}

CASES = [
    *(pytest.param(n, id=n) for n in {**AUTHORED, **CORPUS}),
    *(pytest.param(n, id=n, marks=pytest.mark.corpus) for n in ZOO),
]


def _model_args(args: list[str]) -> dict:
    import ast

    pairs = [a.split("=", 1) for a in args[1::2]]
    return {k: ast.literal_eval(v) for k, v in pairs}


@pytest.mark.parametrize("name", CASES)
def test_counted_parameters_are_the_models(name):
    from planner.model.analysis import analyse_model
    from planner.model.load import build_meta_model, load_model_file

    path, args = {**AUTHORED, **CORPUS, **ZOO}[name]
    loaded = load_model_file(path, model_args=_model_args(args), dtype="fp32")
    graph = analyse_model(loaded)
    model = build_meta_model(loaded)
    total = sum(p.numel() for p in model.parameters())
    assert graph.total_params == total
    # every parameter in a unit; one held under several names (tied embeddings) may be counted by each unit
    # that holds it (each pipeline stage then keeps a copy), never more
    names: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = names.get(id(p), 0) + 1
    tied = sum((n - 1) * p.numel() for p in model.parameters() if (n := names[id(p)]) > 1)
    if name in READ_TWICE:
        tied += model.get_parameter(READ_TWICE[name]).numel()
    counted = sum(u.params for u in graph.units)
    assert total <= counted <= total + tied, (total, counted, tied)
    assert all(isinstance(u.params, int) for u in graph.units)
