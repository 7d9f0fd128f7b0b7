"""The byte path's rows: Megatron's NVFP4 tensor test, storage alias, shard cast, post-all-gather processing
and packed layout, served by fp4_dist instead of TransformerEngine."""

from __future__ import annotations

import math

from .. import kernels
from .. import tensor as _tensor
from ..buffers.layout import packed_layout_of
from . import parallel
from .options import current_options


def make_is_nvfp4tensor(original):
    def is_nvfp4tensor(tensor) -> bool:
        return _tensor.is_nvfp4_tensor(tensor) or original(tensor)

    return is_nvfp4tensor


def is_any_nvfp4(tensor) -> bool:
    """An fp4_dist weight or one of TransformerEngine's (Megatron's own test, through the patched binding)."""
    from megatron.core import fp4_utils

    return fp4_utils.is_nvfp4tensor(tensor)


def make_modify_storage(original):
    def modify_nvfp4_rowwise_storage(param, new_rowwise_data) -> None:
        if not _tensor.is_nvfp4_tensor(param):
            return original(param, new_rowwise_data)
        param.set_rowwise_storage(new_rowwise_data)

    return modify_nvfp4_rowwise_storage


def make_shard_cast(original):
    def quantize_nvfp4_param_shard(
        model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params=None
    ) -> None:
        if not model_params:  # an optimizer holding no NVFP4 weight (a pipeline stage or expert set of bf16 layers)
            return None
        ours = [_tensor.is_nvfp4_tensor(p) for p in model_params]
        if not any(ours):
            return original(model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params)
        if not all(ours):
            raise TypeError(
                "fp4_dist.megatron: the NVFP4 param list mixes fp4_dist NVFP4Tensor weights with other NVFP4 "
                "types; build every NVFP4 weight with fp4_dist (fp4_dist.megatron.model) or none"
            )
        from ..cast import cast_master_weights_to_nvfp4

        check = cast_master_weights_to_nvfp4(
            model_params,
            main_params,
            start_offsets,
            data_parallel_group,
            fsdp_shard_model_weights=fsdp_shard_model_params,
            manual_post_all_gather_processing=True,
            amax_group=parallel.amax_group(model_params),
            defer_check=True,
        )
        if check is not None:
            # A cast resolves its previous verdict itself: keep only the unread ones (bounded without a gather).
            _DEFERRED_CHECKS[:] = [c for c in _DEFERRED_CHECKS if c.ok is None] + [check]

    return quantize_nvfp4_param_shard


# The non-finite verdicts of the casts whose weights no post-all-gather processing has seen yet. Megatron calls
# the cast in the middle of its optimizer step, with the optimizer's device work still queued; waiting there for
# the verdict would leave the rest of the step's host work (its copy loop over every parameter, the param sync)
# to run on an idle device. The verdicts are read where the weights are next handed on instead: the first
# post-all-gather processing (in the step, or in the next forward's pre-hook with --overlap-param-gather), before
# any layer reads a weight, on every rank (the verdict is the all-reduced one).
_DEFERRED_CHECKS: list = []
# Set once a processing ran inside a CUDA-graph capture (a full-iteration graph captures the overlapped gather's
# pre-hooks): its replays run no Python, so from then on each training step reads the verdicts at its start, on the
# host, before the graph replays (`resolve_cast_checks_before_a_step`).
_PROCESSING_CAPTURED = [False]


def resolve_cast_checks() -> None:
    """Read the verdicts of the casts since the last call; raises ValueError naming the weight, on every rank,
    if a cast read a non-finite fp32 master (the weights were written from it: resume from a checkpoint). Inside a
    CUDA-graph capture, where a read to the host cannot run, the verdicts wait for the next step's start."""
    if kernels.capturing():
        _PROCESSING_CAPTURED[0] = True
        return
    while _DEFERRED_CHECKS:
        _DEFERRED_CHECKS.pop(0).resolve(" in the fp32 master after the optimizer step, on some rank")


