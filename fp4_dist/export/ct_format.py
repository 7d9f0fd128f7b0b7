"""compressed-tensors' ``nvfp4-pack-quantized`` checkpoint format, as fp4_dist writes and reads it.

A Hugging Face checkpoint folder: ``config.json`` with a ``quantization_config`` and the tensors in safetensors
files (one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json``). An NVFP4 linear weight ``<module>.weight`` [M, K] is stored as

    <module>.weight_packed        uint8 [M, K/2]       E2M1 codes, even column in the low nibble: our rowwise_data
    <module>.weight_scale         float8_e4m3fn [M, K/16]   1x16 block scales: our tile scales, each on its 16 rows
    <module>.weight_global_scale  float32 [1]          g: the decoder computes code * fp32(scale / g)

(read from compressed-tensors 0.20's ``NVFP4PackedCompressor`` and its TENSOR_GROUP dequantize). Every other
tensor keeps its name and dtype. fp4_dist also writes each NVFP4 weight's fp32 amax into the safetensors
metadata (``fp4_dist.amax``: {name: float.hex}), which loaders ignore and `read_checkpoint` uses to give back the
same amax bytes.

The folder also holds ``fp4_dist_manifest.json`` (a digest of every file, `fp4_dist.checkpoint.manifest`), which
loaders ignore and `read_checkpoint` checks before it reads a tensor.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator, Mapping, Optional

import torch

from ..checkpoint import atomic
from ..checkpoint.manifest import MANIFEST, DamagedCheckpointError, verify_folder
from ..format import TILE, ceil_div

FORMAT = "nvfp4-pack-quantized"
SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
AMAX_METADATA = "fp4_dist.amax"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SIDE_FILE = "fp4_dist/dense_nvfp4.safetensors"
"""Packed fields of NVFP4 weights stored dense (a tied embedding), for an exact load back. In a subfolder, so
that loaders which read every *.safetensors of the checkpoint folder do not see it."""
DEFAULT_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default largest shard ("5GB")."""


def _require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - the [export] extra installs it
        raise ImportError("fp4_dist.export needs the safetensors package: pip install 'fp4_dist[export]' "
                          "(safetensors, compressed-tensors, transformers)") from e
    return st


def module_of(weight_name: str) -> str:
    """'a.b.weight' -> 'a.b' (compressed-tensors names a layer's tensors after its module)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"an NVFP4 weight is exported under its module's name, so it must be named "
                         f"'<module>.weight'; got {weight_name!r}")
    return weight_name[: -len(".weight")]


def quantization_config(ignore: list[str], targets: Optional[list[str]] = None) -> dict:
    """The ``quantization_config`` of weight-only NVFP4 (compressed-tensors' NVFP4A16 scheme), packed."""
    return {
        "config_groups": {
            "group_0": {
                "targets": targets or ["Linear"],
                "weights": {
                    "num_bits": 4, "type": "float", "symmetric": True, "group_size": TILE,
                    "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn",
                },
                "input_activations": None,
                "output_activations": None,
                "format": FORMAT,
            }
        },
        "format": FORMAT,
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


def packed_tensors(module: str, rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor,
                   global_scale: float) -> dict[str, torch.Tensor]:  # fmt: skip
    """The three stored tensors of one NVFP4 weight (CPU, contiguous): codes and scales exactly as held."""
    m, k = rowwise_data.shape[0], rowwise_data.shape[1] * 2
    scale = rowwise_scale_inv[:m, : ceil_div(k, TILE)].detach().cpu().contiguous().view(torch.float8_e4m3fn)
    return {
        f"{module}.weight_packed": rowwise_data.detach().cpu().contiguous(),
        f"{module}.weight_scale": scale,
        f"{module}.weight_global_scale": torch.tensor([global_scale], dtype=torch.float32),
    }


def write_checkpoint(out_dir, tensors: Mapping[str, torch.Tensor], amaxes: Mapping[str, float], config: dict,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     side_fields: Optional[Mapping[str, torch.Tensor]] = None) -> list[str]:  # fmt: skip
    """Write `tensors` (name -> CPU tensor, in order) as safetensors files in `out_dir` and `config` as its
    config.json; the amax of each NVFP4 weight goes into the metadata of the file that holds its codes, and
    `side_fields` ({weight.field: tensor} of NVFP4 weights stored dense) into `SIDE_FILE`.

    The folder is committed whole (`fp4_dist.checkpoint.atomic.commit_folder`): written beside `out_dir`, flushed and
    renamed into place, so a process stopped at any point leaves the earlier export or this one, never a mixture.
    Raises ValueError, before writing, when `out_dir` holds files an export does not write (`foreign_files`).
    Returns the file names written."""
    st = _require_safetensors()
    shards = list(_shards(tensors, max_shard_bytes))
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    with atomic.commit_folder(out_dir, foreign=foreign_files) as out:
        for fname, shard in zip(names, shards):
            mine = {w: a for w, a in amaxes.items() if f"{module_of(w)}.weight_packed" in shard}
            meta = {"format": "pt", AMAX_METADATA: json.dumps({w: float(a).hex() for w, a in mine.items()})}
            save_safetensors(st, shard, out.file(fname), meta)
            weight_map.update({n: fname for n in shard})
        if len(names) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            out.file(INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                       indent=2, sort_keys=True))  # fmt: skip
        out.file(CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        if side_fields:
            save_safetensors(st, dict(side_fields), out.file(SIDE_FILE), {"format": "pt"})
    return names + ([INDEX_FILE] if len(names) > 1 else []) + [CONFIG_FILE] + ([SIDE_FILE] if side_fields else [])


def save_safetensors(st, tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str]) -> None:
    """`tensors` with `metadata` as the safetensors file `path`, the same bytes for the same inputs: safetensors
    writes the metadata in its hash map's order, which changes from call to call (two exports of one checkpoint
    would differ), so the header is rewritten in place with the metadata's keys sorted (the same length: the tensors'
    offsets follow it; nothing of the tensors is read or held)."""
    st.save_file(dict(tensors), str(path), metadata=dict(metadata))
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        if "__metadata__" not in header:
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= n:  # else escaped otherwise than safetensors does: its own order stays
            f.seek(8)
            f.write(text + b" " * (n - len(text)))


def foreign_files(folder: Path) -> list[str]:
    """Entries of `folder` that no export writes (an export replaces the whole folder, so it refuses these)."""
    side_dir = SIDE_FILE.split("/")[0]
    ours = {SINGLE_FILE, INDEX_FILE, CONFIG_FILE, MANIFEST}
    found = []
    for p in sorted(folder.iterdir()):
        if p.name == side_dir and p.is_dir():
            found += [f"{side_dir}/{q.name}" for q in sorted(p.iterdir()) if f"{side_dir}/{q.name}" != SIDE_FILE]
        elif not (p.name in ours or _SHARD_NAME.fullmatch(p.name)) or not p.is_file():
            found.append(p.name)
    return found


_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _checkpoint_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("model*.safetensors"))


