"""Compile the CUDA stage kernels once per device and launch them on torch's current stream.

Sources are the `.cu` files in `cuda/`, compiled with NVRTC (CuPy's bindings) for the exact device
architecture (`-arch=sm_XY`). Options, and why:

    -fmad=false      no multiply-add contraction: every fp32 op is rounded on its own (spec section 2)
    -ftz=false       keep subnormals (E4M3 subnormal scales, tiny masters); CuPy's own RawModule path adds
                     -ftz=true, which is why this module drives NVRTC itself
    -prec-div=true   correctly rounded division and reciprocal (1/S, 2688/A, 1/(s_t*Sdec))
    no fast math, ever

`common.cuh` is pasted into each source with `#line` markers, so compiler messages name the right file and
line, and the compiled text is the whole input (no include path to go stale).

Launchers check their arguments, size the grid, and launch; they never allocate and never synchronize.
"""

from __future__ import annotations

import ctypes
import re
import struct
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .cuda_plans import current_raw_stream

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
SOURCES = ("amax.cu", "scale.cu", "cast.cu", "transpose.cu", "dequant.cu", "fp8_rows.cu", "fp8_block.cu",
           "nvfp4_1d.cu")
# Compiled at the first launch of one of their kernels, not with the stage kernels: the FP8 and nvfp4 compute modes'
# alone, so that nothing of them stands between a run that does not use them and the NVFP4 stages.
LAZY_SOURCES = ("fp8_rows.cu", "fp8_block.cu", "nvfp4_1d.cu")
THREADS = 256  # every kernel is written for 256-thread blocks (kThreads in common.cuh)

COMPILE_OPTIONS = ("-std=c++17", "-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")

_ROUND = {torch.bfloat16: "RoundBf16", torch.float16: "RoundFp16", torch.float32: "RoundFp32"}
_NUMERICS = {"te": "NumericsTe", "te-2.14": "NumericsTe214"}
# Two software E2M1 roundings with the same bits (common.cuh): E2M1Min (fewer instructions) and E2M1Select.
_E2M1 = ("E2M1Min", "E2M1Select")

# The one name table: (stage, variant) -> (source file, kernel name expression).
KERNELS: dict[tuple[str, str], tuple[str, str]] = {
    **{("partial_amax", r): ("amax.cu", f"fp4d::partial_amax_kernel<fp4d::{r}>") for r in _ROUND.values()},
    **{("partial_cast", f"{r}:{c}"): ("cast.cu", f"fp4d::partial_cast_kernel<fp4d::{r}, fp4d::{c}>")
       for r in _ROUND.values() for c in _E2M1},
    **{("fused_scale", v): ("scale.cu", f"fp4d::fused_scale_kernel<fp4d::{v}>") for v in _NUMERICS.values()},
    **{("owner_scales", v): ("scale.cu", f"fp4d::owner_scale_kernel<fp4d::{v}>") for v in _NUMERICS.values()},
    ("expand_scales", ""): ("scale.cu", "fp4d::expand_scales_kernel"),
    ("nibble_transpose", "64x512"): ("transpose.cu", "fp4d::nibble_transpose_kernel<64, 64>"),
    ("nibble_transpose", "128x256"): ("transpose.cu", "fp4d::nibble_transpose_kernel<128, 32>"),
    ("scale_transpose", ""): ("transpose.cu", "fp4d::scale_transpose_kernel"),
    ("dequantize", ""): ("dequant.cu", "fp4d::dequantize_kernel"),
    **{("e2m1_codes", c): ("cast.cu", f"fp4d::e2m1_codes_kernel<fp4d::{c}>") for c in _E2M1},  # test hooks
    ("e4m3_codes", ""): ("scale.cu", "fp4d::e4m3_codes_kernel"),
    **{("rows_1x128", d): ("fp8_rows.cu", f"fp4d::rows_1x128_kernel<fp4d::{d}>")
       for d in ("LoadBf16", "LoadFp16", "LoadFp32")},
    **{("rows_1x128_vec", d): ("fp8_rows.cu", f"fp4d::rows_1x128_vec_kernel<fp4d::{d}>")
       for d in ("LoadBf16", "LoadFp16", "LoadFp32")},
    **{("cols_1x128", d): ("fp8_rows.cu", f"fp4d::cols_1x128_kernel<fp4d::{d}>")
       for d in ("LoadBf16", "LoadFp16", "LoadFp32")},
    **{(stage, d): ("fp8_rows.cu", f"fp4d::{stage}_kernel<fp4d::{d}>")
       for stage in ("both_1x128", "both_1x128_vec", "both_1x128_stream") for d in ("LoadBf16", "LoadFp16")},
    ("fp8_block_copy", ""): ("fp8_block.cu", "fp4d::fp8_block_copy_kernel"),
    ("fp8_block_copy_fused", ""): ("fp8_block.cu", "fp4d::fp8_block_copy_fused_kernel"),
    ("transpose_bytes", ""): ("fp8_block.cu", "fp4d::transpose_bytes_kernel"),
    **{("amax_1x16", d): ("nvfp4_1d.cu", f"fp4d::amax_1x16_kernel<fp4d::{d}>")
       for d in ("SrcBf16", "SrcFp16", "SrcFp32")},
    **{("quantize_1x16", d): ("nvfp4_1d.cu", f"fp4d::quantize_1x16_kernel<fp4d::{d}>")
       for d in ("SrcBf16", "SrcFp16", "SrcFp32")},
    ("unscaled_bf16", ""): ("nvfp4_1d.cu", "fp4d::unscaled_bf16_kernel"),
}