def resolve_cast_checks_before_a_step() -> None:
    """At a training step's start, outside any graph: read the verdicts a captured processing cannot read (see
    `_PROCESSING_CAPTURED`); nothing otherwise, so an eager step keeps the optimizer's device work queued."""
    if _PROCESSING_CAPTURED[0]:
        resolve_cast_checks()


def make_post_all_gather(original):
    def post_all_gather_processing(model_params) -> None:
        resolve_cast_checks()
        ours = [p for p in model_params if _tensor.is_nvfp4_tensor(p)]
        others = [p for p in model_params if not _tensor.is_nvfp4_tensor(p)]
        if ours:
            from ..cast import post_all_gather_processing as ours_post

            ours_post(ours, columnwise=current_options().columnwise)
        if others:
            original(others)

    return post_all_gather_processing



def make_pad_bucket_end(original):
    def pad_bucket_end(bucket_end_index: int, data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
        # Upstream pads to lcm(dp, 128[, 2**16]); its shard (end/dp) is odd when dp is a multiple of 128
        # (or 2**16), which would split a packed byte between two ranks. lcm(2*dp, ...) keeps every shard
        # even and equals upstream's divisor for every other dp.
        base = [2 * data_parallel_world_size, 128] + ([2**16] if pad_for_high_nccl_busbw else [])
        divisor = math.lcm(*base)
        return -(-bucket_end_index // divisor) * divisor

    return pad_bucket_end


def make_packed_layout(original):
    def _compute_nvfp4_packed_layout(self, params_with_names) -> None:
        ours = [p for p, _ in params_with_names if _tensor.is_nvfp4_tensor(p)]
        if not ours:
            return original(self, params_with_names)
        self.nvfp4_packed_param_index_map, self.nvfp4_packed_bucket_indices, unpadded = derive_packed_layout(
            self.param_index_map, self.bucket_indices, dict((p, n) for p, n in params_with_names),
            self.data_parallel_world_size,
        )
        self.nvfp4_packed_numel_unpadded = unpadded

    return _compute_nvfp4_packed_layout


def derive_packed_layout(param_index_map, bucket_indices, names, dp_size: int):
    """Packed (byte) layout of a uint8 NVFP4 buffer = its element layout / 2.

    Args:
        param_index_map: {param: (start, end, bucket_id)} in elements (Megatron's layout).
        bucket_indices: [(start, end)] per bucket, in elements.
        names: {param: name} for error messages.
        dp_size: data-parallel size; every bucket's rank shard must be an even element count.
    Returns:
        (packed_param_index_map, packed_bucket_indices, packed_numel_unpadded).
    Raises:
        TypeError if a non-fp4_dist param shares the buffer (1 byte/element would break the halving);
        ValueError naming the param or bucket if any boundary is odd.
    """
    for param in param_index_map:
        if not _tensor.is_nvfp4_tensor(param):
            raise TypeError(
                f"fp4_dist.megatron: param {names.get(param, '<unnamed>')} ({type(param).__name__}, {param.dtype}) "
                "shares the uint8 NVFP4 buffer with fp4_dist NVFP4 weights; its bytes are not 2 elements per byte, so "
                "the packed layout cannot be element layout / 2. Do not combine --fp8-param-gather weights with "
                "--fp4-param-gather"
            )
    labels = {param: f"fp4_dist.megatron: param {names.get(param, '<unnamed>')}" for param in param_index_map}
    return packed_layout_of(param_index_map, bucket_indices, dp_size, labels)




def make_is_distopt_quantized(original):
    def _is_distopt_quantized_param(cls, tensor) -> bool:
        # fp4_dist's weights are neither TE Float8Tensors nor grouped quantized tensors, which is all the original
        # tests; it finds that out through `param.data`, an alias built by NVFP4Tensor's Python dispatch.
        if type(tensor) is _tensor.NVFP4Tensor:
            return False
        return original(cls, tensor)

    return _is_distopt_quantized_param

