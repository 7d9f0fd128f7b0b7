"""Export trained NVFP4 weights as a compressed-tensors checkpoint: the trained codes and scales, unchanged.

Sources:
- a model whose linear weights are `NVFP4Tensor`s (`convert_linear_weights`, trained with `Zero1Optimizer`, the
  TE-signature cast or your own loop): every rank holds the whole weights, rank 0 writes;
- a model sharded by `fp4_dist.fsdp.fully_shard_nvfp4` (also one loaded from a DCP checkpoint at another world
  size): each weight's full fp32 master is all-gathered and quantized, which gives the bytes the training
  gathered (`quantize(full master)` is what the FSDP2 cast is tested bit-identical to);
- a Megatron checkpoint folder written by fp4_dist's Megatron entry point (`export_megatron_checkpoint`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..convert import weight_owners
from ..kernels import reference
from ..megatron.safe_globals import megatron_checkpoint_globals
from ..checkpoint import atomic
from ..checkpoint.manifest import verify_folder
from ..checkpoint.safe_load import load_checkpoint_file
from ..cast.collectives import in_distributed_job, rank_and_size
from ..quantize import quantize
from ..shared_amax import group_amax, sibling_groups
from ..tensor import is_nvfp4_tensor
from . import ct_format
from .global_scale import GlobalScale, choose_global_scale, ct_decode

VLLM_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linear layers that vLLM fuses into one GEMM (qkv_proj, gate_up_proj) and so needs one global scale for;
`convert_linear_weights(model, shared_amax=VLLM_FUSED)` trains them with one amax."""


@dataclass
class NVFP4Entry:
    """One NVFP4 weight to export: its rowwise fields and model dtype."""

    rowwise_data: torch.Tensor
    rowwise_scale_inv: torch.Tensor
    amax: torch.Tensor
    dtype: torch.dtype


@dataclass
class ExportReport:
    """What an export wrote, and how exactly compressed-tensors' decode reproduces the trained weights."""

    path: str
    files: list[str] = field(default_factory=list)
    """Files written (empty on ranks other than the writer)."""
    nvfp4: dict[str, GlobalScale] = field(default_factory=dict)
    """Weight name -> its exported global scale and exactness ("fp32", "bf16" or "approx")."""
    differing: dict[str, int] = field(default_factory=dict)
    """Weights whose bf16 decode differs from `NVFP4Tensor.dequantize(torch.bfloat16)` in that many elements, each
    by one bf16 ulp (only "approx" weights appear)."""
    dense: list[str] = field(default_factory=list)
    """Tensors stored as they are (norms, embeddings, skipped linears), in their model dtype."""
    tied: dict[str, str] = field(default_factory=dict)
    """Names left out because they are the same tensor as another one stored (name -> stored name); loaders tie
    them again from the config (``tie_word_embeddings``)."""
    dense_nvfp4: list[str] = field(default_factory=list)
    """NVFP4 weights stored as their dequantized values, because a module other than a linear holds them (an
    embedding tied to the output head): exact, but not 4-bit."""
    fused_scales_differ: list[tuple[str, ...]] = field(default_factory=list)
    """Groups of weights vLLM fuses (`VLLM_FUSED`) whose global scales differ: fine for transformers, not for
    vLLM, which keeps one scale per fused layer; train with `shared_amax=VLLM_FUSED` to avoid it."""

    @property
    def exact(self) -> bool:
        """Whether every NVFP4 weight decodes to bitwise the trained values in bf16."""
        return not self.differing

    def __str__(self) -> str:
        kinds = {k: sum(g.exact == k for g in self.nvfp4.values()) for k in ("fp32", "bf16", "approx")}
        lines = [f"exported {len(self.nvfp4)} NVFP4 weights and {len(self.dense)} dense tensors to {self.path}",
                 f"  decode equal to the trained weights: {kinds['fp32']} in fp32, {kinds['bf16']} in bf16; "
                 f"{kinds['approx']} with some elements one bf16 ulp off"]
        lines += [f"  {name}: {n} elements differ by one bf16 ulp" for name, n in self.differing.items()]
        lines += [f"  {name} stored dense (held by a non-linear module)" for name in self.dense_nvfp4]
        lines += [f"  {a} tied to {b} (not stored)" for a, b in self.tied.items()]
        lines += [f"  vLLM: {', '.join(g)} have different global scales" for g in self.fused_scales_differ]
        return "\n".join(lines)