# E2M1 rounding of partial_cast (a key of _E2M1): the one with fewer instructions per element by default.
CAST_E2M1 = "E2M1Min"

# The kernels that quantize a tensor both ways in one read (cuda/fp8_rows.cu), all with the same bits, by variant:
# "tile" (one group per warp at a time, byte stores), "vec" (16 values a thread, 16-byte loads and stores, one
# block per tile), "stream" (the vec path in as many blocks as are resident, each loading its next tile while it
# quantizes the current one's columns). BOTH_1X128 is the one `launch_both_1x128` takes unless told.
BOTH_1X128_VARIANTS = {"tile": "both_1x128", "vec": "both_1x128_vec", "stream": "both_1x128_stream"}
BOTH_1X128 = "vec"

# How `fp8_block.fp8_block_operand` makes a weight's FP8 copy, its transpose and their cuBLAS scales (the same
# bytes either way): "fused" (one launch, fp8_block_copy_fused_kernel) or "split" (the copy's kernel, the byte
# transpose and torch copies).
FP8_BLOCK_COPY = "fused"

# Launch grid per stage. "resident": min(units, blocks that fit on the device at once), each block looping over
# units (partial_amax needs it: one atomic merge of the tensor amax per block). "units": one block per unit,
# the hardware refills SMs as blocks finish (no per-block serial chain of load -> compute -> store). Measured on
# an H200 (bench/kernels.py --variants at 09b821d; the table is in `git log -p bench/RESULTS.md`): "units" takes
# partial_cast from 80/86/87% to 86/93/95% of copy bandwidth at 2^26/2^28/2^30 elements, the 128x256 nibble
# transpose from 64/80/78% to 66/81/84%.
GRID = {"partial_amax": "resident", "fused_scale": "resident", "partial_cast": "units",
        "owner_scales": "resident", "expand_scales": "resident", "nibble_transpose": "units",
        "scale_transpose": "resident", "dequantize": "units", "e2m1_codes": "resident",
        "e4m3_codes": "resident", "rows_1x128": "units", "rows_1x128_vec": "units",
        "cols_1x128": "units", "both_1x128": "units", "both_1x128_vec": "units", "both_1x128_stream": "resident",
        "fp8_block_copy": "units", "fp8_block_copy_fused": "units", "transpose_bytes": "units",
        "amax_1x16": "resident", "quantize_1x16": "units", "unscaled_bf16": "units"}  # fmt: skip

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def load_source(name: str) -> str:
    """Text of cuda/<name> with its local includes pasted in, each part under a `#line` of its own file."""
    path = CUDA_DIR / name
    out = [f'#line 1 "{path}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m:
            inc = CUDA_DIR / m.group(1)
            out.append(f'#line 1 "{inc}"')
            out.extend(inc.read_text().splitlines())
            out.append(f'#line {lineno + 1} "{path}"')
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def arch_option(capability: tuple[int, int]) -> str:
    major, minor = capability
    return f"-arch=sm_{major}{minor}"


def compile_source(name: str, expressions: list[str], capability: tuple[int, int]) -> tuple[bytes, dict[str, str]]:
    """NVRTC-compile cuda/<name> to a cubin for `capability`; returns (cubin, expression -> lowered name)."""
    from cupy_backends.cuda.libs import nvrtc

    options = [*COMPILE_OPTIONS, arch_option(capability)]
    prog = nvrtc.createProgram(load_source(name), name, (), ())
    try:
        for expr in expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed to compile {name} with {options}:\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog).strip()
        if "warning" in log:
            raise RuntimeError(f"NVRTC warnings compiling {name} (kernels must compile clean):\n{log}")
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in expressions}
        return nvrtc.getCUBIN(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


class _DeviceKernels:
    """The kernels of the name table loaded on one device (those of LAZY_SOURCES from their first launch), each
    with its launch grid limit."""

    def __init__(self, index: int):
        self.index = index
        props = torch.cuda.get_device_properties(index)
        self.sm_count = props.multi_processor_count
        self.capability = (props.major, props.minor)
        self.functions, self.max_blocks, self._modules = {}, {}, []
        for src in SOURCES:
            if src not in LAZY_SOURCES:
                self.load(src)

    def load(self, src: str) -> None:
        """Compile and load the kernels of cuda/<src> on this device."""
        import cupy
        from cupy_backends.cuda.api import driver

        with cupy.cuda.Device(self.index):
            keys = [key for key, (s, _) in KERNELS.items() if s == src]
            cubin, lowered = compile_source(src, [KERNELS[k][1] for k in keys], self.capability)
            module = cupy.cuda.function.Module()
            module.load(cubin)
            self._modules.append(module)
            for key in keys:
                fn = module.get_function(lowered[KERNELS[key][1]])
                per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, THREADS, 0)
                self.functions[key] = fn
                self.max_blocks[key] = max(1, per_sm) * self.sm_count


