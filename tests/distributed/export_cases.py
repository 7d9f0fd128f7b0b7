"""Train, then export: the cases of tests/distributed/test_export.py, each its own torchrun job on gloo ranks.

    torchrun --nproc-per-node 2 tests/distributed/export_cases.py CASE DIR

A small transformers Llama trained with NVFP4 weights, exported to compressed-tensors, and read back with
transformers (`from_pretrained`) and with `load_compressed_tensors`. Each rank prints ``RESULT <rank> <outcome>``.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import fp4_dist
from fp4_dist.export import VLLM_FUSED, export_compressed_tensors, load_compressed_tensors
from fp4_dist.export import ct_format
from fp4_dist.launch import init_distributed, shutdown
from fp4_dist.optim import Zero1Optimizer
from rank_results import say  # beside this script

STEPS = 20


def config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)  # fmt: skip


def llama(tied: bool, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(tied), dtype=dtype)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (4, 32), generator=g)


def train(model, opt, rank: int, steps: int = STEPS):
    for step in range(steps):
        ids = batch(rank, step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def hf_load(path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                    quantization_config=CompressedTensorsConfig(dequantize=True))


def check_hf_weights(loaded, nvfp4: dict, report) -> None:
    """Every exported NVFP4 weight decodes in transformers to the trained weight's dequantize: bitwise, or in the
    elements the report counts, by one bf16 ulp."""
    state = loaded.state_dict()
    for name, w in nvfp4.items():
        ours = w.dequantize(torch.bfloat16).view(torch.int16).int()
        theirs = state[name].view(torch.int16).int()
        n, worst = int((ours != theirs).sum()), int((ours - theirs).abs().max())
        if n != report.differing.get(name, 0) or worst > 1:
            raise AssertionError(f"{name}: {n} elements differ (report: {report.differing.get(name, 0)}), "
                                 f"by up to {worst} bf16 ulps")


def case_zero1_llama(rank, size, out: Path):
    model = llama(tied=True, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp4_dist.convert_linear_weights(model, shared_amax=VLLM_FUSED)
    opt = Zero1Optimizer(model.named_parameters(), lambda groups: torch.optim.AdamW(groups, lr=3e-3))
    train(model, opt, rank)
    report = export_compressed_tensors(model, out)
    if report.fused_scales_differ:
        raise AssertionError(f"fused groups with different global scales: {report.fused_scales_differ}")
    if rank != 0:
        return
    nvfp4 = {n: p for n, p in model.named_parameters() if fp4_dist.is_nvfp4_tensor(p)}
    loaded = hf_load(out)
    if loaded.lm_head.weight is not loaded.model.embed_tokens.weight:
        raise AssertionError("transformers did not tie lm_head to the embedding")
    check_hf_weights(loaded, {n: w for n, w in nvfp4.items() if n != "model.embed_tokens.weight"}, report)
    ids = batch(0, STEPS)
    with torch.no_grad():
        a, b = model(ids).logits, loaded(ids).logits
    if report.exact and not torch.equal(a, b):
        raise AssertionError(f"logits differ by up to {float((a.float() - b.float()).abs().max())}")
    fresh = llama(tied=True, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp4_dist.convert_linear_weights(fresh, shared_amax=VLLM_FUSED)
        load_compressed_tensors(fresh, out)
    for name, w in nvfp4.items():
        q = fresh.get_parameter(name)
        for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
            if not torch.equal(getattr(q, f), getattr(w, f)):
                raise AssertionError(f"round trip changed {name}.{f}")


def fsdp_llama(shared: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fp4_dist.fsdp import fully_shard_nvfp4

    model = llama(tied=False, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fully_shard_nvfp4(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                          shard_modules=list(model.model.layers), shared_amax=VLLM_FUSED if shared else ())
    return model


def case_fsdp_train_save(rank, size, out: Path):
    import torch.distributed.checkpoint as dcp

    from fp4_dist.fsdp import nvfp4_weights, precompute_nvfp4

    model = fsdp_llama(shared=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, opt, rank, steps=5)
    precompute_nvfp4(model)
    for m in [*model.model.layers, model]:
        m.unshard()
    trained = {n: {f: getattr(w, f).clone() for f in ("rowwise_data", "rowwise_scale_inv", "amax")}
               for n, w in nvfp4_weights(model).items()}  # fmt: skip
    for m in [*model.model.layers, model]:
        m.reshard()
    if rank == 0:
        torch.save(trained, out / "trained.pt")
    dcp.save(model.state_dict(), checkpoint_id=str(out / "dcp"))
    report = export_compressed_tensors(model, out / f"export{size}")
    if report.fused_scales_differ or len(report.nvfp4) != 15:
        raise AssertionError(f"{len(report.nvfp4)} NVFP4 weights, fused groups differing: "
                             f"{report.fused_scales_differ}")


def case_fsdp_load_export(rank, size, out: Path):
    import torch.distributed.checkpoint as dcp

    model = fsdp_llama(shared=True)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(out / "dcp"))
    report = export_compressed_tensors(model, out / f"export{size}")
    trained = torch.load(out / "trained.pt")
    tensors, amaxes, _ = ct_format.read_checkpoint(out / f"export{size}")
    at_two, _, _ = ct_format.read_checkpoint(out / "export2")
    if set(tensors) != set(at_two) or any(not torch.equal(tensors[n].view(-1).view(torch.uint8),
                                                          at_two[n].view(-1).view(torch.uint8)) for n in tensors):  # fmt: skip
        raise AssertionError("the export at 1 rank from the DCP checkpoint differs from the export at 2 ranks")
    if set(trained) != set(report.nvfp4):
        raise AssertionError(f"exported {sorted(report.nvfp4)}, trained {sorted(trained)}")
    for name, f in trained.items():
        stem = ct_format.module_of(name)
        m, k = f["rowwise_data"].shape[0], f["rowwise_data"].shape[1] * 2
        same = (torch.equal(tensors[f"{stem}.weight_packed"], f["rowwise_data"])
                and torch.equal(tensors[f"{stem}.weight_scale"].view(torch.uint8), f["rowwise_scale_inv"][:m, :k // 16])
                and amaxes[name] == float(f["amax"]))  # fmt: skip
        if not same:
            raise AssertionError(f"{name}: the exported codes, scales or amax are not the trained ones")
    loaded = hf_load(out / f"export{size}")
    from fp4_dist.tensor import NVFP4Tensor

    nvfp4 = {n: NVFP4Tensor(tuple(loaded.get_parameter(n).shape), torch.bfloat16, f["rowwise_data"],
                            f["rowwise_scale_inv"], f["amax"]) for n, f in trained.items()}  # fmt: skip
    check_hf_weights(loaded, nvfp4, report)


def main() -> None:
    info = init_distributed("gloo")
    case, out = sys.argv[1], Path(sys.argv[2])
    try:
        globals()[f"case_{case}"](info.rank, info.world_size, out)
        outcome = "OK"
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on anything but OK
        outcome = f"{type(e).__name__} {e} | {traceback.format_exc().splitlines()[-3:]}"
    say(info.rank, outcome)
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
