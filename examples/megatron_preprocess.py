"""Text -> a Megatron indexed dataset of byte tokens (``PREFIX.bin`` + ``PREFIX.idx``), for ``--data-path``.

    python -m examples.megatron_preprocess --input corpus.txt [more.txt ...] --output-prefix data/corpus

One document per paragraph (blank-line separated), each a list of its UTF-8 bytes followed by the end-of-document
token 255 (the vocabulary is 256, as for the embedded corpus). Written with megatron-core's own
IndexedDatasetBuilder, so any Megatron data loader reads it too.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

EOD = 255


def documents(text: str) -> list[bytes]:
    return [p.strip().encode("utf-8") for p in re.split(r"\n\s*\n", text) if p.strip()]


def write_indexed(inputs: Sequence[str], output_prefix: str) -> int:
    """Write the documents of `inputs` as an indexed dataset at `output_prefix`; returns the document count."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=np.uint16)
    count = 0
    for path in inputs:
        for doc in documents(Path(path).read_text(encoding="utf-8", errors="replace")):
            builder.add_item(torch.tensor(list(doc) + [EOD], dtype=torch.int64))
            builder.end_document()
            count += 1
    if count == 0:
        raise ValueError(f"no text in {list(inputs)}")
    builder.finalize(get_idx_path(output_prefix))
    return count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="UTF-8 text files")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    n = write_indexed(args.input, args.output_prefix)
    print(f"wrote {n} documents to {args.output_prefix}.bin / .idx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