_lock = threading.Lock()
_devices: dict[int, _DeviceKernels] = {}
_streams: dict[int, object] = {}


def device_kernels(index: int) -> _DeviceKernels:
    """Kernels of device `index`, compiled on first use (once per process and device)."""
    k = _devices.get(index)
    if k is None:
        with _lock:
            k = _devices.get(index)
            if k is None:
                k = _devices[index] = _DeviceKernels(index)
    return k


def _cupy_stream(ptr: int, index: int):
    s = _streams.get(ptr)
    if s is None:
        import warnings

        import cupy

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = _streams[ptr] = cupy.cuda.ExternalStream(ptr, index)
    return s


class LaunchCounter:
    """Counts the stage kernel launches made inside a ``with`` block (benchmarks): ``calls``, and ``keys`` (the
    kernel name of each launch, in order). It swaps this module's `_launch`, which every launcher below looks up
    at call time."""

    def __enter__(self) -> "LaunchCounter":
        global _launch
        self.calls, self.keys, self._real = 0, [], _launch

        def counting(index, key, units, args):
            self.calls += 1
            self.keys.append(key[0])
            return self._real(index, key, units, args)

        _launch = counting
        return self

    def __exit__(self, *exc) -> None:
        global _launch
        _launch = self._real


def _kernel_and_grid(index: int, key: tuple[str, str], units: int):
    """Kernel `key` of device `index` and its grid for `units` work units: min(units, resident blocks)."""
    if units <= 0:
        raise ValueError(f"{key[0]}: launch with {units} work units")
    fn, cap = _kernel_and_cap(index, key)
    return fn, min(units, cap)


