"""Train on Hopper, deploy in NVFP4: trained weights out to (and back from) compressed-tensors checkpoints.

    export_compressed_tensors(model, out_dir)        a Hugging Face folder transformers and vLLM load
    export_megatron_checkpoint(save_dir, out_dir)    the same from fp4_dist's Megatron checkpoints
    load_compressed_tensors(model, folder)           back into NVFP4 weights, the same bytes
    VLLM_FUSED                                       the sibling groups to train with one amax for vLLM

Modules::

    save.py          the exports (a model, FSDP2 shards, DCP or Megatron checkpoints) and their report
    load.py          the load back into NVFP4 weights, and its report
    ct_format.py     compressed-tensors' format as written and read: names, config, safetensors files
    global_scale.py  the exported global scale that lets compressed-tensors decode our bytes as we do
    __main__.py      ``python -m fp4_dist.export megatron SAVE_DIR OUT_DIR``

docs/export.md has the commands and the exactness bound.
"""

from ..checkpoint.safe_load import UnsafeCheckpointError
from .ct_format import DamagedCheckpointError
from .global_scale import GlobalScale, choose_global_scale
from .load import LoadReport, load_compressed_tensors
from .save import VLLM_FUSED, ExportReport, export_compressed_tensors, export_megatron_checkpoint

__all__ = [
    "export_compressed_tensors",
    "export_megatron_checkpoint",
    "load_compressed_tensors",
    "ExportReport",
    "LoadReport",
    "GlobalScale",
    "choose_global_scale",
    "VLLM_FUSED",
    "DamagedCheckpointError",
    "UnsafeCheckpointError",
]
