"""Building on meta runs no initialiser on meta tensors (nothing to write; they import torch._dynamo), keeps
their shape checks, leaves real tensors' initialisation alone, and restores torch.nn.init afterwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.runtime.model import INITIALISERS, no_init_on_meta


def test_initialisers_skip_meta_tensors_only():
    before = {n: getattr(nn.init, n) for n in INITIALISERS}
    calls = []
    with no_init_on_meta():
        with torch.device("meta"):
            lin = nn.Linear(8, 4)
        assert lin.weight.is_meta
        assert nn.init.normal_(lin.weight) is lin.weight
        real = torch.zeros(3, 3)
        nn.init.ones_(real)
        torch.testing.assert_close(real, torch.ones(3, 3))  # a real tensor is initialised as usual
        with pytest.raises(ValueError, match="fewer than 2 dimensions"):
            nn.init.kaiming_uniform_(torch.empty(4, device="meta"))  # the check training would hit
        calls.append(True)
    assert calls and {n: getattr(nn.init, n) for n in INITIALISERS} == before


def test_restored_after_an_error():
    before = nn.init.normal_
    with pytest.raises(RuntimeError), no_init_on_meta():
        raise RuntimeError("user code failed")
    assert nn.init.normal_ is before


def test_meta_build_skips_reset_work(tmp_path):
    """build_meta_model builds the same module tree (names, shapes, dtypes) without running initialisers."""
    from planner.model.load import build_meta_model, load_model_file

    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nfrom torch import nn\nSEEN = []\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(4, 4)\n"
        "        self.e = nn.Embedding(10, 4)\n        self.n = nn.LayerNorm(4)\n"
        "        SEEN.append(nn.init.normal_(torch.empty(2, device='meta')).is_meta)\n"
        "    def forward(self, x):\n        return self.n(self.a(self.e(x)))\n"
        "def build_model(**_):\n    return M()\n"
        "def example_inputs(b, **_):\n    return (torch.zeros(b, 3, dtype=torch.long),)\n"
    )
    loaded = load_model_file(path, dtype="bf16")
    model = build_meta_model(loaded)
    assert loaded.module.SEEN == [True]
    assert {n: (tuple(p.shape), p.dtype, p.is_meta) for n, p in model.named_parameters()} == {
        "a.weight": ((4, 4), torch.bfloat16, True),
        "a.bias": ((4,), torch.bfloat16, True),
        "e.weight": ((10, 4), torch.bfloat16, True),
        "n.weight": ((4,), torch.bfloat16, True),
        "n.bias": ((4,), torch.bfloat16, True),
    }
