"""What checking a checkpoint against its manifest costs (fp4_dist.checkpoint.manifest), on this CPU.

    python bench/verify.py [--gib 1.0]

1. xxh3_64 over 4 MiB chunks of a buffer in memory, one core (this process is single-threaded): GB/s.
2. A DCP checkpoint of one fp32 tensor of `--gib` GiB committed by fp4_dist.checkpoint.save (manifest included),
   loaded by load_distributed_checkpoint with and without verification, from the page cache (best of 3 each): the
   seconds verification adds, and per GB. A cold read from disk costs the same extra read of every byte.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import xxhash  # noqa: E402

from fp4_dist.checkpoint import load_distributed_checkpoint, save  # noqa: E402
from fp4_dist.checkpoint.manifest import CHUNK_BYTES  # noqa: E402


def best(f, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def hash_rate(nbytes: int = 1 << 30) -> float:
    view = memoryview(os.urandom(nbytes))
    seconds = best(lambda: [xxhash.xxh3_64_hexdigest(view[i:i + CHUNK_BYTES]) for i in range(0, nbytes, CHUNK_BYTES)])
    return nbytes / seconds / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"xxh3_64, 4 MiB chunks, one core: {hash_rate():.2f} GB/s")
    numel = int(args.gib * (1 << 30)) // 4
    state = {"w": torch.randn(numel)}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the single-process DCP notes
        path = save(state, Path(tmp) / "step_00000001")
        nbytes = sum(p.stat().st_size for p in path.iterdir())
        into = {"w": torch.empty(numel)}
        plain = best(lambda: load_distributed_checkpoint(into, path, verify=False))
        checked = best(lambda: load_distributed_checkpoint(into, path))
    added = checked - plain
    print(f"DCP load of {nbytes / 1e9:.2f} GB from the page cache: {plain:.2f} s unchecked, {checked:.2f} s verified "
          f"(+{added:.2f} s, +{added / nbytes * 1e9:.2f} s per GB, {100 * added / plain:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
