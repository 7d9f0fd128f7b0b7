"""The distributed optimizer's gradient norm: summed by parameter name, and read from the device once.

Megatron sums the per-tensor norms of the main gradients (``MegatronOptimizer._filter_grads_for_norm``) in the
order of its buffers, and the buffers are laid out per dtype: with ``--fp4-param-gather`` the NVFP4 weights sit in
a uint8 buffer of their own, so the same gradients are summed in another order than in the bf16 run, and the norm
differs by an ulp or two. With clipping on (``--clip-grad``), the clip coefficient then differs, and so do the
fp32 masters after enough steps: an fp4 run stopped being bitwise its fake-quantization reference (bf16 weights,
the same NVFP4 forward) on that alone. Summing by parameter name (the registration order differs too: converting a
weight re-registers it after its bias), whatever the buffers, gives every layout the same norm from the same
gradients at data-parallel size 1; above it each rank's shards are cut from its own layout, and the per-rank
partial sums still round differently.

Without TransformerEngine or Apex, Megatron's fallback norm (``megatron.core.utils.local_multi_tensor_l2_norm``)
turns each gradient's norm into a Python float: one device synchronisation per gradient tensor, each leaving the
device idle while the host issues the next op (40 per step at GPT 4096, TP 2 x DP 2, in bf16, 63 with
``--fp4-param-gather``, whose two buffers cut more shard pieces). `l2_norm_read_once` computes the same per-tensor
norms, copies them to the host in one read and reduces them there exactly as upstream does: the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch


def _norm_order(opt) -> Optional[dict]:
    """{id(main param): (model chunk, its model parameter's name)}, or None for an optimizer whose main parameters
    this cannot map (then upstream's order stays)."""
    chunks = getattr(opt, "model_chunks", None)
    pairs = [(getattr(opt, a, None), getattr(opt, b, None)) for a, b in
             (("model_float16_groups", "shard_fp32_from_float16_groups"), ("model_fp32_groups", "shard_fp32_groups"))]
    if not chunks or any(m is None or s is None for m, s in pairs):
        return None
    position = {id(p): (i, name) for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    order = {}
    for model_groups, shard_groups in pairs:
        for model_group, shard_group in zip(model_groups, shard_groups):
            for model_param, shard in zip(model_group, shard_group):
                if shard is not None and id(model_param) in position:
                    order[id(shard)] = position[id(model_param)]
    return order


def make_filter_grads_for_norm(original):
    def _filter_grads_for_norm(self, params, param_filter=None):
        params = list(params)
        key = tuple(map(id, params))
        cached = self.__dict__.get("_fp4_dist_norm_order")
        if cached is None or cached[0] != key:  # the first call, or main parameters made anew (a load)
            order, permutation = _norm_order(self), None
            if order and all(id(p) in order for p in params):
                # stable: the shards of one parameter keep their order
                permutation = sorted(range(len(params)), key=lambda i: order[id(params[i])])
            cached = self.__dict__["_fp4_dist_norm_order"] = (key, permutation)
        if cached[1] is not None:
            params = [params[i] for i in cached[1]]
        return original(self, params, param_filter)

    return _filter_grads_for_norm


def l2_norm_read_once(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Megatron's fallback ``multi_tensor_l2norm`` (same arguments, same result bit for bit: fp32 norms per tensor
    on their device, their norm on the host) with one device-to-host read instead of one per tensor."""
    norms = [torch.stack([torch.norm(t) for t in tensors]) for tensors in tensor_lists if len(tensors)]
    if len(norms) != len(tensor_lists):  # an empty list: as upstream, a norm of nothing
        host = torch.tensor([[float(torch.norm(t)) for t in tensors] for tensors in tensor_lists])
    else:
        host = torch.stack(norms).to(device="cpu", dtype=torch.float32)
    total = torch.norm(host)
    if tensor_lists and len(tensor_lists[0]):
        device = tensor_lists[0][0].device
    else:  # upstream's "cuda" (the CPU layer maps it to the host on CPU ranks)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.tensor([float(total)], dtype=torch.float, device=device), None


def make_l2_norm(original):
    """`l2_norm_read_once` in place of Megatron's own fallback; TransformerEngine's or Apex's kernel (which reads
    nothing) stays."""
    from megatron.core import utils

    return l2_norm_read_once if original is utils.local_multi_tensor_l2_norm else original
