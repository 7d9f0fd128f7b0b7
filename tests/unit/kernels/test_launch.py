"""fp4_dist/kernels/_launch.py and cuda/*.cu: every CUDA source compiles clean for sm_80, sm_90 and sm_100 (no GPU needed), and the descriptor structs
of common.cuh match the field tuples cuda_plans.py fills, so a broken kernel cannot land unseen on a CPU CI."""

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from fp4_dist.kernels import _launch, cuda_plans

ARCHS = ("80", "90", "100")
# The run-time numerics flags of _launch.COMPILE_OPTIONS, plus: every warning is an error, and ptxas warns
# (hence fails) on register spills and on any local-memory use (a slow path nobody meant to write).
NVCC_FLAGS = [
    *_launch.COMPILE_OPTIONS,
    "--Werror", "all-warnings",
    "-Xptxas", "-warn-spills,-warn-lmem-usage",
    "-Xcompiler", "-Wall,-Wextra",
    *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS],
    "-fatbin",
]  # fmt: skip


def _nvcc():
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not installed on this machine: CUDA sources not compiled (install the CUDA toolkit)")
    return path


def test_every_cuda_source_compiles_for_sm80_sm90_sm100_without_warnings():
    nvcc = _nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        procs = {
            src: subprocess.Popen(
                [nvcc, *NVCC_FLAGS, "-o", str(Path(tmp) / f"{src}.fatbin"), str(_launch.CUDA_DIR / src)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            for src in _launch.SOURCES
        }
        failures = []
        for src, p in procs.items():
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0 or "warning" in out.lower():
                failures.append(f"--- {src} (exit {p.returncode}):\n{out}")
    assert not failures, "nvcc " + " ".join(NVCC_FLAGS) + "\n" + "\n".join(failures)


def test_every_cuda_source_is_in_the_name_table_and_on_disk():
    on_disk = {p.name for p in _launch.CUDA_DIR.glob("*.cu")}
    assert on_disk == set(_launch.SOURCES)
    assert {src for src, _ in _launch.KERNELS.values()} == set(_launch.SOURCES)
    for src, expr in _launch.KERNELS.values():
        # "fp4d::k<fp4d::P>" must be explicitly instantiated as "k<P>" so that nvcc compiles that variant too.
        local = re.sub(r"fp4d::", "", expr)
        assert re.search(rf"\b{re.escape(local)}(\(|\s)", (_launch.CUDA_DIR / src).read_text()), f"{local} not in {src}"


def _struct_fields(name: str) -> tuple[str, ...]:
    text = (_launch.CUDA_DIR / "common.cuh").read_text()
    body = re.search(rf"struct {name} \{{(.*?)\n\}};", text, re.S).group(1)
    fields = re.findall(r"^\s*i64 (\w+);", body, re.M)
    assert len(fields) == len(re.findall(r";", re.sub(r"//.*", "", body))), f"{name}: every field must be i64"
    return tuple(fields)


@pytest.mark.parametrize(
    "struct,fields",
    [
        ("ShardDesc", cuda_plans.SHARD_FIELDS),
        ("ScaleDesc", cuda_plans.SCALE_FIELDS),
        ("TransposeDesc", cuda_plans.TRANSPOSE_FIELDS),
        ("ScaleTDesc", cuda_plans.SCALET_FIELDS),
        ("OwnerDesc", cuda_plans.OWNER_FIELDS),
        ("ExpandDesc", cuda_plans.EXPAND_FIELDS),
        ("DequantDesc", cuda_plans.DEQUANT_FIELDS),
    ],
)
def test_descriptor_struct_fields_match_the_python_table_columns(struct, fields):
    assert _struct_fields(struct) == fields


def test_flag_bits_match_common_header():
    from fp4_dist.kernels import cuda_plans as P

    text = (_launch.CUDA_DIR / "common.cuh").read_text()
    consts = {name: int(v) for name, v in re.findall(r"constexpr i64 (kFlag\w+) = (\d+);", text)}
    assert consts["kFlagBf16Src"] == P.FLAG_BF16_SRC and consts["kFlagVecSrc"] == P.FLAG_VEC_SRC
    assert consts["kFlagVecDst"] == P.FLAG_VEC_DST and consts["kFlagVec16Dst"] == P.FLAG_VEC16_DST
    assert consts["kFlagVec16Src"] == P.FLAG_VEC16_SRC
    import torch

    assert (consts["kFlagOutFp16"], consts["kFlagOutFp32"]) == (P.FLAG_OUT[torch.float16], P.FLAG_OUT[torch.float32])
    assert P.FLAG_OUT[torch.bfloat16] == 0


def test_loader_pastes_common_header_under_line_markers():
    src = _launch.load_source("amax.cu")
    assert '#include "common.cuh"' not in src
    assert f'#line 1 "{_launch.CUDA_DIR / "common.cuh"}"' in src
    assert "e4m3_rne_satfinite" in src and src.startswith(f'#line 1 "{_launch.CUDA_DIR / "amax.cu"}"')


def test_compile_options_keep_ieee_fp32_numerics():
    opts = set(_launch.COMPILE_OPTIONS)
    assert {"-fmad=false", "-ftz=false", "-prec-div=true"} <= opts
    assert not any("fast" in o for o in opts)
    assert _launch.arch_option((9, 0)) == "-arch=sm_90"


def test_launch_counter_counts_every_launch_and_restores_the_launcher_even_when_a_launch_raises():
    real = _launch._launch
    # units=0 is refused by _launch before it touches a device, so this runs without a GPU.
    with pytest.raises(ValueError, match="work units"), _launch.LaunchCounter() as c:
        _launch._launch(0, ("partial_amax", "RoundBf16"), 0, ())
    assert c.calls == 1 and c.keys == ["partial_amax"]
    assert _launch._launch is real


def test_an_argument_block_holds_each_value_where_its_pointer_points_with_c_alignment():
    # the kernels read each argument through its pointer, at the C layout's offset and width: a misplaced or
    # misaligned value would launch with a wrong pointer or size, silently
    import ctypes

    import numpy as np

    args = (np.int32(-7), 0xDEADBEEF0000, np.int64(-(2**40)), np.int32(2**31 - 1), np.int64(5), 2**64 - 1)
    block = _launch._ArgumentBlock(0, 1, tuple(map(type, args)))
    block.pack(block.buffer, 0, *args)
    read = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, int: ctypes.c_uint64}
    for i, a in enumerate(args):
        pointer = block.params[i]
        assert pointer % ctypes.sizeof(read[type(a)]) == 0
        assert read[type(a)].from_address(pointer).value == int(a)
    assert block.params[5] + 8 <= ctypes.addressof(block.buffer) + ctypes.sizeof(block.buffer)
