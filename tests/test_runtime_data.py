"""The token-file loader: deterministic samples, data-parallel ranks that never share a sample within an epoch,
its position (the step) and its refusals."""

from __future__ import annotations

import array

import pytest
import torch

from planner.runtime.data import TokenFile, check_same_data
from planner.runtime.errors import RunError

SEQ = 8


def corpus(tmp_path, tokens: int, typecode: str = "H", name: str = "train.bin"):
    path = tmp_path / name
    path.write_bytes(array.array(typecode, range(tokens)).tobytes())  # token i = i: a sample names its start
    return path


def test_samples_are_whole_windows_read_as_long(tmp_path):
    data = TokenFile(corpus(tmp_path, 10 * SEQ + 3), "uint16", SEQ, seed=0)
    assert data.samples == 10
    (batch,) = data.micro_batch(0, 0, micro_batch_size=2, global_batch=4)
    assert batch.dtype == torch.long and batch.shape == (2, SEQ)
    for row in batch.tolist():
        assert row[0] % SEQ == 0 and row == list(range(row[0], row[0] + SEQ))


def test_data_parallel_ranks_never_read_the_same_sample_in_an_epoch(tmp_path):
    data = TokenFile(corpus(tmp_path, 48 * SEQ), "uint16", SEQ, seed=3)
    dp, n, mbs = 4, 2, 3
    global_batch = dp * n * mbs  # 24: two steps make one epoch of 48 samples
    for epoch_steps in ((0, 1), (2, 3)):
        seen: dict[int, int] = {}
        for step in epoch_steps:
            for rank in range(dp):
                for i in range(rank * n, (rank + 1) * n):
                    for row in data.micro_batch(step, i, mbs, global_batch)[0].tolist():
                        assert row[0] not in seen or seen[row[0]] == rank, (step, rank, row[0])
                        seen[row[0]] = rank
        assert len(seen) == 48  # every sample once per epoch
    # The next epoch visits them in another order.
    assert data.sample_indices(0, 48) != data.sample_indices(48, 48)


def test_the_order_depends_only_on_seed_and_position(tmp_path):
    path = corpus(tmp_path, 30 * SEQ)
    a, b = TokenFile(path, "uint16", SEQ, seed=1), TokenFile(path, "uint16", SEQ, seed=1)
    b.micro_batch(5, 1, 2, 8)  # b has read elsewhere first: a resumed run starts at any step
    assert torch.equal(a.micro_batch(3, 2, 2, 8)[0], b.micro_batch(3, 2, 2, 8)[0])
    c = TokenFile(path, "uint16", SEQ, seed=2)
    assert not torch.equal(a.micro_batch(3, 2, 2, 8)[0], c.micro_batch(3, 2, 2, 8)[0])


def test_uint32_tokens_and_bad_files(tmp_path):
    data = TokenFile(corpus(tmp_path, 4 * SEQ, "I", "big.bin"), "uint32", SEQ, seed=0)
    assert data.samples == 4 and data.micro_batch(0, 0, 1, 1)[0].max() < 4 * SEQ
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 7)
    with pytest.raises(RunError, match="not a whole number of uint16"):
        TokenFile(odd, "uint16", SEQ, seed=0)
    with pytest.raises(RunError, match="fewer than one sample"):
        TokenFile(corpus(tmp_path, 3, name="short.bin"), "uint16", SEQ, seed=0)
    with pytest.raises(RunError, match="Cannot read the data file"):
        TokenFile(tmp_path / "missing.bin", "uint16", SEQ, seed=0)


def test_resuming_on_other_data_is_refused(tmp_path):
    a = TokenFile(corpus(tmp_path, 30 * SEQ), "uint16", SEQ, seed=0).identity()
    check_same_data({**a, "step": 4}, a, "ckpt")
    other = TokenFile(corpus(tmp_path, 31 * SEQ, name="other.bin"), "uint16", SEQ, seed=0).identity()
    with pytest.raises(RunError, match="train.bin .* this run reads other.bin"):
        check_same_data(a, other, "ckpt")
    with pytest.raises(RunError, match="model file's batches"):
        check_same_data({"kind": "batches", "step": 2}, a, "ckpt")
    check_same_data({"kind": "batches", "step": 2}, {"kind": "batches"}, "ckpt")
