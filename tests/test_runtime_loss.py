"""planner.runtime.loss: the default loss finds `loss` or `logits` in structured outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from planner.runtime.loss import default_loss, logits_of


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_token_logits_get_next_token_cross_entropy_in_every_container():
    tokens = torch.randint(0, 7, (2, 5))
    logits = torch.randn(2, 5, 7)
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    for output in (logits, {"logits": logits}, Output(logits), (logits, torch.zeros(1))):
        torch.testing.assert_close(default_loss(output, tokens), want)


def test_the_outputs_own_loss_wins():
    own = torch.tensor(3.0)
    assert default_loss(Output(torch.randn(2, 5, 7), loss=own), torch.zeros(2, 5, dtype=torch.long)).item() == 3.0
    assert default_loss({"loss": own, "logits": torch.ones(2)}, torch.zeros(2)).item() == 3.0


def test_other_outputs_are_averaged():
    x = torch.randn(4, 3)
    logits = torch.randn(4, 5)  # classification logits: not [b, s, vocab] over the tokens
    torch.testing.assert_close(default_loss(Output(logits), x), logits.mean())
    torch.testing.assert_close(default_loss(logits, torch.zeros(4, 9, dtype=torch.long)), logits.mean())


def test_a_structure_without_logits_asks_for_a_loss_fn():
    with pytest.raises(TypeError, match="define loss_fn"):
        logits_of({"hidden": torch.zeros(1)})
