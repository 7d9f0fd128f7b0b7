"""Check, on every rank, that the all-gathered NVFP4 weights equal ``quantize(full fp32 master)``.

The DistributedOptimizer holds each weight's fp32 master as disjoint shards (``param.main_param`` on the
rank that owns elements ``[start, end)``). Each rank writes its shard into a zero [M*K] tensor and a SUM
all-reduce over the data-parallel group rebuilds the full master exactly (x + 0 is exact). Quantizing that
in one piece is the reference the gathered bytes must match bit for bit: ``rowwise_data``, the whole
``rowwise_scale_inv`` (padding included), ``amax``, and the columnwise copy when it exists. What the GEMMs will
read of each weight without remaking it (a kept bf16 copy, a layer's FP8 copy: `fp4_dist.compute.consumed`) must
equal the same copy of the reference, bit for bit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..format import TILE, ceil_div, packed_bytes
from ..quantize import quantize
from ..tensor import is_nvfp4_tensor
from ..compare import mismatches
from ..compute.consumed import consumed_pairs, holders_of
from .parallel import is_expert, tensor_parallel_group


@dataclass
class ParityReport:
    """Result of one check on this rank."""

    weights: int = 0
    bytes_checked: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _distributed_optimizers(optimizer) -> list:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if hasattr(o, "_get_model_param_range_map")]


def _buffer_of(param, optimizers):
    """(distributed optimizer, DDP buffer) holding `param` (Megatron keeps dense and expert weights, and each model
    chunk's, in buffers and optimizers of their own), or (None, None)."""
    for opt in optimizers:
        for buffer in opt.buffers:
            if param in buffer.param_index_map:
                return opt, buffer
    return None, None


def full_master(param, optimizers, group=None) -> torch.Tensor:
    """fp32 [M, K] master of ``param`` assembled from every rank's shard (a collective over the data-parallel group
    that shards it: `group`, by default its buffer's, i.e. the expert-data-parallel group for experts)."""
    device = param.rowwise_data.device if is_nvfp4_tensor(param) else param.device
    full = torch.zeros(param.numel(), dtype=torch.float32, device=device)
    owner, buffer = _buffer_of(param, optimizers)
    shard = getattr(param, "main_param", None)
    if shard is not None and param in getattr(owner, "model_param_gbuf_map", ()):  # this rank holds a shard
        span = owner._get_model_param_range_map(param)["param"]
        full[span.start:span.end] = shard
    if group is None and buffer is not None:
        group = buffer.data_parallel_group
    dist.all_reduce(full, group=group)
    return full.view(param.shape)


def canonical_name(name: str) -> str:
    """Parameter name with wrappers removed, so NVFP4, bf16 and fake-quant models name weights alike."""
    return name.replace(".parametrizations.weight.original", ".weight")


def master_digest(model: torch.nn.Module, optimizer, group=None, *, experts: Optional[bool] = None) -> str:
    """sha256 over every parameter's name and the fingerprint of its full fp32 master (`fingerprint`), in
    canonical-name order (a collective).

    Equal digests mean bit-identical masters; used to compare an NVFP4 run with its fake-quant reference and
    two runs with each other. `experts`: only MoE expert parameters (True), only the others (False), or all.
    """
    optimizers = _distributed_optimizers(optimizer)
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda np_: canonical_name(np_[0])):
        if experts is not None and is_expert(p) != experts:
            continue
        full = full_master(p, optimizers, group)
        h.update(canonical_name(name).encode())
        h.update(fingerprint(full))
    return h.hexdigest()


_CHUNK = 1 << 24  # words per pass: a few hundred MB of int64 temporaries on the master's device
_ODD = 6364136223846793005  # odd multipliers (int64): Knuth's MMIX LCG constant and the golden ratio's, halved
_MIX = 4611686018427387903


def fingerprint(x: torch.Tensor) -> bytes:
    """The bytes a master digest hashes for tensor x: its shape and dtype, then on the CPU x's bytes themselves, and
    on a GPU two 64-bit sums per 16M 32-bit words, computed there (copying a billion masters to the host and hashing
    them there takes seconds). Sum one weighs word i by an odd number that depends on i (integer arithmetic,
    wrapping: the same in any order of summation), so any change of one word changes it; sum two mixes each
    weighted word's high bits into its low ones first, so changes that cancel in one sum do not cancel in the
    other."""
    head = f"{tuple(x.shape)} {x.dtype};".encode()
    if not x.is_cuda or x.element_size() != 4:
        return head + x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    words = x.detach().contiguous().reshape(-1).view(torch.int32)
    sums = []
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        odd = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device).mul_(_ODD).mul_(2).add_(1)
        weighted = w.mul_(odd)
        sums.append(weighted.sum())
        sums.append(weighted.bitwise_xor_(weighted >> 29).mul_(_MIX).sum())
    return head + (torch.stack(sums).cpu().numpy().tobytes() if sums else b"")


