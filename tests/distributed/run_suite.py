"""Entry point of the distributed suites: `torchrun --nproc_per_node=N run_suite.py --out report.json`.

Also runs under `mpirun -n N python run_suite.py ...` (bootstrap from MPI) and on GPUs with NCCL (the device
follows the backend). Exit status 0 only when every rank passed every suite; rank 0 writes the JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fp4_dist.launch import init_distributed, shutdown  # noqa: E402

from _harness import Context  # noqa: E402

SUITES = ("cast", "bad_input", "train")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--backend", default=None, help="gloo or nccl (default: nccl when CUDA is available)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # same CPU kernels (and blocking) in the distributed and the baseline model
    info = init_distributed(args.backend)
    if info.device.type == "cuda":
        # The training parity compares two models in one process: keep every GPU op deterministic (flash and
        # memory-efficient attention backward accumulate with atomics; cuBLAS needs CUBLAS_WORKSPACE_CONFIG).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.use_deterministic_algorithms(True, warn_only=True)
    ctx = Context(info.rank, info.world_size, info.device, info.launcher)
    report = {"world_size": info.world_size, "backend": info.backend, "launcher": info.launcher,
              "device": str(info.device), "suites": {}}
    for name in args.suites.split(","):
        t0 = time.perf_counter()
        ctx.suite = name
        module = __import__(f"suite_{name}")
        try:
            result = module.run(ctx)
        except Exception:  # a crash is a failure of this rank, reported like any other
            ctx.failures.append(f"[{name}] rank {ctx.rank}: crashed:\n{traceback.format_exc()}")
            result = {}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        report["suites"][name] = result
    failures = ctx.failures
    if info.world_size > 1:
        everyone = [None] * info.world_size
        dist.all_gather_object(everyone, ctx.failures)
        failures = [f for per_rank in everyone for f in per_rank]
    report["failures"] = failures
    if info.rank == 0:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
        for f in failures[:50]:
            print("FAIL", f)
    shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
