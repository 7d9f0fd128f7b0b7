"""The exported global scale: compressed-tensors' decode code * fp32(s / g) against ours, code * ((s * A) *
fp32(1/2688)), over every (code, scale byte) pair, for amaxes across the fp32 range."""

from pathlib import Path

import pytest
import torch

from fp4_dist.export.global_scale import (SEARCH_ULPS, amax_for_global_scale, choose_global_scale,
                                          ct_decode)  # fmt: skip
from fp4_dist.format import E2M1_VALUES, GLOBAL_SCALE_NUMERATOR

SCALES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
CODES = torch.tensor(E2M1_VALUES[1:], dtype=torch.float32)
INV = torch.ones(1) / torch.full((1,), GLOBAL_SCALE_NUMERATOR)


def amaxes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    mags = torch.rand(n, generator=g) * 10 ** torch.empty(n).uniform_(-6, 3, generator=g)
    return mags.to(torch.bfloat16).float().tolist()  # an amax is the max of bf16 values


def products(a, g):
    ours = CODES[:, None] * ((SCALES * a) * INV)[None, :]
    theirs = CODES[:, None] * (SCALES / torch.tensor([g]))[None, :]
    return ours, theirs


@pytest.mark.parametrize("a", amaxes(300))
def test_the_verdict_is_what_every_code_and_scale_gives(a):
    gs = choose_global_scale(a)
    ours, theirs = products(torch.tensor([a]), gs.value)
    if gs.exact == "fp32":
        assert torch.equal(ours, theirs)
    ob, tb = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    differ = int((ob != tb).sum())
    assert differ == gs.mismatched
    assert (gs.exact == "approx") == (differ > 0)
    # the bound the docs state: one bf16 ulp at most
    ulps = (ob.view(torch.int16).int() - tb.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1


def test_most_amaxes_decode_exactly_in_bf16_and_the_rest_differ_in_few_products():
    verdicts = [choose_global_scale(a) for a in amaxes(2000, seed=1)]
    approx = [v for v in verdicts if v.exact == "approx"]
    shares = {k: sum(v.exact == k for v in verdicts) / len(verdicts) for k in ("fp32", "bf16", "approx")}
    most = max(v.mismatched for v in approx)
    # docs/export.md quotes this line (pytest -s shows it)
    print(f"\n{len(verdicts)} amaxes: " + ", ".join(f"{k} {share:.1%}" for k, share in shares.items())
          + f"; approx ones differ in at most {most} of 882 products")
    assert len(approx) < 0.03 * len(verdicts), len(approx)
    assert all(v.mismatched <= 882 // 10 for v in approx)
    doc = (Path(__file__).parents[3] / "docs" / "export.md").read_text()
    rows = {k: f"| `{k}` | {share:.1%} " for k, share in shares.items()}
    assert all(row in doc for row in rows.values()), f"docs/export.md's verdict table should read {rows}"
    assert f"at most {most} of 882" in doc


def test_the_global_scale_is_near_the_encode_scale_and_deterministic():
    for a in amaxes(50, seed=2):
        gs = choose_global_scale(a)
        g0 = GLOBAL_SCALE_NUMERATOR / a
        assert abs(gs.value - g0) <= g0 * SEARCH_ULPS * 2**-23 * 1.01
        assert choose_global_scale(a) == gs


def test_zero_amax_gives_one():
    assert choose_global_scale(0.0).value == 1.0


def test_ct_decode_matches_compressed_tensors_own_decompressor():
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (48, 24), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 127, (48, 3), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gsc = torch.tensor([1234.5678], dtype=torch.float32)
    scheme: QuantizationScheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    out = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gsc}, scheme)["weight"]
    assert ct is not None and out.dtype == torch.bfloat16
    assert torch.equal(ct_decode(packed, scale, float(gsc)).to(torch.bfloat16), out)


@pytest.mark.parametrize("a", amaxes(40, seed=4))
def test_the_amax_derived_from_a_global_scale_gives_back_our_own(a):
    gs = choose_global_scale(a)
    derived, differ = amax_for_global_scale(gs.value, torch.arange(1, 127, dtype=torch.uint8))
    if gs.exact == "fp32":
        assert differ == 0
    ours_a, _ = products(torch.tensor([a]), gs.value)
    ours_d, _ = products(torch.tensor([derived]), gs.value)
    assert int((ours_a.to(torch.bfloat16) != ours_d.to(torch.bfloat16)).sum()) <= gs.mismatched + differ * 7
