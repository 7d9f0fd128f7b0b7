"""fully_shard_nvfp4: PyTorch FSDP2 with NVFP4 linear weights all-gathered in 4 bits.

    report = fp4_dist.fsdp.fully_shard_nvfp4(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                                              shard_modules=list(model.layers))

makes every eligible linear weight an `NVFP4Master` parameter (its fp32 master), calls torch's ``fully_shard`` on
each module of ``shard_modules`` and then on ``model``, and installs what keeps the gathered bytes equal to
``quantize(full master)``: before each forward of ``model`` whose masters changed (an optimizer step, a load,
an init), one cast of every weight's local rows with one amax all-reduce (`precompute.ShardCast`). The cast's
non-finite verdict travels as a pinned byte and is read after the forward is queued (no host wait before it):
a forward whose weights were cast from a non-finite master raises there, on every rank, instead of returning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..format import DEFAULT_NUMERICS, TILE, check_numerics, whole_bands
from ..cast.collectives import reduce_scatter_ordered
from ..shared_amax import check_patterns, group_of, sibling_groups
from ..tensor import NVFP4Tensor
from ..cast.core import DeferredCheck
from ..compute.fp8_param import allocated
from ..compute.linear import NVFP4Linear, ready_for_compile
from ..compute.modes import DEFAULT, MODES, ComputeMode, mode_named, prepare
from ..convert import ConversionReport, skipped_linears, warn_shared_amax, weight_owners
from . import dequant_batch, wire
from .master import NVFP4Master, WeightState, local_master
from .precompute import ShardCast


@dataclass
class FSDPReport(ConversionReport):
    """The conversion report (`fp4_dist.ConversionReport`: converted, kept in high precision, what the GEMMs read)
    with how each linear weight of the model is all-gathered."""

    bf16_gather: dict[str, str] = field(default_factory=dict)
    """NVFP4 weights whose shards are not whole 16-row tile bands: gathered in bf16, quantized after the gather
    (same bytes, 2 B per element on the wire), with the reason."""
    world_size: int = 1

    @property
    def nvfp4(self) -> list[str]:
        """Weights gathered as packed E2M1 bytes + tile scales (0.504 B per element)."""
        return [f for f in self.converted if f not in self.bf16_gather]

    @property
    def kept(self) -> dict[str, str]:
        """Linear weights left in high precision, with the reason (`skipped`)."""
        return self.skipped

    def gathered_bytes_per_element(self, model: nn.Module) -> dict[str, float]:
        """All-gather bytes per weight element: {"nvfp4": the weights gathered as NVFP4 (packed data + tile
        scales), "all NVFP4 weights": those and the ones gathered in bf16, "bf16": 2.0, for reference}."""
        sums = {"nvfp4": [0, 0], "all": [0, 0]}
        for st in _registry(model).states.values():
            m, k = st.shape
            nbytes = wire.gathered_bytes(st.shape, st.mode)
            for key in ("nvfp4", "all") if st.mode == "nvfp4" else ("all",):
                sums[key][0] += nbytes
                sums[key][1] += m * k
        return {"nvfp4": sums["nvfp4"][0] / max(sums["nvfp4"][1], 1),
                "all NVFP4 weights": sums["all"][0] / max(sums["all"][1], 1), "bf16": 2.0}

    def __str__(self) -> str:
        lines = [f"fp4_dist.fsdp: {len(self.nvfp4)} weights gathered as NVFP4, {len(self.bf16_gather)} NVFP4 weights "
                 f"gathered in bf16, {len(self.kept)} kept in high precision (FSDP world size {self.world_size})"]
        lines += self.compute_lines()
        lines += [f"  bf16 gather {n}: {why}" for n, why in self.bf16_gather.items()]
        lines += [f"  kept {n}: {why}" for n, why in self.kept.items()]
        return "\n".join(lines)


def fully_shard_nvfp4(
    model: nn.Module,
    *,
    mesh=None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    shard_modules: Iterable[nn.Module] = (),
    reshard_after_forward: bool = True,
    numerics: str = DEFAULT_NUMERICS,
    skip: Sequence[str] = (),
    ordered_grad_reduction: bool = False,
    shared_amax: Sequence[Sequence[str]] = (),
    compute: str = DEFAULT,
    verbose: bool = False,
) -> FSDPReport:
    """Shard `model` with FSDP2, its linear weights all-gathered as NVFP4 (see the module docstring).

    Args:
        model: the unsharded model (on its device, or on "meta"). Linear weights may be plain or NVFP4Tensor
            parameters (`fp4_dist.convert_linear_weights`); the fp32 masters start from their values.
        mesh, mp_policy, reshard_after_forward: passed to torch's ``fully_shard``. The NVFP4 weights compute in
            ``mp_policy.param_dtype`` (bf16 is usual), or in their master's dtype if it is None; masters are
            rounded to that dtype before quantization.
        shard_modules: submodules to shard on their own first (e.g. the transformer blocks), as with
            ``fully_shard``; ``model`` is always sharded last, as the root.
        numerics: NVFP4 block-scale formula ("te" or "te-2.14").
        skip: module names (as in ``named_modules``) whose weight stays in high precision; a module holding
            linears (a block) keeps all of them. An entry that names no linear raises ValueError.
        ordered_grad_reduction: reduce-scatter gradients as an all-to-all and a sum in rank order, so the
            result is bitwise the same for every world size (as a single process summing the ranks' gradients).
        shared_amax: sibling linears whose weights share one amax (`fp4_dist.shared_amax`), e.g.
            ``fp4_dist.export.VLLM_FUSED``; groups already on NVFP4 weights (`convert_linear_weights`) are kept.
            Every member must be gathered as NVFP4 (a bf16-gathered weight is quantized alone after its gather).
        compute: what the NVFP4 weights' GEMMs read (a name in `fp4_dist.compute.modes.MODES`): "bf16" (their
            dequantized values, the unsharded parameter a bf16 tensor), "fp8" (the FP8 compute mode: the unsharded
            parameter is the FP8 block copy of the gathered bytes, `fp4_dist.compute.fp8_param.Fp8Param`, 1 byte
            per weight; cuBLAS's block-scaled GEMMs on Hopper, emulated on the CPU; docs/fp8.md) or "nvfp4" (the
            NVFP4 training recipe, `fp4_dist.compute.nvfp4`: the unsharded parameter is an NVFP4Tensor on the
            gathered bytes, with the recipe's defaults; docs/nvfp4_recipe.md). A plain nn.Linear computing in
            a mode becomes an `NVFP4Linear`. Layers converted with ``convert_linear_weights(compute=...)``
            compute in their mode whatever this says (there, ``options=`` sets the nvfp4 recipe).
        verbose: print the report.
    Returns:
        `FSDPReport`; weights gathered in bf16 or kept in high precision are also named in one warning.
    Raises:
        ValueError if `model` is already sharded (call this instead of ``fully_shard``, not after it), or for an
        unknown `compute`; RuntimeError, before sharding anything, if a weight is to compute in FP8 on a GPU
        whose FP8 block-scaled GEMMs torch does not reach (the FP8 mode needs a Hopper GPU, sm_90), saying so.
    """
    check_numerics(numerics)
    mode_named(compute, "fully_shard_nvfp4")
    for name in {compute} | {getattr(m, "fp4_compute", DEFAULT) for m in model.modules()}:
        if name != DEFAULT and MODES[name].fsdp_unsharded is None:  # its linears would get dequantized values
            raise ValueError(f"fully_shard_nvfp4: the {name} compute mode has no FSDP2 unsharded weight; "
                             f"shard with compute={DEFAULT!r}, or train it with convert_linear_weights")
        _prepare(MODES[name], model, mesh)
    if isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("fully_shard_nvfp4: this model is already sharded (DTensor parameters); call "
                         "fp4_dist.fsdp.fully_shard_nvfp4 on the unsharded model instead of torch's fully_shard")
    if mesh is None and not dist.is_initialized():
        # What torch's fully_shard does without a mesh (it makes the default process group from the launcher's
        # environment), done first: the NVFP4 layout needs the world size the weights are sharded over.
        dist.init_process_group()
    world = mesh.size(mesh.ndim - 1) if mesh is not None else dist.get_world_size()
    report = FSDPReport(world_size=world, compute=compute)
    patterns = check_patterns(shared_amax) if shared_amax else ()
    states, groups = {}, {}
    holders = weight_owners(model)
    skip = skipped_linears(model, skip, "fully_shard_nvfp4")
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            carried = group_of(module.weight)
            st = _convert(name, module, world, mp_policy, numerics, skip, report, compute, holders)
            if st is not None:
                states[st.fqn] = st
                if carried is not None:
                    groups[st.fqn] = carried
    siblings = sibling_groups([fqn[: -len(".weight")] for fqn in states], patterns)
    if patterns:
        looked_at = {f[: -len(".weight")]: why for f, why in [*((f, None) for f in states), *report.kept.items()]}
        warn_shared_amax("fully_shard_nvfp4", looked_at, patterns, bool(siblings), stacklevel=3)
    for g in siblings:
        groups.update({m: g for m in g.members})
    _set_amax_groups(states, groups)
    shard_modules = list(shard_modules)
    kw = dict(mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for sub in shard_modules:
        fully_shard(sub, **kw)
    fully_shard(model, **kw)
    if ordered_grad_reduction:
        for fsdp_module in [*shard_modules, model]:
            fsdp_module.set_custom_reduce_scatter(OrderedReduceScatter())
    _install(model)
    if report.bf16_gather or report.kept:
        warnings.warn(str(report), stacklevel=2)
    if verbose:
        print(report)
    return report


def _set_amax_groups(states: dict, groups: dict) -> None:
    for fqn, g in groups.items():
        absent = [m for m in g.members if m not in states]
        bf16 = [m for m in g.members if m in states and states[m].mode != "nvfp4"]
        if absent or bf16:
            why = (f"{absent} are not NVFP4 weights here" if absent else
                   f"{bf16} are gathered in bf16 (their rows do not split into whole 16-row bands per rank)")
            raise ValueError(f"fully_shard_nvfp4: the weights {g} share one amax, but {why}; every member of an "
                             "amax group must be an NVFP4-gathered weight")
        states[fqn].amax_group = g


def _prepare(mode: ComputeMode, model: nn.Module, mesh) -> None:
    """Run `mode`'s device check where `model`'s weights will compute (`modes.prepare`), raising RuntimeError with
    its sentence if it does not run there: the mesh's device type (fully_shard moves the parameters there), or
    without a mesh the one fully_shard's default mesh takes (CUDA where present), at the current device."""
    if mesh is not None:
        kind = mesh.device_type
    else:
        kind = "cuda" if torch.cuda.is_available() else next((p.device.type for p in model.parameters()), "cpu")
    if kind == "meta":
        return
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    why = prepare(mode, [device])
    if why is not None:
        raise RuntimeError(f"fully_shard_nvfp4: {why}; use compute={DEFAULT!r} (and layers converted with "
                           f"compute={DEFAULT!r})")


def _keep(fqn: str, w: torch.Tensor, holders: dict, report: FSDPReport, why: str) -> None:
    """Leave weight `fqn` in high precision. One converted before (an NVFP4Tensor, which FSDP2 cannot shard)
    becomes a plain parameter of its NVFP4 values, in every module that holds it (`holders`:
    `convert.weight_owners`, which then knows the new parameter by the same holders)."""
    if isinstance(w, NVFP4Tensor):
        plain = nn.Parameter(w.dequantize(w.dtype), requires_grad=w.requires_grad)
        for owner, attr, _ in holders[id(w)]:
            setattr(owner, attr, plain)
        holders[id(plain)] = holders[id(w)]
        why += f"; it was an NVFP4 weight, and computes on its NVFP4 values in {w.dtype} from here on"
    report.kept[fqn] = why


def _convert(name, module, world, mp_policy, numerics, skip, report, compute, holders) -> Optional[WeightState]:
    w = module.weight
    fqn = f"{name}.weight" if name else "weight"
    m, k = w.shape
    others = [f"{qual}.{attr}" if qual else attr for owner, attr, qual in holders[id(w)]
              if not (owner is module and attr == "weight")]  # fmt: skip
    if name in skip:
        return _keep(fqn, w, holders, report, "listed in skip")
    if others:
        # FSDP2 shards a shared parameter once for all its holders; an NVFP4 master in place of one holder's
        # parameter would untie them (two weights trained apart), and an embedding cannot read packed bytes.
        return _keep(fqn, w, holders, report, f"shared with {', '.join(others)} (a weight several modules hold "
                     "stays in high precision, tied)")
    if k % TILE:
        report.kept[fqn] = f"in_features = {k} is not a multiple of {TILE}"
        return
    if isinstance(w, NVFP4Tensor):
        master, numerics = w.dequantize(torch.float32), w.numerics
    else:
        master = w.detach().clone()
    model_dtype = mp_policy.param_dtype or master.dtype
    rows, rem = divmod(m, world)
    report.converted.append(fqn)
    if rem == 0 and whole_bands(0, rows):
        mode = "nvfp4"
    else:
        mode = "bf16"
        report.bf16_gather[fqn] = (f"M = {m} rows over {world} ranks is not a multiple of {TILE} rows per rank, "
                                   "so a 16x16 tile would span two ranks")
    layer_mode = getattr(module, "fp4_compute", DEFAULT)
    if compute != DEFAULT and layer_mode == DEFAULT:
        # A layer with a forward of its own may use its weight other than through F.linear: in a mode whose
        # unsharded weight is not the values, that would compute on a copy of them that autograd keeps until the
        # backward, not freed at the reshard.
        if type(module) is nn.Linear or type(module) is NVFP4Linear:
            layer_mode = compute
        else:
            report.not_in_mode[fqn] = (f"{type(module).__name__} keeps its own forward (a subclass of nn.Linear), "
                                       "which may use its weight other than through F.linear: it computes in "
                                       f"{DEFAULT}")  # fmt: skip
    state = WeightState(fqn, (m, k), mode, model_dtype, numerics, compute=layer_mode)
    if layer_mode != DEFAULT:
        report.compute = layer_mode
        report.in_mode.append(fqn)
        if type(module) is nn.Linear:  # its F.linear would compute on the values of an unsharded NVFP4Tensor
            ready_for_compile()
            module.__class__ = NVFP4Linear
        module.fp4_compute = layer_mode  # an NVFP4Linear says what its GEMMs read
    module.weight = nn.Parameter(NVFP4Master(master, state), requires_grad=w.requires_grad)
    return state


FORWARD_STOPPED = ("The forward that read the weights cast from it stops here, on every rank, before returning its "
                   "output; the masters are as they were: fix the cause (or load a checkpoint) and call the forward "
                   "again, which casts them again")


class _Registry:
    """The NVFP4 weights of one sharded model: the modules that hold them (their ``weight`` is the sharded master
    between steps, the unsharded bf16 value inside a forward) and their shared states."""

    def __init__(self, model: nn.Module):
        self.owners = [(fqn, module) for fqn, module in _weight_owners(model)]
        self.states = {fqn: local_master(module.weight).state for fqn, module in self.owners}
        self.cast: Optional[ShardCast] = None
        self.check: Optional[DeferredCheck] = None
        """The last cast's non-finite verdict while nobody has read it (`precompute(defer_check=True)`)."""
        self.batches = dequant_batch.bind([m for m in model.modules() if isinstance(m, FSDPModule)],
                                          _dequantized_state)

    def masters(self) -> list[tuple[str, torch.Tensor]]:
        out = [(fqn, module.weight) for fqn, module in self.owners]
        replaced = [fqn for fqn, p in out if isinstance(p, DTensor) and local_master(p) is None]
        if replaced:
            raise RuntimeError(
                f"fp4_dist.fsdp: {replaced[0]} is no NVFP4 master any more: its parameter was replaced by a plain "
                f"{type(dict(out)[replaced[0]]).__name__} (load_state_dict(..., assign=True) does this). Load into "
                "the masters instead: load_state_dict without assign, or torch.distributed.checkpoint.state_dict's "
                "set_model_state_dict")
        unsharded = [fqn for fqn, p in out if local_master(p) is None]
        if unsharded:
            raise RuntimeError(
                f"fp4_dist.fsdp: {unsharded[0]} is unsharded and a master changed since the last cast (an optimizer "
                "step, a load); the NVFP4 cast reads the sharded fp32 masters, so it runs between FSDP2's reshard "
                "and the next unshard. A forward begins with the cast: FSDP2 keeps a layer unsharded after a "
                "forward without a backward under reshard_after_forward=False (evaluation, several forwards per "
                "backward) and after a backward under set_reshard_after_backward(False); call reshard() on the "
                "model's FSDP modules before the next forward (or precompute_nvfp4)")
        return out

    def precompute(self, defer_check: bool = False) -> None:
        """Cast the masters that changed. `defer_check` (the root's pre-forward): the non-finite verdict is read by
        `after_forward`, once the forward is queued, so the host does not wait for the device before it."""
        self.resolve()
        if self.cast is not None and not self.cast.stale() and self._some_unsharded():
            # Layers FSDP2 kept unsharded (an evaluation forward under reshard_after_forward=False) hold what the
            # last cast gave, and no master changed since: nothing to cast.
            return
        params = self.masters()
        if self.cast is None or not self.cast.current_for(params):
            self.cast = ShardCast(params)
        if self.cast.stale():
            self.check = self.cast(defer_check=defer_check)

    def _some_unsharded(self) -> bool:
        return any(local_master(module.weight) is None for _, module in self.owners)

    def resolve(self) -> None:
        """Read the deferred verdict; if a master was not finite, mark the bytes stale and raise, naming it."""
        check, self.check = self.check, None
        if check is not None and not check.passed():
            self.cast.forget()
            check.resolve(" on some rank", FORWARD_STOPPED)

    def after_forward(self) -> None:
        """The root's post-forward, on every rank, before the output goes back to the caller."""
        self.resolve()
        dequant_batch.check_flushed(self.batches)


def _dequantized_state(p) -> Optional[WeightState]:
    """The state of NVFP4 weight `p` if its gathers are dequantized into a bf16 value (`dequant_batch`), else None
    (another parameter, or a weight whose GEMMs read its FP8 copy)."""
    state = getattr(local_master(p), "state", None)
    return state if state is not None and MODES[state.compute].fsdp_unsharded is None else None


def _weight_owners(model: nn.Module):
    for name, module in model.named_modules():
        if local_master(getattr(module, "weight", None)) is not None:
            yield (f"{name}.weight" if name else "weight"), module


def _install(model: nn.Module) -> None:
    """The root pre-forward cast (before FSDP2's own pre-forward, which all-gathers) and the state-dict unwrap."""
    registry = model._fp4_dist_nvfp4 = _Registry(model)
    # Eager under torch.compile too: the cast reads DTensor layouts and the device's verdicts, which dynamo cannot
    # trace (its guards fail on the frame that made them).
    before = torch.compiler.disable(lambda module, args, kwargs: registry.precompute(defer_check=True))
    after = torch.compiler.disable(lambda module, args, kwargs, out: registry.after_forward())
    model.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    for _, module in registry.owners:
        module.register_state_dict_post_hook(_unwrap_state_dict)


def _unwrap_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """Checkpoints hold the plain fp32 masters (a DTensor of them when sharded), sharing their storage, so that
    torch.distributed.checkpoint saves and loads them like any parameter, at any world size."""
    key = prefix + "weight"
    p = state_dict.get(key)
    local = local_master(p)
    if local is not None:
        data = local.fp32
        if isinstance(p, DTensor):
            data = DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())  # fmt: skip
        state_dict[key] = data