def export_compressed_tensors(model: nn.Module, out_dir, *, config: Any = None,
                              dense_dtype: Optional[torch.dtype] = None,
                              max_shard_bytes: int = ct_format.DEFAULT_SHARD_BYTES, group=None,
                              verbose: bool = False) -> ExportReport:  # fmt: skip
    """Write `model`'s weights to `out_dir` as a Hugging Face checkpoint in compressed-tensors' NVFP4 format.

    NVFP4 weights keep their trained codes and tile scales; each gets the global scale that makes
    compressed-tensors' decode equal ours (`global_scale.choose_global_scale`; the report counts any element that
    differs, by one bf16 ulp). Other tensors are stored in their dtype (`dense_dtype` converts them; default for a
    `fully_shard_nvfp4` model: the NVFP4 weights' compute dtype, since its parameters are fp32 masters).

    Args:
        model: a module with NVFP4Tensor weights, or one sharded by `fully_shard_nvfp4`.
        out_dir: folder to write (created). An earlier export there is replaced whole and atomically: a process
            stopped at any point leaves the earlier export or this one (`fp4_dist.checkpoint.atomic.commit_folder`).
            A folder holding other files is refused with a ValueError naming them, before anything is written.
        config: the model's Hugging Face config (a `PretrainedConfig` or a dict); default ``model.config`` when the
            model has one. Its dict is written as config.json with the quantization config added.
        max_shard_bytes: largest safetensors file (Hugging Face's sharding, with an index file).
        group: process group whose rank 0 writes; inside a distributed job every rank of it must call (a
            `fully_shard_nvfp4` model gathers its masters). Default: the whole job.
    Returns:
        ExportReport (on every rank; `files` only on the writer).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"export_compressed_tensors: model must be an nn.Module, got {type(model).__name__}")
    registry = getattr(model, "_fp4_dist_nvfp4", None)
    if not (registry.states if registry is not None else any(is_nvfp4_tensor(p) for p in model.parameters())):
        raise ValueError("export_compressed_tensors: the model has no NVFP4 weights (convert it with "
                         "fp4_dist.convert_linear_weights or shard it with fully_shard_nvfp4 first)")
    cfg = _config_dict(config if config is not None else getattr(model, "config", None))
    rank, _ = rank_and_size(group)
    writer = rank == 0  # the others only take part in the gathers of a sharded model
    entries, tied, linear_modules, held_by_other = _model_entries(model, dense_dtype, registry, writer)
    report = ExportReport(str(out_dir), tied=tied)
    if writer:
        tensors, amaxes, side = _encode(entries, held_by_other, report)
        stored = {ct_format.module_of(n) for n in report.nvfp4}
        cfg["quantization_config"] = ct_format.quantization_config(sorted(set(linear_modules) - stored))
        report.files = ct_format.write_checkpoint(out_dir, tensors, amaxes, cfg, max_shard_bytes, side)
    if in_distributed_job():  # every rank returns the writer's report, once the files are there
        box = [report]
        dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        report = box[0]
        if not writer:
            report.files = []
    if verbose and writer:
        print(report)
    return report


def export_megatron_checkpoint(save_dir, out_dir, *, iteration: Optional[int] = None,
                               max_shard_bytes: int = ct_format.DEFAULT_SHARD_BYTES,
                               trusted: bool = False, verify: bool = True) -> ExportReport:  # fmt: skip
    """Export the weights of a Megatron checkpoint with NVFP4 weights under Megatron's parameter names
    (``decoder.layers.0.self_attention.linear_qkv.weight_packed``, ...): its fused linear_qkv and linear_fc1 each
    hold one amax, so one global scale. No architecture mapping is applied; the config.json holds only the
    quantization config, which targets the exported modules by name.

    Reads Megatron-LM's ``--ckpt-format torch`` (``iter_*/mp_rank_00/model_optim_rng.pt``, written by
    ``python -m fp4_dist.megatron.run``; tensor and pipeline parallel size 1) and the ``iter_*/model.pt`` of
    `examples/megatron_pretrain_gpt.py`. Megatron synchronises the parameter all-gather before it saves, so the
    weights there are the gathered ones.

    The files are read weights-only (`fp4_dist.checkpoint.safe_load.load_checkpoint_file`): ``model.pt`` may hold
    tensors and plain values (numbers, strings, tuples, dicts), ``model_optim_rng.pt`` also what megatron-core's own
    loader allows (`fp4_dist.megatron.safe_globals.megatron_checkpoint_globals`) and NVFP4 weights.

    Args:
        save_dir: the ``--save`` folder (with latest_checkpointed_iteration.txt) or one ``iter_*`` folder.
        iteration: which iteration of `save_dir` (default: the latest).
        trusted: unpickle the checkpoint in full, which runs any code it holds: only for a checkpoint you made
            or whose source you trust.
        verify: check the iteration folder's files against its manifest before reading them (the example
            trainer's checkpoints have one; Megatron's own format has none and is read with a note); False skips it.
    Raises:
        UnsafeCheckpointError (a ValueError) naming the file and what it asked for, when the checkpoint holds
        anything else; DamagedCheckpointError (a ValueError) naming a file whose bytes differ from the manifest;
        nothing is written then.
    """
    folder = _megatron_iteration_dir(Path(save_dir), iteration)
    if verify:
        verify_folder(folder)
    entries = _megatron_entries(folder, trusted)
    report = ExportReport(str(out_dir))
    tensors, amaxes, _ = _encode(entries, set(), report)
    if not report.nvfp4:  # the config would claim every Linear is NVFP4 and loaders would look for packed fields
        raise ValueError(f"export_megatron_checkpoint: {folder} holds no NVFP4 weights (was it saved by a run "
                         "without --fp4-param-gather?); nothing is written")
    targets = sorted(ct_format.module_of(n) for n in report.nvfp4)
    cfg = {"quantization_config": ct_format.quantization_config([], targets=targets),
           "fp4_dist_source": f"Megatron checkpoint {folder}"}  # fmt: skip
    report.files = ct_format.write_checkpoint(out_dir, tensors, amaxes, cfg, max_shard_bytes)
    return report


# ------------------------------------------------------------------------------------------------ internals
def _megatron_iteration_dir(root: Path, iteration: Optional[int]) -> Path:
    if re.fullmatch(r"mp_rank_\d+(_\d+)?", root.name):  # one rank's part: its iteration folder, if it is whole
        if len(list(root.parent.glob("mp_rank_*"))) > 1:
            raise ValueError(f"{root}: one tensor- or pipeline-parallel rank's part of a checkpoint holds slices of "
                             "the weights, which this export does not join; export a checkpoint of tensor and "
                             "pipeline parallel size 1")
        return root.parent
    if iteration is None and ((root / "model.pt").is_file() or any(root.glob("mp_rank_*"))):
        return root
    if iteration is None:
        latest = root / "latest_checkpointed_iteration.txt"
        if not latest.is_file():
            raise FileNotFoundError(f"{root}: neither a model.pt nor a latest_checkpointed_iteration.txt (pass the "
                                    "--save folder of fp4_dist's Megatron entry point)")
        iteration = int(latest.read_text().strip())
    folder = atomic.resolve(root / f"iter_{iteration:07d}")  # the earlier version while a re-save renames
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist")
    return folder


def _megatron_entries(folder: Path, trusted: bool) -> dict:
    """{name: NVFP4Entry | tensor} of one Megatron iteration folder (either format)."""
    if (folder / "model.pt").is_file():  # examples/megatron_checkpoint.py: packed fields as dicts
        entries = {}
        for name, v in load_checkpoint_file(folder / "model.pt", trusted=trusted).items():
            if isinstance(v, dict):
                dtype = getattr(torch, str(v["dtype"]).removeprefix("torch."))
                entries[name] = NVFP4Entry(v["rowwise_data"], v["rowwise_scale_inv"], v["amax"], dtype)
            else:
                entries[name] = v
        return entries
    ranks = sorted(folder.glob("mp_rank_*"))
    if len(ranks) != 1 or not (ranks[0] / "model_optim_rng.pt").is_file():
        raise ValueError(f"{folder}: expected one mp_rank_00/model_optim_rng.pt (Megatron's --ckpt-format torch at "
                         f"tensor and pipeline parallel size 1), found {[r.name for r in ranks]}: a tensor- or "
                         "pipeline-parallel checkpoint holds slices of the weights, which this export does not join")
    path = ranks[0] / "model_optim_rng.pt"
    state = load_checkpoint_file(path, megatron_checkpoint_globals(path), trusted=trusted)["model"]
    entries = {}
    for name, v in state.items():
        if is_nvfp4_tensor(v):
            entries[name] = NVFP4Entry(v.rowwise_data, v.rowwise_scale_inv, v.amax, v.dtype)
        elif isinstance(v, torch.Tensor):  # Megatron's _extra_state entries (None, bytes) are not weights
            entries[name] = v
    return entries


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a dict or have to_dict() (a transformers PretrainedConfig), got "
                    f"{type(config).__name__}")


def _model_entries(model: nn.Module, dense_dtype, registry, writer: bool):
    """({name: NVFP4Entry | tensor} in state-dict order, {dropped tied name: kept name}, names of nn.Linear
    modules, names of NVFP4 weights some non-linear module holds). A sharded model's tensors are gathered on every
    rank (collectives) and kept by the writer only."""
    linear_modules = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if registry is not None:
        return _fsdp_entries(model, registry, dense_dtype, writer) + (linear_modules, set())
    held_by_other = {pid for pid, owners in weight_owners(model).items()
                     if any(not isinstance(module, nn.Linear) for module, _, _ in owners)}  # fmt: skip
    entries, tied, seen, other = {}, {}, {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            tied[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        if is_nvfp4_tensor(t):
            entries[name] = NVFP4Entry(t.rowwise_data, t.rowwise_scale_inv, t.amax, t.dtype)
            if id(t) in held_by_other:
                other.add(name)
        else:
            entries[name] = t.detach() if dense_dtype is None else t.detach().to(dense_dtype)
    return entries, tied, linear_modules, other


def _fsdp_entries(model: nn.Module, registry, dense_dtype, writer: bool):
    """Entries of a `fully_shard_nvfp4` model: full masters (a collective per sharded tensor, kept on the host of
    the writer only), NVFP4 weights quantized as the FSDP2 cast does (with their shared amax, if any), one amax
    group at a time on the model's device."""
    from torch.distributed.tensor import DTensor


    states = registry.states
    model_dtype = next(iter(states.values())).model_dtype if states else None
    dense_dtype = dense_dtype or model_dtype
    full, device = {}, None
    for name, t in model.state_dict().items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        device = device or whole.device
        if writer:
            full[name] = whole.detach().cpu()
        del whole
    if not writer:
        return {}, {}
    quantized = quantize_members({n: (full[n], states[n]) for n in states}, device)
    entries = {}
    for name, t in full.items():
        if name in quantized:
            q = quantized[name]
            entries[name] = NVFP4Entry(q.rowwise_data, q.rowwise_scale_inv, q.amax, q.dtype)
        else:
            entries[name] = t.detach().to(dense_dtype) if t.is_floating_point() else t.detach()
    return entries, {}