def _shards(tensors: Mapping[str, torch.Tensor], limit: int) -> Iterator[dict]:
    """Consecutive groups of at most `limit` bytes (a larger tensor alone); a weight's three tensors stay together
    so its amax metadata sits with it."""
    shard, size = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        starts_weight = not name.endswith(("weight_scale", "weight_global_scale"))
        if shard and starts_weight and size + nbytes > limit:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def _read_file(path: Path, read):
    """`read(path)`, with any failure to read a checkpoint file (safetensors' header and size errors, bad JSON, an
    unreadable file) raised as `DamagedCheckpointError` naming the file."""
    try:
        return read(path)
    except Exception as e:  # safetensors' SafetensorError, OSError, JSON and UTF-8 errors
        raise DamagedCheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                                     "corrupt. Nothing was loaded") from e


def read_side_fields(folder) -> dict[str, torch.Tensor]:
    """`SIDE_FILE`'s {weight.field: tensor}, empty when absent."""
    path = Path(folder) / SIDE_FILE
    return _read_file(path, lambda p: _require_safetensors().load_file(str(p))) if path.is_file() else {}


def _read_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    amaxes = {w: float.fromhex(h) for w, h in json.loads(meta.get(AMAX_METADATA, "{}")).items()}
    return _require_safetensors().load_file(str(path)), amaxes


def read_checkpoint(folder, *, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, float], dict]:
    """(tensors by name, fp4_dist amaxes by weight name (empty for other writers), config.json as a dict).

    Raises FileNotFoundError when the folder holds no checkpoint or its index names a shard that is not there, and
    `DamagedCheckpointError` naming a file that cannot be read, or (unless `verify` is False) whose bytes differ
    from the folder's manifest, with the first bad offset; every file is checked and read before anything is
    returned. A folder without a manifest (another writer's, or an export from before manifests) is read with a
    one-line note that it is unverified.
    A folder missing because an export into it was stopped mid-commit is read from its complete earlier version
    (`fp4_dist.checkpoint.atomic.resolve`, with a warning)."""
    _require_safetensors()
    folder = atomic.resolve(folder)
    if verify and folder.is_dir():
        verify_folder(folder)
    files = _checkpoint_files(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        named = sorted(set(_read_file(index, lambda p: json.loads(p.read_text())["weight_map"].values())))
        absent = [n for n in named if not (folder / n).is_file()]
        if absent:
            raise FileNotFoundError(f"{folder}: {INDEX_FILE} names shard(s) that are not there: {', '.join(absent)}; "
                                    "nothing was loaded")
        files = [folder / n for n in named]
    if not files:
        raise FileNotFoundError(f"{folder}: no model*.safetensors file (a compressed-tensors checkpoint folder was "
                                "expected)")
    tensors, amaxes = {}, {}
    for f in files:
        shard, shard_amaxes = _read_file(f, _read_shard)
        tensors.update(shard)
        amaxes.update(shard_amaxes)
    cfg_path = folder / CONFIG_FILE
    config = _read_file(cfg_path, lambda p: json.loads(p.read_text())) if cfg_path.is_file() else {}
    return tensors, amaxes, config


def nvfp4_modules(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Modules stored as packed NVFP4 (those with a ``weight_packed``), in file order."""
    return [n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")]


def check_format(config: dict, folder) -> None:
    """Refuse a checkpoint whose quantization config is not NVFP4 weights in 16-element groups."""
    q = config.get("quantization_config")
    if q is None:
        return  # no config.json (a bare tensor folder): the tensor names say what is packed
    fmt = q.get("format")
    groups = q.get("config_groups", {})
    bad = [name for name, g in groups.items()
           if (g.get("format") or fmt) != FORMAT or (g.get("weights") or {}).get("group_size") != TILE]
    if fmt != FORMAT and not groups or bad:
        raise ValueError(f"{os.fspath(folder)}: quantization format {fmt!r} (groups {bad or list(groups)}) is not "
                         f"{FORMAT!r} with group_size {TILE}; fp4_dist reads NVFP4 weights only")
