"""A tokenized Hugging Face dataset (save_to_disk) as the corpus: its documents packed end to end into samples of
the model's sequence length, in the same deterministic, rank-disjoint order as a token file, with an identity a
resumed run must match."""

from __future__ import annotations

import random

import pytest
import torch

from planner.runtime.data import SavedDataset, TokenFile, check_same_data, is_saved_dataset
from planner.runtime.errors import RunError

datasets = pytest.importorskip("datasets")

SEQ = 8


def _documents(n: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randrange(1, 23))] for _ in range(n)]


@pytest.fixture
def saved(tmp_path):
    docs = _documents()
    folder = tmp_path / "corpus"
    datasets.Dataset.from_dict({"input_ids": docs, "text": ["x"] * len(docs)}).save_to_disk(str(folder))
    return folder, docs


def test_documents_are_packed_into_the_same_samples_as_the_flat_file(saved, tmp_path):
    folder, docs = saved
    assert is_saved_dataset(folder) and not is_saved_dataset(tmp_path)
    stream = [t for d in docs for t in d]
    flat = tmp_path / "corpus.bin"
    flat.write_bytes(torch.tensor(stream, dtype=torch.int32).to(torch.uint16).numpy().tobytes())
    ds, tf = SavedDataset(folder, "input_ids", SEQ, seed=3), TokenFile(flat, "uint16", SEQ, seed=3)
    assert ds.samples == tf.samples == len(stream) // SEQ
    for i in range(ds.samples):
        assert ds.sample(i).tolist() == stream[i * SEQ : (i + 1) * SEQ]
    for step in range(3):
        for index in range(4):
            assert torch.equal(ds.micro_batch(step, index, 2, 8)[0], tf.micro_batch(step, index, 2, 8)[0])


def test_data_parallel_ranks_read_disjoint_samples_in_an_epoch(saved):
    folder, _ = saved
    ds = SavedDataset(folder, "input_ids", SEQ, seed=0)
    seen = [ds.sample_indices(step * 4 + index, 1)[0] for step in range(ds.samples // 4) for index in range(4)]
    assert len(seen) == len(set(seen))


def test_identity_refuses_other_data_and_bad_columns_are_named(saved, tmp_path):
    folder, docs = saved
    ds = SavedDataset(folder, "input_ids", SEQ, seed=0)
    check_same_data(ds.identity(), ds.identity(), "ckpt")
    other = tmp_path / "other"
    datasets.Dataset.from_dict({"input_ids": _documents(seed=1)}).save_to_disk(str(other))
    with pytest.raises(RunError, match="was saved by a run reading the dataset corpus"):
        check_same_data(ds.identity(), SavedDataset(other, "input_ids", SEQ, seed=0).identity(), "ckpt")
    with pytest.raises(RunError, match="no column 'tokens'.*--data-column"):
        SavedDataset(folder, "tokens", SEQ, seed=0)
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": docs})}).save_to_disk(str(splits))
    assert not is_saved_dataset(splits)  # a DatasetDict's folder: one split's folder is the dataset
    assert is_saved_dataset(splits / "train")