def _encode(entries: dict, held_by_other: set, report: ExportReport):
    """Stored tensors, amaxes and side fields (of NVFP4 weights stored dense) of `entries`, filling `report`."""
    tensors, amaxes, side = {}, {}, {}
    for name, e in entries.items():
        if not isinstance(e, NVFP4Entry):
            tensors[name] = e.detach().cpu().contiguous()
            report.dense.append(name)
            continue
        data, scale_inv, amax = e.rowwise_data.cpu(), e.rowwise_scale_inv.cpu(), e.amax.detach().cpu()
        if name in held_by_other:
            tensors[name] = reference.dequantize(data, scale_inv, amax, e.dtype)
            side.update({f"{name}.rowwise_data": data.contiguous(), f"{name}.rowwise_scale_inv": scale_inv.contiguous(),
                         f"{name}.amax": amax.reshape(1).contiguous()})  # fmt: skip
            report.dense_nvfp4.append(name)
            report.dense.append(name)
            continue
        a = float(amax.reshape(-1)[0])
        g = choose_global_scale(a)
        module = ct_format.module_of(name)
        tensors.update(ct_format.packed_tensors(module, data, scale_inv, g.value))
        amaxes[name] = a
        report.nvfp4[name] = g
        if g.exact == "approx":
            n = _differing(data, tensors[f"{module}.weight_scale"], scale_inv, amax, g.value)
            if n:
                report.differing[name] = n
    report.fused_scales_differ = _fused_mismatches(report.nvfp4)
    return tensors, amaxes, side


