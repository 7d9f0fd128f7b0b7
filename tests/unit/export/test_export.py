"""fp4_dist.export in one process: a transformers Llama's NVFP4 weights out to compressed-tensors and back.

The loads go through transformers and compressed-tensors themselves (not a stand-in): the exported folder is
what `AutoModelForCausalLM.from_pretrained` reads."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import fp4_dist
from fp4_dist.export import (VLLM_FUSED, choose_global_scale, export_compressed_tensors, export_megatron_checkpoint,
                             load_compressed_tensors)  # fmt: skip
from fp4_dist.export import ct_format
from fp4_dist.checkpoint.manifest import MANIFEST

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig  # noqa: E402


def llama_config(tied=False, layers=2):
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)  # fmt: skip


def llama(seed=0, tied=False, shared=VLLM_FUSED, skip=("lm_head",)):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(tied), dtype=torch.bfloat16)
    with torch.no_grad():  # siblings of clearly different magnitudes: their own amaxes differ
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
            layer.mlp.up_proj.weight.mul_(1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp4_dist.convert_linear_weights(model, shared_amax=shared, skip=skip)
    return model


def hf_load(path, dequantize=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw)
    if not dequantize:  # compressed-tensors decompresses at the first forward
        with torch.no_grad():
            model(torch.zeros(1, 2, dtype=torch.long))
    return model


def nvfp4_params(model):
    return {n: p for n, p in model.named_parameters() if fp4_dist.is_nvfp4_tensor(p)}


FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax")


def bits(t):
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantize-at-load", "decompress-at-first-forward"])
def test_transformers_loads_the_trained_weights_bitwise_and_the_same_logits(tmp_path, dequantize):
    model = llama()
    report = export_compressed_tensors(model, tmp_path)
    assert report.exact and len(report.nvfp4) == 14 and not report.fused_scales_differ
    loaded = hf_load(tmp_path, dequantize)
    state = loaded.state_dict()
    for name, p in nvfp4_params(model).items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(bits(state[name]), bits(p.dequantize(torch.bfloat16))), name
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_config_and_tensor_names_follow_compressed_tensors(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    model = llama()
    export_compressed_tensors(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    q = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert q.format == "nvfp4-pack-quantized" and q.ignore == ["lm_head"]
    w = q.config_groups["group_0"].weights
    assert (w.num_bits, w.group_size, w.strategy, w.scale_dtype) == (4, 16, "tensor_group", torch.float8_e4m3fn)
    tensors, amaxes, _ = ct_format.read_checkpoint(tmp_path)
    p = model.model.layers[0].mlp.down_proj.weight
    stem = "model.layers.0.mlp.down_proj"
    assert tensors[f"{stem}.weight_packed"].dtype == torch.uint8
    assert torch.equal(tensors[f"{stem}.weight_packed"], p.rowwise_data)
    assert tensors[f"{stem}.weight_scale"].dtype == torch.float8_e4m3fn
    assert tensors[f"{stem}.weight_scale"].shape == (64, 128 // 16)
    assert torch.equal(tensors[f"{stem}.weight_scale"].view(torch.uint8), p.rowwise_scale_inv[:64, :8])
    assert tensors[f"{stem}.weight_global_scale"].dtype == torch.float32
    assert float(tensors[f"{stem}.weight_global_scale"]) == choose_global_scale(float(p.amax)).value
    assert amaxes[f"{stem}.weight"] == float(p.amax)
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_packed" not in tensors


def test_vllm_fused_groups_get_one_global_scale_only_with_shared_amax(tmp_path):
    shared = export_compressed_tensors(llama(shared=VLLM_FUSED), tmp_path / "a")
    own = export_compressed_tensors(llama(shared=()), tmp_path / "b")
    assert not shared.fused_scales_differ
    assert len(own.fused_scales_differ) == 4  # q/k/v and gate/up in each of 2 layers
    tensors, _, _ = ct_format.read_checkpoint(tmp_path / "a")
    for layer in range(2):
        stem = f"model.layers.{layer}.self_attn"
        gs = {float(tensors[f"{stem}.{p}.weight_global_scale"]) for p in ("q_proj", "k_proj", "v_proj")}
        assert len(gs) == 1
    assert "vLLM" in str(own)


def test_round_trip_gives_the_same_bytes(tmp_path):
    model = llama(seed=3)
    export_compressed_tensors(model, tmp_path)
    fresh = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.bfloat16)  # plain linears
    with pytest.warns(UserWarning, match="start at these 4-bit values"):
        report = load_compressed_tensors(fresh, tmp_path)
    assert len(report.nvfp4) == 14 and not report.derived_amax and not report.missing
    for name, p in nvfp4_params(model).items():
        q = fresh.get_parameter(name)
        assert fp4_dist.is_nvfp4_tensor(q), name
        for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
            assert torch.equal(getattr(q, f), getattr(p, f)), f"{name}.{f}"
    for name, t in model.state_dict().items():
        if not fp4_dist.is_nvfp4_tensor(t):
            assert torch.equal(fresh.state_dict()[name], t), name
    # into a model converted already: overwritten in place, storage kept
    other = llama(seed=9)
    before = other.model.layers[1].mlp.up_proj.weight.rowwise_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_compressed_tensors(other, tmp_path)
    assert other.model.layers[1].mlp.up_proj.weight.rowwise_data is before
    assert torch.equal(before, model.model.layers[1].mlp.up_proj.weight.rowwise_data)


def test_exporting_one_model_twice_writes_the_same_bytes(tmp_path):
    # safetensors writes its metadata (the format and fp4_dist's amaxes) in a hash map's order, which changes from
    # call to call; an export puts it in sorted order, so one checkpoint gives one set of file hashes
    model = llama(seed=4)
    files = []
    for i in range(6):
        export_compressed_tensors(model, tmp_path / str(i))
        files.append({f.name: f.read_bytes() for f in sorted((tmp_path / str(i)).rglob("*")) if f.is_file()})
    assert all(f == files[0] for f in files[1:])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "0" / ct_format.SINGLE_FILE), "pt") as f:  # the rewritten header reads
        assert f.metadata()["format"] == "pt" and len(json.loads(f.metadata()[ct_format.AMAX_METADATA])) == 14


def test_another_writers_checkpoint_gets_an_amax_that_decodes_alike(tmp_path):
    from safetensors.torch import load_file, save_file

    model = llama(seed=4)
    export_compressed_tensors(model, tmp_path)
    f = tmp_path / "model.safetensors"
    save_file(load_file(str(f)), str(f), metadata={"format": "pt"})  # no fp4_dist metadata
    (tmp_path / MANIFEST).unlink()  # nor a manifest: another writer's folder
    fresh = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = load_compressed_tensors(fresh, tmp_path)
    assert len(report.derived_amax) == 14
    loaded = hf_load(tmp_path)
    for name in report.derived_amax:
        ours = fresh.get_parameter(name)
        assert torch.equal(ours.rowwise_data, model.get_parameter(name).rowwise_data)
        if report.derived_amax[name] == 0:
            assert torch.equal(bits(ours.dequantize(torch.bfloat16)), bits(loaded.state_dict()[name])), name


def test_tile_inconsistent_scales_are_refused_naming_weight_and_tile(tmp_path):
    from safetensors.torch import load_file, save_file

    model = llama(seed=5)
    export_compressed_tensors(model, tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.1.mlp.up_proj.weight_scale"
    s = tensors[key].view(torch.uint8).clone()
    s[37, 2] = s[37, 2] ^ 1  # row 37 is in row band 2
    tensors[key] = s.view(torch.float8_e4m3fn)
    save_file(tensors, str(f), metadata={"format": "pt"})
    (tmp_path / MANIFEST).unlink()  # another writer's folder: no manifest
    fresh = llama(seed=6)
    before = {n: p.rowwise_data.clone() for n, p in nvfp4_params(fresh).items()}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: its scales are not constant "
                                         r"within 16x16 tile \(row band 2, column block 2\): row 37"):
        load_compressed_tensors(fresh, tmp_path)
    assert all(torch.equal(p.rowwise_data, before[n]) for n, p in nvfp4_params(fresh).items())


def test_tied_embeddings_are_stored_once_and_transformers_ties_them_again(tmp_path):
    model = llama(tied=True, skip=())
    assert fp4_dist.is_nvfp4_tensor(model.model.embed_tokens.weight)  # the tie survived the conversion
    report = export_compressed_tensors(model, tmp_path)
    assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert report.dense_nvfp4 == ["model.embed_tokens.weight"]
    loaded = hf_load(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(bits(loaded.model.embed_tokens.weight), bits(model.lm_head.weight.dequantize(torch.bfloat16)))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    back = llama(seed=8, tied=True, skip=())  # its packed fields come back from the side file, bytes and all
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_compressed_tensors(back, tmp_path)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    for f in FIELDS:
        assert torch.equal(getattr(back.lm_head.weight, f), getattr(model.lm_head.weight, f)), f


def test_large_models_are_sharded_with_an_index(tmp_path):
    model = llama(seed=7)
    report = export_compressed_tensors(model, tmp_path, max_shard_bytes=40_000)
    shards = [f for f in report.files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in report.files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    tensors, _, _ = ct_format.read_checkpoint(tmp_path)
    assert set(index["weight_map"]) == set(tensors)
    loaded = hf_load(tmp_path)
    for name, p in nvfp4_params(model).items():
        assert torch.equal(bits(loaded.state_dict()[name]), bits(p.dequantize(torch.bfloat16)))
    export_compressed_tensors(model, tmp_path)  # a second export into the folder replaces the shards
    assert sorted(f.name for f in tmp_path.glob("model*")) == ["model.safetensors"]


def approx_amax():
    g = torch.Generator().manual_seed(11)
    while True:
        a = float(torch.rand(1, generator=g).to(torch.bfloat16))
        if a > 0 and choose_global_scale(a).exact == "approx":
            return a


def test_a_weight_without_an_exact_global_scale_reports_its_differences_within_one_ulp(tmp_path):
    a = approx_amax()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    tile_mag = torch.rand(32, 16, generator=g).repeat_interleave(16, 0)
    with torch.no_grad():  # tiles of many magnitudes: most scale bytes appear
        w = model[0].weight
        w.copy_((torch.rand(512, 256, generator=g) * 2 - 1) * a * tile_mag.repeat_interleave(16, 1))
        w[0, 0] = a
    fp4_dist.convert_linear_weights(model)
    assert float(model[0].weight.amax) == a
    report = export_compressed_tensors(model, tmp_path)
    assert report.nvfp4["0.weight"].exact == "approx" and not report.exact
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    tensors, _, _ = ct_format.read_checkpoint(tmp_path)
    theirs = NVFP4PackedCompressor.decompress({k.split(".")[-1]: v for k, v in tensors.items()},
                                              preset_name_to_scheme("NVFP4A16", ["Linear"]))["weight"]  # fmt: skip
    ours = model[0].weight.dequantize(torch.bfloat16)
    differ = ours.view(torch.int16) != theirs.view(torch.int16)
    assert int(differ.sum()) == report.differing["0.weight"] > 0
    assert int((ours.view(torch.int16).int() - theirs.view(torch.int16).int()).abs().max()) == 1


def test_megatron_checkpoint_exports_under_megatron_names(tmp_path):
    from examples.megatron_checkpoint import model_state

    torch.manual_seed(0)
    net = torch.nn.Module()
    net.linear_qkv = torch.nn.Linear(64, 192, bias=False)
    net.linear_fc1 = torch.nn.Linear(64, 256, bias=False)
    net.norm = torch.nn.LayerNorm(64)
    net.to(torch.bfloat16)
    fp4_dist.convert_linear_weights(net)
    folder = tmp_path / "ckpt" / "iter_0000010"
    folder.mkdir(parents=True)
    torch.save(model_state(net), folder / "model.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")
    report = export_megatron_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert sorted(report.nvfp4) == ["linear_fc1.weight", "linear_qkv.weight"] and report.exact
    tensors, amaxes, cfg = ct_format.read_checkpoint(tmp_path / "out")
    assert cfg["quantization_config"]["config_groups"]["group_0"]["targets"] == ["linear_fc1", "linear_qkv"]
    assert torch.equal(tensors["linear_qkv.weight_packed"], net.linear_qkv.weight.rowwise_data)
    assert tensors["norm.weight"].dtype == torch.bfloat16
    back = torch.nn.Module()
    back.linear_qkv, back.linear_fc1, back.norm = (torch.nn.Linear(64, 192, bias=False), torch.nn.Linear(64, 256, bias=False),
                                                   torch.nn.LayerNorm(64))  # fmt: skip
    back.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_compressed_tensors(back, tmp_path / "out")
    for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
        assert torch.equal(getattr(back.linear_fc1.weight, f), getattr(net.linear_fc1.weight, f))
    # a checkpoint of a bf16 run: its config claimed every Linear was NVFP4
    torch.save(model_state(back.norm), folder / "model.pt")
    with pytest.raises(ValueError, match="holds no NVFP4 weights .*without --fp4-param-gather"):
        export_megatron_checkpoint(tmp_path / "ckpt", tmp_path / "out-bf16")
    assert not (tmp_path / "out-bf16").exists()


def test_a_model_without_nvfp4_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no NVFP4 weights"):
        export_compressed_tensors(torch.nn.Linear(16, 16), tmp_path)


@pytest.mark.gpu
def test_an_export_from_cuda_weights_equals_the_cpu_export(tmp_path):
    model = llama(seed=12)
    export_compressed_tensors(model, tmp_path / "cpu")
    export_compressed_tensors(model.cuda(), tmp_path / "cuda")
    a, amax_a, _ = ct_format.read_checkpoint(tmp_path / "cpu")
    b, amax_b, _ = ct_format.read_checkpoint(tmp_path / "cuda")
    assert amax_a == amax_b and set(a) == set(b)
    assert all(torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8)) for n in a)
    back = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.bfloat16).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_compressed_tensors(back, tmp_path / "cuda")
    for name, p in nvfp4_params(model).items():
        q = back.get_parameter(name)
        assert q.rowwise_data.is_cuda and all(torch.equal(getattr(q, f), getattr(p, f)) for f in FIELDS)


@pytest.mark.parametrize("damage", ["truncated", "corrupted-header", "missing-shard", "bad-config"])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_nothing_is_loaded(tmp_path, damage):
    export_compressed_tensors(llama(seed=5), tmp_path, max_shard_bytes=40_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "corrupted-header":
        data = bytearray(shard.read_bytes())
        data[8:24] = b"\xff" * 16  # inside the JSON header: invalid UTF-8
        shard.write_bytes(bytes(data))
    elif damage == "missing-shard":
        shard.unlink()
    else:
        shard = tmp_path / "config.json"
        shard.write_text(shard.read_text()[:-20])
    model = llama(seed=6)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises((ct_format.DamagedCheckpointError, FileNotFoundError)) as e:
        load_compressed_tensors(model, tmp_path)
    assert shard.name in str(e.value) and "othing was loaded" in str(e.value), str(e.value)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_what_transformers_and_load_compressed_tensors_return_for_each_model_dtype(tmp_path, dtype):
    """docs/export.md's table: compressed-tensors decodes NVFP4 into bf16 for every model dtype."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(layers=1), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp4_dist.convert_linear_weights(model, skip=("lm_head",))
        export_compressed_tensors(model, tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True))
        lazy = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
        fresh = AutoModelForCausalLM.from_config(llama_config(layers=1), dtype=dtype)
        load_compressed_tensors(fresh, tmp_path)
    for name, p in nvfp4_params(model).items():
        got = loaded.state_dict()[name]
        assert got.dtype == dtype
        assert torch.equal(got, p.dequantize(torch.bfloat16).to(dtype)), name  # the bf16 rounding, every dtype
        assert torch.equal(got, p.dequantize(dtype)) == (dtype == torch.bfloat16), name
        for f in FIELDS:
            assert torch.equal(getattr(fresh.get_parameter(name), f), getattr(p, f)), f"{name}.{f}"
    if dtype == torch.bfloat16:
        with torch.no_grad():
            lazy(torch.zeros(1, 2, dtype=torch.long))
    else:
        with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
            lazy(torch.zeros(1, 2, dtype=torch.long))
