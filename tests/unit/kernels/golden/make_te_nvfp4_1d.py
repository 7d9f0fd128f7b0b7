"""Writes te_nvfp4_1d.pt: TransformerEngine's own pure-PyTorch NVFP4 reference quantizer run on small inputs, the
golden data that tests/unit/kernels/test_nvfp4_1d_reference.py holds `fp4_dist.kernels.nvfp4_1d_reference` to, bit
for bit. Nothing of TransformerEngine is stored in this repository: only its outputs.

TransformerEngine at commit d0067d0da6cb01811b8072a7d304f0e00344ce2b (main, 2026-08-22), which has its reference in
transformer_engine/pytorch/custom_recipes/reference_nvfp4.py (class NVFP4QuantizerRef). To regenerate, on any machine
with torch (no GPU, no TransformerEngine build):

    git clone https://github.com/NVIDIA/TransformerEngine /tmp/te
    git -C /tmp/te checkout d0067d0da6cb01811b8072a7d304f0e00344ce2b
    .venv/bin/python tests/unit/kernels/golden/make_te_nvfp4_1d.py --te /tmp/te

The reference module imports TransformerEngine's tensor base classes, which need the compiled library; this script
puts minimal stand-ins for those two classes (and `is_custom`) in sys.modules and loads the three custom_recipes
files themselves from the checkout, so the quantizer's arithmetic is TransformerEngine's own code, run on the CPU.

What is recorded, per case (inputs included, so the file does not depend on torch's random streams):
    rowwise   1 x 16 blocks along the last dimension, round to nearest even, per-tensor amax (the forward's x and
              the dgrad's dy): codes (packed uint8 [M, ceil16(N)/2]), E4M3 scale bits [M, ceil(N/16)], amax [1]
    rht       the wgrad operand: the 16-point random Hadamard transform with TE's sign vector applied to x^T along
              its last dimension (x's rows), then 1 x 16 RNE: the transform's output (x's dtype), codes, scales and
              the post-transform amax
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import torch

TE_COMMIT = "d0067d0da6cb01811b8072a7d304f0e00344ce2b"
OUT = Path(__file__).with_name("te_nvfp4_1d.pt")


def _stand_ins() -> None:
    """The names reference_nvfp4.py and gemm.py import from TE's compiled package, as plain classes."""

    class Quantizer:
        def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
            self.rowwise_usage, self.columnwise_usage = rowwise, columnwise
            self.internal, self.optimize_for_gemm = False, False

    class QuantizedTensorStorage:
        pass

    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.tensor",
             "transformer_engine.pytorch.custom_recipes"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")
    qt.Quantizer, qt.QuantizedTensorStorage = Quantizer, QuantizedTensorStorage
    utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    utils.is_custom = lambda *args, **kwargs: True
    sys.modules[qt.__name__], sys.modules[utils.__name__] = qt, utils


def _load(te: Path, name: str):
    full = f"transformer_engine.pytorch.custom_recipes.{name}"
    spec = importlib.util.spec_from_file_location(full, te / "transformer_engine/pytorch/custom_recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    setattr(sys.modules["transformer_engine.pytorch.custom_recipes"], name, module)
    spec.loader.exec_module(module)
    return module


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(66)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 0.125])
    ties = torch.cat([grid * 2.0**k for k in range(-3, 5)]).reshape(8, 16)
    ties = torch.cat([ties, -ties]).to(torch.bfloat16)  # E2M1 grid points and midpoints at several block scales
    # row-scales (rows 2^0 .. 2^-31 of one another): E4M3 subnormal block scales, and blocks that underflow to 0
    zero_blocks = randn(16, 64)
    zero_blocks[:, 16:32] = 0  # all-zero blocks: scale 0
    zero_blocks[:4, 32:48] = -1e-30  # tiny negatives: scale 0 (E4M3 underflow), sign kept
    mlp = torch.nn.functional.gelu(randn(64, 96) @ (randn(96, 96) / 96**0.5))  # an activation: skewed, many zeros
    return {
        "randn-bf16-64x128": randn(64, 128).to(torch.bfloat16),
        "ragged-bf16-19x40": randn(19, 40).to(torch.bfloat16),
        "heavy-tail-bf16-33x80": (randn(33, 80) * torch.exp(3 * randn(33, 80))).to(torch.bfloat16),
        "heavy-tail-bf16-48x40": (randn(48, 40) * torch.exp(3 * randn(48, 40))).to(torch.bfloat16),
        "row-scales-bf16-32x64": (randn(32, 64) * 2.0 ** -torch.arange(32.0)[:, None]).to(torch.bfloat16),
        "zero-blocks-bf16-16x64": zero_blocks.to(torch.bfloat16),
        "ties-bf16-16x16": ties,
        "gelu-bf16-64x96": mlp.to(torch.bfloat16),
        "fp32-24x48": randn(24, 48) * 3,
        "outlier-bf16-32x48": (randn(32, 48) + 500.0 * (torch.rand(32, 48, generator=g) < 0.01)).to(torch.bfloat16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--te", type=Path, required=True, help=f"a TransformerEngine checkout at {TE_COMMIT}")
    args = parser.parse_args()
    head = subprocess.run(["git", "-C", str(args.te), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    if head.strip() != TE_COMMIT:
        sys.exit(f"{args.te} is at {head.strip() or '?'}, not {TE_COMMIT}: check out that commit first")
    _stand_ins()
    _load(args.te, "reference_utils")
    _load(args.te, "gemm")
    ref = _load(args.te, "reference_nvfp4")
    e2m1 = ref.reference_utils.Fp4Formats.E2M1
    rows = ref.NVFP4QuantizerRef(dtype=e2m1, rowwise=True, columnwise=False, quant_tile_shape=(1, 16))
    rht = ref.NVFP4QuantizerRef(dtype=e2m1, rowwise=False, columnwise=True, quant_tile_shape=(1, 16), with_rht=True)
    cases = {}
    for name, x in _inputs().items():
        q = rows.quantize(x)
        case = {"x": x, "rowwise_data": q.data, "rowwise_scale": q.scale.view(torch.uint8),
                "rowwise_amax": q.global_amax_row}
        if x.shape[0] % 16 == 0 and x.dtype == torch.bfloat16:  # TE's transform takes bf16 with 16 | rows
            qt = rht.quantize(x)
            case.update(rht_values=rht._apply_rht(x.t().contiguous()), rht_data=qt.data_t,
                        rht_scale=qt.scale_t.view(torch.uint8), rht_amax=qt.global_amax_col)
        cases[name] = {k: v.clone().contiguous() for k, v in case.items()}
    torch.save({"te_commit": TE_COMMIT, "torch": str(torch.__version__), "cases": cases}, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(cases)} cases, torch {torch.__version__})")


if __name__ == "__main__":
    main()