def _differing(data, scale_e4m3, scale_inv, amax, g: float) -> int:
    """Elements whose bf16 decode by compressed-tensors differs from ours."""
    ours = reference.dequantize(data, scale_inv, amax, torch.bfloat16)
    theirs = ct_decode(data, scale_e4m3, g).to(torch.bfloat16)
    return int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())


def _fused_mismatches(scales: dict[str, GlobalScale]) -> list[tuple[str, ...]]:
    """The groups vLLM fuses among the exported weights whose global scales differ."""
    groups = sibling_groups([ct_format.module_of(n) for n in scales], VLLM_FUSED)
    return [g.members for g in groups if len({scales[m].value for m in g.members}) > 1]


def quantize_members(items: dict, device=None) -> dict:
    """{name: NVFP4Tensor on the host} of whole weights {name: (full master, FSDP2 `WeightState`)}, each group with
    its shared amax: the bytes FSDP2's shard cast writes. Each weight is quantized on `device` (default: where its
    master is), one at a time."""
    out, shared_of = {}, {}
    for name, (master, st) in items.items():
        g = st.amax_group
        shared = None
        if g is not None:
            if g not in shared_of:
                shared_of[g] = group_amax([items[m][0] for m in g.members], st.model_dtype)
            shared = shared_of[g]
        q = quantize(master.to(device or master.device), st.numerics, st.model_dtype, name=name,
                     amax=None if shared is None else shared.to(device or master.device))  # fmt: skip
        out[name] = q if q.rowwise_data.device.type == "cpu" else q.to("cpu")
    return out