def _reference(name: str, p, master: torch.Tensor, tp_group):
    """NVFP4 reference of this rank's weight: ``quantize(master)``, or under tensor parallelism this rank's
    slice of quantizing the whole weight (the TP slices gathered and joined along ``partition_dim``)."""
    if tp_group is None or not getattr(p, "tensor_model_parallel", False):
        return quantize(master, numerics=p.numerics, dtype=p.dtype, name=name)
    from ..kernels import reference as R
    from ..tensor import NVFP4Tensor

    tp, r, dim = dist.get_world_size(tp_group), dist.get_rank(tp_group), p.partition_dim
    parts = [torch.empty_like(master) for _ in range(tp)]
    dist.all_gather(parts, master.contiguous(), group=tp_group)
    data, _, amax, scales = R.quantize(torch.cat(parts, dim=dim), p.numerics, round_to=p.dtype)
    m, k = master.shape
    r0, c0 = (r * m, 0) if dim == 0 else (0, r * k)  # this slice's first row and column in the whole weight
    data = data[r0:r0 + m, packed_bytes(c0):packed_bytes(c0 + k)].contiguous()
    tiles = scales[r0 // TILE:ceil_div(r0 + m, TILE), c0 // TILE:(c0 + k) // TILE]
    return NVFP4Tensor((m, k), p.dtype, data, R.expand_rowwise_scales(tiles, m, k), amax, numerics=p.numerics)


def check_nvfp4_weights(model: torch.nn.Module, optimizer, group=None, tp_group=None) -> ParityReport:
    """Compare every NVFP4 parameter of ``model`` with ``quantize`` of its full master (collective); under
    tensor parallelism with this rank's slice of quantizing the whole weight (scales from its whole amax).
    `group` / `tp_group`: the data- and tensor-parallel groups, by default each weight's own (`full_master`,
    `parallel.tensor_parallel_group`: expert weights follow the expert groups)."""
    report = ParityReport()
    optimizers = _distributed_optimizers(optimizer)
    holders = holders_of(model)
    for name, p in model.named_parameters():
        if not is_nvfp4_tensor(p):
            continue
        master = full_master(p, optimizers, group)
        ref = _reference(name, p, master, tp_group if tp_group is not None else tensor_parallel_group(p))
        pairs = [("rowwise_data", p.rowwise_data, ref.rowwise_data),
                 ("rowwise_scale_inv", p.rowwise_scale_inv, ref.rowwise_scale_inv),
                 ("amax", p.amax, ref.amax)]
        if p.columnwise_data is not None:
            ref.make_columnwise()
            pairs += [("columnwise_data", p.columnwise_data, ref.columnwise_data),
                      ("columnwise_scale_inv", p.columnwise_scale_inv, ref.columnwise_scale_inv)]
        pairs = [(f"{name}.{field_name}", got, want) for field_name, got, want in pairs]
        pairs += consumed_pairs(name, p, holders.get(id(p), ()), ref)
        report.mismatches += mismatches(pairs)  # compared on the weight's device: one host read per weight
        report.bytes_checked += sum(want.numel() * want.element_size() for _, _, want in pairs)
        report.weights += 1
    return report


def all_ranks_ok(report: ParityReport, group=None) -> bool:
    """True when the check passed on every rank of ``group`` (a collective)."""
    flag = torch.tensor([0.0 if report.ok else 1.0])
    if dist.get_backend(group) == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() == 0.0)


def stale_packed_bytes(buffer) -> int:
    """Bytes of NVFP4 weights that the all-gather takes from a rank that did not cast them (so stale).

    ``buffer`` is a Megatron ``_ParamAndGradBuffer`` (or anything with its ``param_index_map``,
    ``bucket_indices``, ``nvfp4_packed_param_index_map``, ``nvfp4_packed_bucket_indices`` and
    ``data_parallel_world_size``). Rank r casts, for each weight overlapping its element shard, the bytes
    ``packed_start + [(lo - start) >> 1, (hi - start + 1) >> 1)``; the gather takes byte b of a bucket from
    rank ``b // (bucket_bytes / dp)``. Correct layouts give 0 (pure integer bookkeeping, no collective).
    """
    dp = buffer.data_parallel_world_size
    stale = 0
    for b, (start, end) in enumerate(buffer.bucket_indices):
        pstart, pend = buffer.nvfp4_packed_bucket_indices[b]
        nbytes, shard = pend - pstart, (end - start) // dp
        writer = torch.full((nbytes,), -1, dtype=torch.int64)
        used = torch.zeros(nbytes, dtype=torch.bool)
        for param, (s, e, bucket) in buffer.param_index_map.items():
            if bucket != b:
                continue
            ps = buffer.nvfp4_packed_param_index_map[param][0] - pstart
            used[ps:ps + (e - s + 1) // 2] = True
            for r in range(dp):
                lo, hi = max(s, start + r * shard), min(e, start + (r + 1) * shard)
                if lo < hi:
                    writer[ps + ((lo - s) >> 1):ps + ((hi - s + 1) >> 1)] = r
        owner = torch.arange(nbytes) // (nbytes // dp)
        stale += int(((writer != owner) & used).sum())
    return stale