def _kernel_and_cap(index: int, key: tuple[str, str]):
    """Kernel `key` of device `index` (compiled at its first launch if its source is lazy) and the most blocks a
    launch of it takes."""
    k = device_kernels(index)
    fn = k.functions.get(key)
    if fn is None and key in KERNELS and KERNELS[key][0] in LAZY_SOURCES:
        with _lock:
            if key not in k.functions:
                k.load(KERNELS[key][0])
        fn = k.functions.get(key)
    if fn is None:
        raise KeyError(f"no kernel {key} in the name table")
    return fn, k.max_blocks[key] if GRID[key[0]] == "resident" else (1 << 31) - 1


def _launch(index: int, key: tuple[str, str], units: int, args: tuple) -> None:
    """Launch kernel `key` with min(units, resident blocks) blocks on torch's current stream of `index`."""
    fn, grid = _kernel_and_grid(index, key, units)
    import cupy  # here, not at module import: CuPy is optional where nothing runs on a GPU
    stream = _cupy_stream(current_raw_stream(index), index)
    if cupy.cuda.runtime.getDevice() != index:
        with cupy.cuda.Device(index):
            fn((grid,), (THREADS,), args, stream=stream)
    else:
        fn((grid,), (THREADS,), args, stream=stream)


_DIRECT = _launch  # the launcher a BoundLaunch may go around (tests and LaunchCounter swap `_launch` to count)


