"""Batches from a tokenized corpus as nanoGPT's prepare.py and Megatron-LM's preprocessing write it: one flat
binary file of token ids (uint16, or uint32 for vocabularies over 65,536), memory-mapped, read in samples of the
model's sequence length; or a tokenized Hugging Face `datasets` dataset saved with `save_to_disk` (where the
`datasets` package is installed), its token column packed end to end into the same stream of samples (the
documents concatenated, as torchtitan and Megatron-LM pack them).

The order is deterministic and the same for every layout: the corpus is cut into non-overlapping samples of
SEQ tokens, each epoch visits them in a permutation drawn from (seed, epoch), and global sample g (g = step x
global batch + micro-batch index x micro-batch size + row) is the (g mod samples)-th of epoch g // samples. A
data-parallel rank reads only its own micro-batches' samples, so no two ranks read the same sample in an epoch,
and the position is the step: a checkpoint records it with the file's identity, and a resumed run reads the
very next batch.
"""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import RunError

TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


class Samples:
    """The deterministic order of a stream's samples of `seq` tokens: subclasses say how many there are
    (`samples`) and read one (`sample`)."""

    seed: int
    seq: int
    samples: int
    _epoch: tuple[int, torch.Tensor] | None = None

    def sample(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of the samples in `epoch` (the last one is kept: consecutive steps share it)."""
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
            self._epoch = (epoch, torch.randperm(self.samples, generator=g))
        return self._epoch[1]

    def sample_indices(self, first: int, count: int) -> list[int]:
        """Indices into the corpus of global samples first .. first + count - 1."""
        out = []
        for g in range(first, first + count):
            out.append(int(self.order(g // self.samples)[g % self.samples]))
        return out

    def micro_batch(self, step: int, index: int, micro_batch_size: int, global_batch: int) -> tuple[torch.Tensor]:
        """Micro-batch `index` (over the global batch) of step `step`: (micro_batch_size, seq) token ids."""
        first = step * global_batch + index * micro_batch_size
        rows = [self.sample(i) for i in self.sample_indices(first, micro_batch_size)]
        return (torch.stack(rows).to(torch.long),)


class TokenFile(Samples):
    """A flat binary file of token ids, read as samples of `seq` tokens."""

    def __init__(self, path: Path, dtype: str, seq: int, seed: int) -> None:
        if dtype not in TOKEN_DTYPES:
            raise RunError(f"DATA_DTYPE must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}.")
        self.path, self.dtype, self.seq, self.seed = path, dtype, seq, seed
        try:
            with path.open("rb") as f:
                size = path.stat().st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            why = f"Cannot read the data file {path} ({e.strerror}): pass --data PATH of a token file."
            raise RunError(why) from None
        width = torch.tensor([], dtype=TOKEN_DTYPES[dtype]).element_size()
        if size % width:
            raise RunError(
                f"{path} holds {size} bytes, not a whole number of {dtype} token ids ({width} bytes each): it was "
                f"written with another dtype. Pass --data-dtype {'uint32' if width == 2 else 'uint16'}."
            )
        self.size = size
        if self._map is None:
            self.tokens = torch.empty(0, dtype=TOKEN_DTYPES[dtype])
        else:
            with warnings.catch_warnings():  # read only: the tensor is never written
                warnings.simplefilter("ignore", UserWarning)
                self.tokens = torch.frombuffer(self._map, dtype=TOKEN_DTYPES[dtype])
        self.samples = self.tokens.numel() // seq
        if self.samples == 0:
            raise RunError(
                f"{path} holds {self.tokens.numel()} tokens, fewer than one sample of {seq}: pass a larger corpus."
            )
        self._epoch: tuple[int, torch.Tensor] | None = None

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data, to refuse resuming on other data."""
        return {"kind": "token_file", "file": self.path.name, "bytes": self.size, "dtype": self.dtype, "seq": self.seq}

    def sample(self, index: int) -> torch.Tensor:
        return self.tokens[index * self.seq : (index + 1) * self.seq]


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset: state.json and dataset_info.json)."""
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


class SavedDataset(Samples):
    """A tokenized Hugging Face dataset saved with `save_to_disk`: its `column` (lists of token ids, one per
    document) packed end to end and read as samples of `seq` tokens. Arrow keeps it memory-mapped; only the
    documents a sample spans are read."""

    def __init__(self, path: Path, column: str, seq: int, seed: int) -> None:
        try:
            import datasets
        except ImportError:
            raise RunError(
                f"--data {path} is a Hugging Face dataset folder, and the `datasets` package is not installed here: "
                "pip install datasets, or pass a flat binary token file."
            ) from None
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises its own kinds for a folder it cannot read
            raise RunError(f"Cannot load the dataset {path} ({e}). Pass a folder written by save_to_disk.") from None
        if isinstance(data, datasets.DatasetDict):
            raise RunError(
                f"{path} holds a DatasetDict (splits {', '.join(data)}): pass one split's folder, e.g. {path}/train."
            )
        if column not in data.column_names:
            raise RunError(
                f"The dataset {path} has no column {column!r} (it has {', '.join(data.column_names)}). Tokenize it "
                f"first (dataset.map with your tokenizer into {column!r}), or name the token column with "
                "--data-column."
            )
        import pyarrow.compute as pc

        table = data.with_format("arrow")[:]
        lengths = pc.list_value_length(table[column]).to_numpy(zero_copy_only=False)
        self.data, self.column, self.path, self.seq, self.seed = data, column, path, seq, seed
        self.ends = torch.from_numpy(lengths.astype("int64")).cumsum(0)
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.tokens_total = total
        self.samples = total // seq
        self.fingerprint = str(getattr(data, "_fingerprint", ""))
        if self.samples == 0:
            raise RunError(f"The dataset {path} holds {total} tokens, fewer than one sample of {seq}.")

    def sample(self, index: int) -> torch.Tensor:
        start, stop = index * self.seq, (index + 1) * self.seq
        first = int(torch.searchsorted(self.ends, start, right=True))
        last = int(torch.searchsorted(self.ends, stop - 1, right=True))
        rows = self.data[first : last + 1][self.column]
        flat = torch.tensor([t for row in rows for t in row], dtype=torch.long)
        offset = start - (int(self.ends[first - 1]) if first else 0)
        return flat[offset : offset + self.seq]

    def identity(self) -> dict[str, Any]:
        return {
            "kind": "hf_dataset", "file": self.path.name, "bytes": self.tokens_total, "dtype": self.column,
            "seq": self.seq, "fingerprint": self.fingerprint,
        }


def check_same_data(saved: dict[str, Any] | None, current: dict[str, Any], path: str) -> None:
    """Refuse to resume a run of one corpus on another (or synthetic batches on a corpus): the position saved
    would point into other data."""
    saved = saved or {"kind": "batches"}
    keys = ("kind", "file", "bytes", "dtype", "seq", "fingerprint")
    if any(saved.get(k) != current.get(k) for k in keys):

        def describe(d: dict[str, Any]) -> str:
            if d.get("kind") == "hf_dataset":
                return f"the dataset {d['file']} ({d['bytes']:,} tokens of column {d['dtype']}, samples of {d['seq']})"
            if d.get("kind") != "token_file":
                return "the model file's batches (get_batch or synthetic)"
            return f"{d['file']} ({d['bytes']:,} bytes of {d['dtype']}, samples of {d['seq']} tokens)"

        raise RunError(
            f"{path} was saved by a run reading {describe(saved)}; this run reads {describe(current)}. Its data "
            "position would point into other data: resume with the same --data, or start a new run (without "
            "--resume) from its weights."
        )