def precompute_nvfp4(model: nn.Module) -> None:
    """Cast the NVFP4 weights of a model from `fully_shard_nvfp4` now, if their masters changed (a collective:
    call it on every rank). The model's forward does this by itself; call it before all-gathering the weights
    some other way (``model.unshard()``)."""
    _registry(model).precompute()


def _registry(model: nn.Module) -> _Registry:
    registry = getattr(model, "_fp4_dist_nvfp4", None)
    if registry is None:
        raise ValueError("this model was not sharded by fp4_dist.fsdp.fully_shard_nvfp4 (pass the model it was "
                         "called with)")
    return registry


def nvfp4_weights(model: nn.Module) -> dict[str, NVFP4Tensor]:
    """{fqn: the gathered NVFP4Tensor} of every NVFP4 weight that is unsharded now (inside the forward, or after
    ``unshard()`` of the FSDP module that holds it); FSDP2 frees the gathered bytes when it reshards."""
    out = {}
    for st in _registry(model).states.values():
        fields = st.gathered_fields
        if fields is not None and all(allocated(t) for t in fields):
            out[st.fqn] = st.gathered()
    return out


class OrderedReduceScatter:
    """FSDP2 reduce-scatter as an all-to-all and a sum in rank order (`set_custom_reduce_scatter`): the same bits
    for every world size and backend, like `fp4_dist.cast.collectives.reduce_scatter_ordered`."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"OrderedReduceScatter: reduce op {op} (SUM and AVG are supported)")
        reduce_scatter_ordered(output_tensor, input_tensor, group)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(dist.get_world_size(group))
        return None
