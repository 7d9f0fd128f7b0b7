"""Training and validation batches: the text corpus embedded in the package (``examples/data/*.txt``, one token
per byte) or Megatron indexed datasets (``--data-path PREFIX``: ``PREFIX.bin`` / ``PREFIX.idx``, any tokenizer).

The data is split by ``--split`` (Megatron's "train,valid,test" weights; whole documents for indexed data) into
token streams. Batch contents depend only on ``(seed, iteration)``, not on how many steps ran before: a run
resumed from a checkpoint at iteration N sees exactly the batches an uninterrupted run sees at N+1, N+2, ...

Each global batch is ``global_batch_size`` windows of ``seq_length + 1`` bytes at pseudo-random offsets;
data-parallel rank r takes the contiguous block r of it and cuts it into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

VOCAB_SIZE = 256
DATA_DIR = Path(__file__).resolve().parent / "data"


def corpus_files(path: Optional[str] = None) -> list[Path]:
    """The corpus: ``path`` (a file or a folder of *.txt) or the embedded ``examples/data``; sorted names."""
    root = Path(path) if path else DATA_DIR
    files = [root] if root.is_file() else sorted(root.glob("*.txt")) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"no text corpus at {root} (expected *.txt files); pass --fp4-corpus PATH to a text file or folder"
        )
    return files


def load_tokens(path: Optional[str] = None) -> torch.Tensor:
    """All corpus bytes as one int64 tensor (files concatenated in name order)."""
    data = b"".join(f.read_bytes() for f in corpus_files(path))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split_weights(split: str) -> list[float]:
    """Megatron's ``--split`` ("969,30,1", "99/1/0", "1"): normalised [train, valid, test] weights."""
    parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected non-negative train,valid,test weights with a positive sum")
    return [p / sum(parts) for p in parts]


def split_stream(tokens: torch.Tensor, split: str) -> list[torch.Tensor]:
    """[train, valid, test] token streams of one stream, cut by the split weights."""
    w = split_weights(split)
    ends = [round(tokens.numel() * sum(w[:i + 1])) for i in range(3)]
    return [tokens[a:b] for a, b in zip([0, *ends[:2]], ends)]


def load_indexed(prefixes: Sequence[str], split: str) -> list[torch.Tensor]:
    """[train, valid, test] int64 token streams of Megatron indexed datasets: whole documents are assigned to
    the splits in order by the split weights (as Megatron's GPTDataset does), each split's concatenated."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

    w = split_weights(split)
    streams: list[list] = [[], [], []]
    for prefix in prefixes:
        missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"--data-path {prefix}: no indexed dataset there (missing {', '.join(missing)}); "
                                    "build one with megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder or "
                                    "`python -m examples.megatron_preprocess`")
        ds = IndexedDataset(prefix)
        n = len(ds)
        bounds = [0, *(round(n * sum(w[:i + 1])) for i in range(3))]
        for s_, (a, b) in enumerate(zip(bounds, bounds[1:])):
            streams[s_] += [np.asarray(ds[i]) for i in range(a, b)]
    return [torch.from_numpy(np.concatenate(docs).astype(np.int64)) if docs else torch.zeros(0, dtype=torch.int64)
            for docs in streams]


@dataclass(frozen=True)
class BatchPlan:
    """Shapes of the batches one rank consumes per step."""

    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    dp_rank: int
    dp_size: int
    seed: int

    def __post_init__(self):
        per_step = self.micro_batch_size * self.dp_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} must be a multiple of --micro-batch-size x "
                f"data-parallel size = {self.micro_batch_size} x {self.dp_size}"
            )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)


def window_offsets(num_tokens: int, plan: BatchPlan, iteration: int) -> torch.Tensor:
    """Start offsets of the ``global_batch_size`` windows of step ``iteration`` (same on every rank)."""
    span = num_tokens - plan.seq_length - 1
    if span <= 0:
        raise ValueError(f"corpus of {num_tokens} bytes is shorter than --seq-length {plan.seq_length} + 1")
    g = torch.Generator().manual_seed(plan.seed * 1_000_003 + iteration)
    return torch.randint(0, span, (plan.global_batch_size,), generator=g)


def microbatches(tokens: torch.Tensor, plan: BatchPlan, iteration: int, device) -> Iterator[dict]:
    """This rank's micro-batches of step ``iteration``: dicts of tokens, labels, position_ids [b, s].

    On a GPU the step's windows are gathered on the host, pinned, and copied once without waiting: a copy from
    pageable memory (or a tensor made from a Python number) synchronises with the GPU, and one such wait per
    micro-batch would leave the GPU idle while the host launches the next forward (Megatron's own loaders pin
    and copy with non_blocking for the same reason).
    """
    offsets = window_offsets(tokens.numel(), plan, iteration)
    per_rank = plan.global_batch_size // plan.dp_size
    mine = offsets[plan.dp_rank * per_rank:(plan.dp_rank + 1) * per_rank]
    windows = tokens[mine.unsqueeze(1) + torch.arange(plan.seq_length + 1)]  # [per_rank, seq + 1]
    positions = torch.arange(plan.seq_length).unsqueeze(0).expand(plan.micro_batch_size, -1)
    if torch.device(device).type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
        positions = positions.contiguous().pin_memory().to(device, non_blocking=True)
    else:
        windows, positions = windows.to(device), positions.to(device)
    for m in range(plan.num_microbatches):
        w = windows[m * plan.micro_batch_size:(m + 1) * plan.micro_batch_size]
        yield {"tokens": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous(), "position_ids": positions}


def decode(ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