def _driver_launch():
    """The driver's cuLaunchKernel through ctypes, or None where the driver library does not load."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuLaunchKernel
    u = ctypes.c_uint
    fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_cu_launch = None
# The kernel argument types a launch passes (pointers as int, 64- and 32-bit integers): each one's ctypes type (a
# bound launch's argument objects) and struct format (an argument block's layout).
_ARGUMENTS = {int: (ctypes.c_uint64, "Q"), np.int64: (ctypes.c_int64, "q"), np.int32: (ctypes.c_int32, "i")}
_CTYPES = {t: c for t, (c, _) in _ARGUMENTS.items()}
_FORMAT = {t: f for t, (_, f) in _ARGUMENTS.items()}


class BoundLaunch:
    """One launch of a stage kernel with every argument fixed, for the work a step repeats (`stages.Bound`).

    The argument block is packed once, so a call is the driver's ``cuLaunchKernel`` on torch's current stream,
    a few microseconds of host time against the tens CuPy's generic call takes to convert its arguments (lean
    compute launches one per layer use). Where the direct call cannot be made (no driver library, another
    current device, no current context in this thread, `_launch` swapped by a counter) it is `_launch` itself."""

    __slots__ = ("index", "key", "units", "args", "fn", "grid", "params", "_values")

    def __init__(self, index: int, key: tuple[str, str], units: int, args: tuple):
        global _cu_launch
        fn, self.grid = _kernel_and_grid(index, key, units)
        self.index, self.key, self.units, self.args, self.fn = index, key, units, args, fn.ptr
        self.params = None
        if all(type(a) in _CTYPES for a in args):
            if _cu_launch is None:
                _cu_launch = _driver_launch() or False
            self._values = [_CTYPES[type(a)](a) for a in args]  # kept alive: params points at them
            self.params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(v) for v in self._values])

    def __call__(self) -> None:
        if (self.params is not None and _launch is _DIRECT and _cu_launch
                and torch._C._cuda_getDevice() == self.index):  # fmt: skip
            err = _cu_launch(self.fn, self.grid, 1, 1, THREADS, 1, 1, 0, current_raw_stream(self.index),
                             self.params, None)  # fmt: skip
            if err == 0:
                return
            if err != 201:  # CUDA_ERROR_INVALID_CONTEXT: this thread has none current; CuPy's path sets it
                raise RuntimeError(f"cuLaunchKernel of {self.key} failed with CUresult {err}")
        _launch(self.index, self.key, self.units, self.args)


class _ArgumentBlock:
    """One kernel's arguments as the driver reads them, for launches whose values change every call (`launch_now`):
    packed into one buffer in C layout, which a pointer array made once points into. The driver copies the values
    at the launch, so the buffer is reused; each thread has its own (`_blocks`)."""

    __slots__ = ("fn", "cap", "pack", "buffer", "params")

    def __init__(self, fn: int, cap: int, types: tuple):
        layout = struct.Struct("@" + "".join(_FORMAT[t] for t in types))
        # an argument's offset: the size up to and including it (native alignment pads before a field, never
        # after the last) less its own size
        offsets = [struct.calcsize("@" + "".join(_FORMAT[t] for t in types[: i + 1])) - struct.calcsize(_FORMAT[t])
                   for i, t in enumerate(types)]  # fmt: skip
        self.fn, self.cap, self.pack = fn, cap, layout.pack_into
        self.buffer = ctypes.create_string_buffer(max(1, layout.size))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * len(types))(*[base + o for o in offsets])


_blocks = threading.local()


def _argument_block(index: int, key: tuple[str, str], args: tuple) -> _ArgumentBlock | None:
    """This thread's argument block for kernel `key` on device `index` with these argument types (None: a type the
    block does not pack)."""
    table = _blocks.__dict__.setdefault("table", {})
    types = tuple(map(type, args))
    block = table.get((index, key, types), False)
    if block is False:
        block = None
        if all(t in _FORMAT for t in types):
            fn, cap = _kernel_and_cap(index, key)
            block = _ArgumentBlock(fn.ptr, cap, types)
        table[(index, key, types)] = block
    return block


def launch_now(index: int, key: tuple[str, str], units: int, args: tuple) -> None:
    """One launch through the driver directly, its arguments packed into this thread's block for the kernel (a
    few microseconds of host time against CuPy's tens): what the FP8 compute mode's launches use, whose pointers
    change every call. Where the direct call cannot be made (as for `BoundLaunch`), `_launch` itself."""
    global _cu_launch
    if _cu_launch is None:
        _cu_launch = _driver_launch() or False
    if units > 0 and _cu_launch and _launch is _DIRECT and torch._C._cuda_getDevice() == index:
        block = _argument_block(index, key, args)
        if block is not None:
            block.pack(block.buffer, 0, *args)
            err = _cu_launch(block.fn, min(units, block.cap), 1, 1, THREADS, 1, 1, 0, current_raw_stream(index),
                             block.params, None)  # fmt: skip
            if err == 0:
                return
            if err != 201:  # CUDA_ERROR_INVALID_CONTEXT: this thread has none current; CuPy's path sets it
                raise RuntimeError(f"cuLaunchKernel of {key} failed with CUresult {err}")
    _launch(index, key, units, args)


def bind(launch: Callable) -> BoundLaunch:
    """The launch that ``launch(via)`` makes through one of the launchers below (called with ``via=via``), bound:
    calling the result launches the same kernel with the same arguments."""
    made = []
    launch(lambda index, key, units, args: made.append(BoundLaunch(index, key, units, args)))
    if len(made) != 1:
        raise RuntimeError(f"bind: expected one launch, got {len(made)}")
    return made[0]


# One launcher per stage. A plan (`cuda_plans.Plan`) holds the device, the descriptor table, the prefix sum of
# work units and their count; the other arguments are the per-call device buffers.


def launch_partial_amax(plan, round_to, out, via=None) -> None:
    (via or _launch)(plan.device, ("partial_amax", _ROUND[round_to]), plan.units,
            (plan.table, plan.unit_begin, np.int32(plan.n), out.data_ptr(), plan.scratch.data_ptr()))  # fmt: skip


def launch_fused_scale(plan, numerics, amaxes, enc, via=None) -> None:
    (via or _launch)(plan.device, ("fused_scale", _NUMERICS[numerics]), plan.units,
            (plan.table, plan.unit_begin, np.int32(plan.n), amaxes.data_ptr(), enc.data_ptr()))  # fmt: skip


def launch_partial_cast(plan, round_to, enc, e2m1: str | None = None, via=None) -> None:
    """`e2m1`: the rounding variant (default CAST_E2M1); both give the same bits."""
    key = ("partial_cast", f"{_ROUND[round_to]}:{e2m1 or CAST_E2M1}")
    (via or _launch)(plan.device, key, plan.units, (plan.table, plan.unit_begin, np.int32(plan.n), enc.data_ptr()))


def launch_owner_scales(plan, numerics, amaxes, enc, compact, via=None) -> None:
    (via or _launch)(plan.device, ("owner_scales", _NUMERICS[numerics]), plan.units,
            (plan.table, plan.unit_begin, np.int32(plan.n), amaxes.data_ptr(), enc.data_ptr(),
             compact.data_ptr()))  # fmt: skip


def launch_expand_scales(plan, gathered, via=None) -> None:
    (via or _launch)(plan.device, ("expand_scales", ""), plan.units,
            (plan.table, plan.unit_begin, np.int32(plan.n), plan.extra, gathered.data_ptr()))  # fmt: skip


def launch_nibble_transpose(plan, via=None) -> None:
    """The unit shape (rows x columns of the weight) is the one the plan was laid out for (`plan.variant`)."""
    (via or _launch)(plan.device, ("nibble_transpose", plan.variant), plan.units,
            (plan.table, plan.unit_begin, np.int32(plan.n)))  # fmt: skip


def launch_scale_transpose(plan, via=None) -> None:
    (via or _launch)(plan.device, ("scale_transpose", ""), plan.units, (plan.table, plan.unit_begin, np.int32(plan.n)))


def launch_dequantize(plan, via=None) -> None:
    """A dequantize unit is one warp's work: 8 units per 256-thread block."""
    (via or _launch)(plan.device, ("dequantize", ""), -(-plan.units // (THREADS // 32)),
            (plan.table, plan.unit_begin, np.int32(plan.n)))  # fmt: skip


_LOAD = {torch.bfloat16: "LoadBf16", torch.float16: "LoadFp16", torch.float32: "LoadFp32"}


def launch_rows_1x128(x: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, via=None) -> None:
    """1 x 128 FP8 quantization of x [rows, cols] (any strides: a transposed view reads without a copy) into
    bits (uint8 [rows, cols], contiguous) and scales (fp32 [rows, ceil(cols/128)], outer-dim-major: strides
    (1, rows)). One warp per group: 8 groups per 256-thread block."""
    rows, cols = x.shape
    groups = rows * (-(-cols // 128))
    (via or launch_now)(x.device.index, ("rows_1x128", _LOAD[x.dtype]), -(-groups // (THREADS // 32)),
            (x.data_ptr(), np.int64(rows), np.int64(cols), np.int64(x.stride(0)), np.int64(x.stride(1)),
             bits.data_ptr(), scales.data_ptr()))  # fmt: skip


def launch_rows_1x128_vec(x: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, via=None) -> None:
    """The row-major fast path of `launch_rows_1x128`: x [rows, cols] with unit column stride, cols and the row
    stride multiples of 16 elements, 16-byte aligned (the caller checks). Eight threads per group."""
    rows, cols = x.shape
    threads = rows * (-(-cols // 128)) * 8
    (via or launch_now)(x.device.index, ("rows_1x128_vec", _LOAD[x.dtype]), -(-threads // THREADS),
            (x.data_ptr(), np.int64(rows), np.int64(cols), np.int64(x.stride(0)), bits.data_ptr(),
             scales.data_ptr()))  # fmt: skip


def launch_cols_1x128(y: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, via=None) -> None:
    """1 x 128 FP8 quantization of y^T for y [tokens, cols] with unit column stride (groups along the tokens) into
    bits (uint8 [cols, tokens]) and scales (fp32 [cols, ceil(tokens/128)], outer-dim-major). One block per 128 x 64
    tile of y."""
    tokens, cols = y.shape
    tiles = (-(-tokens // 128)) * (-(-cols // 64))
    (via or launch_now)(y.device.index, ("cols_1x128", _LOAD[y.dtype]), tiles,
            (y.data_ptr(), np.int64(tokens), np.int64(cols), np.int64(y.stride(0)), bits.data_ptr(),
             scales.data_ptr()))  # fmt: skip


def launch_both_1x128(x: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, bits_t: torch.Tensor,
                      scales_t: torch.Tensor, via=None, variant: str | None = None) -> None:  # fmt: skip
    """Both 1 x 128 FP8 quantizations of x [rows, cols] (bf16 or fp16, unit column stride): along its rows into
    bits [rows, cols] and scales [rows, ceil(cols/128)], along its columns (of x^T) into bits_t [cols, rows] and
    scales_t [cols, ceil(rows/128)]; scales outer-dim-major. `variant`: a key of BOTH_1X128_VARIANTS (default
    BOTH_1X128); all give the same bits. One block per 128 x 128 tile ("stream": at most the resident blocks)."""
    rows, cols = x.shape
    tiles = (-(-rows // 128)) * (-(-cols // 128))
    stage = BOTH_1X128_VARIANTS[variant or BOTH_1X128]
    (via or launch_now)(x.device.index, (stage, _LOAD[x.dtype]), tiles,
            (x.data_ptr(), np.int64(rows), np.int64(cols), np.int64(x.stride(0)), bits.data_ptr(),
             scales.data_ptr(), bits_t.data_ptr(), scales_t.data_ptr()))  # fmt: skip


def launch_fp8_block_copy(data: torch.Tensor, scales: torch.Tensor, scale_row_div: int, m: int, k: int,
                          amax: torch.Tensor, bits: torch.Tensor, out_scales: torch.Tensor, via=None) -> None:
    """FP8 block copy of the NVFP4 weight [m, k] (packed `data`, E4M3 tile `scales` whose row r // scale_row_div
    serves row r, fp32 `amax` on the device) into bits (uint8 [m, k], contiguous) and out_scales (fp32
    [ceil(m/128), ceil(k/128)], contiguous). One 256-thread block per 128 x 128 block."""
    blocks = (-(-m // 128)) * (-(-k // 128))
    (via or launch_now)(data.device.index, ("fp8_block_copy", ""), blocks,
            (data.data_ptr(), np.int64(data.stride(0)), scales.data_ptr(), np.int64(scales.stride(0)),
             np.int64(scale_row_div), np.int64(m), np.int64(k), amax.data_ptr(), bits.data_ptr(),
             out_scales.data_ptr()))  # fmt: skip


def launch_fp8_block_copy_fused(data: torch.Tensor, scales: torch.Tensor, scale_row_div: int, m: int, k: int,
                                amax: torch.Tensor, bits: torch.Tensor, out_scales: torch.Tensor,
                                bits_t: torch.Tensor | None, cublas_scales: torch.Tensor | None,
                                cublas_scales_t: torch.Tensor | None, via=None) -> None:  # fmt: skip
    """`launch_fp8_block_copy`, and in the same launch, each where given: bits_t (uint8 [k, m], contiguous: the
    copy transposed), cublas_scales and cublas_scales_t (the block scales as cuBLAS's 128 x 128 recipe reads them
    for the copy and for its transpose: `fp8_gemm._block_scales`' layouts, padding included). The caller checks
    shapes and layouts (`fp8_block.fp8_block_operand`). One 256-thread block per 128 x 128 block."""
    blocks = (-(-m // 128)) * (-(-k // 128))
    ptr = [0 if t is None else t.data_ptr() for t in (bits_t, cublas_scales, cublas_scales_t)]
    (via or launch_now)(data.device.index, ("fp8_block_copy_fused", ""), blocks,
            (data.data_ptr(), np.int64(data.stride(0)), scales.data_ptr(), np.int64(scales.stride(0)),
             np.int64(scale_row_div), np.int64(m), np.int64(k), amax.data_ptr(), bits.data_ptr(),
             out_scales.data_ptr(), *ptr))  # fmt: skip


def launch_transpose_bytes(src: torch.Tensor, dst: torch.Tensor, via=None) -> None:
    """dst [cols, rows] = src [rows, cols]^T, uint8, both contiguous, rows and cols multiples of 16 (the caller
    checks). One block per 64 x 64 tile."""
    rows, cols = src.shape
    (via or launch_now)(src.device.index, ("transpose_bytes", ""), (-(-rows // 64)) * (-(-cols // 64)),
            (src.data_ptr(), np.int64(rows), np.int64(cols), dst.data_ptr()))  # fmt: skip


_SRC = {torch.bfloat16: "SrcBf16", torch.float16: "SrcFp16", torch.float32: "SrcFp32"}


def launch_amax_1x16(view, flags: int, amax: torch.Tensor, via=None) -> None:
    """max|w| over the NVFP4 1 x 16 operand `view` (an `nvfp4_1d.Operand`: the source tensor read as Q [rows,
    out_cols] through strides, with the transform when `flags` asks) into `amax` (fp32 [1], zero before). A
    resident grid, one thread per 16-element block."""
    blocks = -(-view.rows * (-(-view.out_cols // 16)) // THREADS)
    (via or launch_now)(view.src.device.index, ("amax_1x16", _SRC[view.src.dtype]), blocks,
            (view.src.data_ptr(), *_operand_args(view), np.int64(flags), amax.data_ptr()))  # fmt: skip


def launch_quantize_1x16(view, flags: int, seed: int, amax: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                         via=None) -> None:  # fmt: skip
    """NVFP4 1 x 16 codes (uint8 [rows, ceil(out_cols / 2)], contiguous) and E4M3 block scales (uint8 [rows,
    ceil(out_cols / 16)], contiguous) of the operand `view` with the tensor amax `amax` (fp32 [1] on the device);
    `seed` (0 <= seed < 2^63) picks the stochastic rounding's bits when `flags` asks for it. One thread per block."""
    blocks = -(-view.rows * (-(-view.out_cols // 16)) // THREADS)
    (via or launch_now)(view.src.device.index, ("quantize_1x16", _SRC[view.src.dtype]), blocks,
            (view.src.data_ptr(), *_operand_args(view), np.int64(flags), np.int64(seed), amax.data_ptr(),
             data.data_ptr(), scales.data_ptr()))  # fmt: skip


def _operand_args(view) -> tuple:
    return (np.int64(view.rows), np.int64(view.length), np.int64(view.out_cols), np.int64(view.s_q),
            np.int64(view.s_j))  # fmt: skip


def launch_unscaled_bf16(data: torch.Tensor, scales: torch.Tensor, rows: int, cols: int, out: torch.Tensor,
                         via=None) -> None:  # fmt: skip
    """e2m1(code) * float(scale) of the NVFP4 1 x 16 tensor (packed `data` [rows, >= ceil(cols / 2)] and E4M3
    `scales` [rows, >= ceil(cols / 16)], each with unit column stride) into `out` (bf16 [rows, cols], contiguous).
    One thread per 16-element block."""
    blocks = -(-rows * (-(-cols // 16)) // THREADS)
    (via or launch_now)(data.device.index, ("unscaled_bf16", ""), blocks,
            (data.data_ptr(), np.int64(data.stride(0)), scales.data_ptr(), np.int64(scales.stride(0)),
             np.int64(rows), np.int64(cols), out.data_ptr()))  # fmt: skip


def launch_pointwise(index, key: str, args: tuple, n: int, variant: str = "") -> None:
    """Test hooks e2m1_codes (variant: an E2M1 rounding) / e4m3_codes over n values."""
    _launch(index, (key, variant), -(-n // THREADS), (*args, np.int64(n)))
