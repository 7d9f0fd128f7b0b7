"""Lean compute (fp4_dist.compute.lean): NVFP4Linear layers whose weights keep no copy (compute_copy=False) compute with
a copy made around each use in a pool buffer of its shape, and give bitwise the losses, gradients and masters of
the default mode."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp4_dist
from fp4_dist.compute import lean, pool
from fp4_dist.megatron import lean_claim
from fp4_dist.tensor.copy import compute_copy_bytes
from fp4_dist.compute.pool import held_copies
from fp4_dist.optim import Zero1Optimizer


class Block(nn.Module):
    def __init__(self, d=48, h=80):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d, bias=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, layers=3, recompute=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(48, 64)
        self.recompute = recompute

    def forward(self, x):
        for b in self.blocks:
            recompute = self.recompute and torch.is_grad_enabled()
            x = checkpoint(b, x, use_reentrant=self.recompute == "reentrant") if recompute else b(x)
        return self.head(x)


def build(lean: bool, recompute=None, device="cpu"):
    torch.manual_seed(0)
    net = Net(recompute=recompute).to(device, torch.bfloat16)
    fp4_dist.convert_linear_weights(net, compute_copy=not lean)
    return net


def batch(step, micro, device="cpu"):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(2, 12, 48, generator=g).to(device, torch.bfloat16)


def train(lean: bool, steps=3, micro=2, recompute=None, device="cpu"):
    net = build(lean, recompute, device)
    opt = Zero1Optimizer(net.named_parameters(), lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    losses = []
    for step in range(steps):
        for m in range(micro):  # gradient accumulation
            x = batch(step, m, device).requires_grad_(recompute == "reentrant")
            loss = net(x).float().square().mean()
            if lean:
                assert held_copies() == 0, "a lean copy outlived its forward"
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        losses.append(net(batch(99, 0, device)).float().square().mean().item())
    return losses, [t.clone() for t in opt.full_masters()]


@pytest.mark.parametrize("recompute", [None, "non-reentrant", "reentrant"])
def test_lean_losses_and_masters_equal_the_default_mode_bitwise(recompute):
    replaced = pool.pool_stats()["replaced"]
    default_losses, default_masters = train(lean=False, recompute=recompute)
    lean_losses, lean_masters = train(lean=True, recompute=recompute)
    assert lean_losses == default_losses
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(lean_masters, default_masters))
    assert held_copies() == 0 and pool.pool_stats()["replaced"] == replaced


@pytest.mark.gpu
def test_lean_equals_the_default_mode_bitwise_on_cuda():
    replaced = pool.pool_stats()["replaced"]
    default_losses, default_masters = train(lean=False, device="cuda")
    lean_losses, lean_masters = train(lean=True, device="cuda")
    assert lean_losses == default_losses
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(lean_masters, default_masters))
    assert held_copies() == 0 and pool.pool_stats()["replaced"] == replaced


def _weight_bytes(net) -> tuple[int, set]:
    """bf16 bytes of the NVFP4 weights and their distinct shapes."""
    ws = [p for p in net.parameters() if fp4_dist.is_nvfp4_tensor(p)]
    return sum(w.numel() * 2 for w in ws), {tuple(w.shape) for w in ws}


def test_no_copy_is_alive_between_forward_and_backward_and_at_most_one_per_backward_use():
    pool.release_pool()
    net = build(lean=True)
    assert all(p.copy_state.value is None for p in net.parameters() if fp4_dist.is_nvfp4_tensor(p))
    seen = []

    def count(module, grad_input, grad_output):
        seen.append(held_copies())

    linears = [m for m in net.modules() if isinstance(m, fp4_dist.NVFP4Linear)]
    hooks = [m.register_full_backward_hook(count) for m in linears]
    out = net(batch(0, 0))
    assert held_copies() == 0
    out.float().sum().backward()
    for h in hooks:
        h.remove()
    assert held_copies() == 0 and len(seen) == len(linears) and max(seen) <= 1
    assert all(p.grad is not None and type(p.grad) is torch.Tensor for p in net.parameters() if p.requires_grad)
    # The pool: one buffer per distinct weight shape, a fraction of the weights' bf16 bytes (3 blocks + a head).
    total, shapes = _weight_bytes(net)
    stats = pool.pool_stats()
    assert stats["buffers"] == len(shapes) == 5 and stats["replaced"] == 0
    assert stats["bytes"] == sum(m * k * 2 for m, k in shapes) < total / 2
    assert compute_copy_bytes(net) == 0


def test_a_copy_kept_past_its_use_is_never_overwritten():
    pool.release_pool()
    net = build(lean=True)
    kept = []
    a, b = net.blocks[0].proj, net.blocks[1].proj  # same shape: one pool buffer
    x = batch(0, 0)
    with torch.no_grad():
        lean.lean_call(a, a.weight, lambda v: kept.append(v) or F.linear(x, v))
        with pytest.warns(UserWarning, match=r"still referenced when the next weight of that shape"):
            lean.lean_call(b, b.weight, lambda v: F.linear(x, v))
    assert torch.equal(kept[0], a.weight.dequantize(torch.bfloat16))
    assert pool.pool_stats()["replaced"] == 1
    kept.clear()
    assert held_copies() == 0


def test_lean_views_are_dropped_when_a_module_is_moved_and_fields_replaced_rebind():
    net = build(lean=True)
    x = batch(0, 0)
    ref = net(x)
    net.to(torch.bfloat16)  # nn.Module._apply: the layers forget their lean state
    assert all(m.__dict__["_fp4_lean_view"].weight is None for m in net.modules()
               if isinstance(m, fp4_dist.NVFP4Linear))
    assert torch.equal(net(x), ref)
    w = net.blocks[0].up.weight
    with torch.no_grad():
        w.quantize_(w.dequantize(torch.float32) * 2)  # new bytes in place: the next use reads them
    out = net.blocks[0].up(x[..., :48])
    assert torch.equal(out, F.linear(x[..., :48], w.dequantize(torch.bfloat16), net.blocks[0].up.bias))


def test_a_weight_changed_between_forward_and_backward_makes_the_backward_raise():
    net = build(lean=True)
    out = net(batch(0, 0))
    w = net.blocks[1].up.weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: the NVFP4 weight blocks.1.up.weight"):
        out.float().sum().backward()


def _write_through(route: str, lin, other: torch.Tensor) -> None:
    w = lin.weight
    with torch.no_grad():
        if route == "copy_ from bf16":
            w.copy_(other)
        elif route == "copy_ from NVFP4":
            w.copy_(fp4_dist.quantize(other))
        elif route == "quantize_":
            w.quantize_(other)
        elif route == "load_state_dict":
            src = nn.Linear(other.shape[1], other.shape[0], bias=lin.bias is not None).to(torch.bfloat16)
            src.weight.copy_(other)
            fp4_dist.convert_linear_weights(src)
            lin.load_state_dict(src.state_dict())
        elif route == "byte write":
            w.rowwise_data[0].bitwise_xor_(0x11)  # flip a nibble pair in place
        elif route == "field replaced":
            w.rowwise_data = fp4_dist.quantize(other).rowwise_data.clone()
            w.amax = fp4_dist.quantize(other).amax.clone()
            w.rowwise_scale_inv = fp4_dist.quantize(other).rowwise_scale_inv.clone()


@pytest.mark.parametrize("route", ["copy_ from bf16", "copy_ from NVFP4", "quantize_", "load_state_dict",
                                   "byte write", "field replaced"])  # fmt: skip
def test_every_route_that_changes_the_bytes_is_seen_by_the_next_lean_use(route):
    net = build(lean=True)
    lin = net.blocks[0].up
    x = batch(0, 0)[..., :48]
    lin(x).float().sum().backward()  # binds the layer's launch and alias
    other = torch.randn(tuple(lin.weight.shape), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = lin.weight.dequantize(torch.bfloat16)
    _write_through(route, lin, other)
    want = lin.weight.dequantize(torch.bfloat16)
    assert not torch.equal(want, before), "the route changed nothing"
    assert torch.equal(lin(x), F.linear(x, want, lin.bias))
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, want, lin.bias))
    xg = x.detach().requires_grad_()
    lin(xg).float().sum().backward()
    ref = xg.detach().requires_grad_()
    F.linear(ref, want, lin.bias).float().sum().backward()
    assert torch.equal(xg.grad, ref.grad)


class _Refilled(torch.autograd.Function):
    """A linear whose forward claims the lean use and whose backward refills it first (what the Megatron adapter
    does to Megatron's linear function)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.use = lean_claim.claim(w)
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        if ctx.use is not None:
            ctx.use.refill()
        x, w = ctx.saved_tensors
        return g @ w, g.flatten(0, -2).t() @ x.flatten(0, -2)


def test_a_function_that_refills_in_backward_reads_its_own_weight_from_a_shared_buffer():
    net = build(lean=True)
    a, b = net.blocks[0].proj, net.blocks[1].proj  # one pool buffer
    x = batch(0, 0)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = lean_claim.lean_call_refilled(a, a.weight, lambda v: _Refilled.apply(xa, v))
    yb = lean_claim.lean_call_refilled(b, b.weight, lambda v: _Refilled.apply(xb, v))  # the buffer now holds b
    (ya.float().sum() + yb.float().sum()).backward()
    for lin, xg in ((a, xa), (b, xb)):
        w = lin.weight.dequantize(torch.bfloat16)
        ref = x.clone().requires_grad_()
        (ref @ w.t()).float().sum().backward()
        assert torch.equal(xg.grad, ref.grad), "a backward read another weight's copy"
    assert held_copies() == 0
    with torch.no_grad():
        a.weight.copy_(torch.randn(tuple(a.weight.shape)).to(torch.bfloat16))
    ya = lean_claim.lean_call_refilled(a, a.weight, lambda v: _Refilled.apply(xa, v))
    a.weight.quantize_(torch.randn(tuple(a.weight.shape)))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ya.float().sum().backward()


@pytest.mark.parametrize("route", ["copy_ from bf16", "field replaced"])
def test_microbatches_of_a_refilled_function_each_check_the_weight_they_were_recorded_with(route):
    net = build(lean=True)
    a, b = net.blocks[0].proj, net.blocks[1].proj  # one pool buffer
    x = batch(0, 0)
    x1, x2, xb = (x.clone().requires_grad_() for _ in range(3))
    y1 = lean_claim.lean_call_refilled(a, a.weight, lambda v: _Refilled.apply(x1, v))
    y1b = lean_claim.lean_call_refilled(a, a.weight, lambda v: _Refilled.apply(xb, v))  # unchanged: recorded alike
    other = torch.randn(tuple(a.weight.shape), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    _write_through(route, a, other)
    y2 = lean_claim.lean_call_refilled(a, a.weight, lambda v: _Refilled.apply(x2, v))
    with torch.no_grad():
        lean_claim.lean_call_refilled(b, b.weight, lambda v: v.sum())  # the buffer now holds b: a's backward refills
    y2.float().sum().backward()
    ref = x.clone().requires_grad_()
    (ref @ a.weight.dequantize(torch.bfloat16).t()).float().sum().backward()
    assert torch.equal(x2.grad, ref.grad), "the microbatch recorded after the change read a stale copy"
    for y in (y1, y1b):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.float().sum().backward()


def test_a_lean_use_nothing_claims_raises_instead_of_training_on_a_shared_buffer():
    net = build(lean=True)
    lin = net.blocks[0].proj
    x = batch(0, 0)
    with pytest.raises(RuntimeError, match="was not claimed by the autograd function"):
        lean_claim.lean_call_refilled(lin, lin.weight, lambda v: F.linear(x, v))


# ------------------------------------------------------------------ copies made once: skipped and batched fills
@pytest.mark.parametrize("recompute", [None, "non-reentrant", "reentrant"])
def test_uses_whose_copy_is_made_already_make_no_launch(recompute):
    before = pool.pool_stats()
    train(lean=True, steps=3, micro=2, recompute=recompute)  # bitwise like kept copies: the test above
    after = pool.pool_stats()
    uses, launches = after["uses"] - before["uses"], after["launches"] - before["launches"]
    # 13 weights, forward and backward of 6 microbatches (+ recomputation, + evaluation): one launch per use
    # would be >= 157 launches; a layer's four weights are filled by one, and a backward that follows its
    # forward, or a forward its backward, finds the copy made.
    assert uses >= 157 and launches * 3 <= uses, (uses, launches)


@pytest.fixture
def depth():
    """Set the pool's depth for a test, from an empty pool (the buffers of shapes an earlier test in this process
    left would count in its sizes); back to one layer after."""
    pool.release_pool()
    yield pool.set_pool_depth
    pool.set_pool_depth(1)


def test_a_deeper_pool_makes_fewer_copies_for_the_same_bits(depth):
    # 3 blocks of 4 weights and a head: at depth 3 every block keeps its copies between the optimizer steps, so each
    # weight's copy is made once per step (and once for the evaluation); at depth 1 a block's copies are made again
    # in each backward and forward the microbatches take it in.
    kept_losses, kept_masters = train(lean=False, steps=3, micro=2)
    copies, sizes = {}, {}
    for layers in (1, 2, 3):
        depth(layers)
        before = pool.pool_stats()["copies"]
        losses, masters = train(lean=True, steps=3, micro=2)
        copies[layers] = pool.pool_stats()["copies"] - before
        sizes[layers] = (pool.pool_stats()["buffers"], pool.pool_bytes())
        assert losses == kept_losses
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(masters, kept_masters))
    assert copies[1] > copies[2] > copies[3] == 13 * 4, copies
    weights, shapes = _weight_bytes(build(lean=True))
    assert sizes[1][0] == len(shapes) and sizes[3] == (4 * 3 + 1, weights)  # the head's shape has one weight
    assert sizes[2][0] == 4 * 2 + 1


def test_the_pool_depth_is_a_positive_number_of_layers(depth):
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            depth(bad)
    depth(2)
    assert pool.pool_depth() == 2 and pool.pool_stats()["depth"] == 2


def _ref(lin, x):
    return F.linear(x, lin.weight.dequantize(torch.bfloat16), lin.bias)


def test_a_batch_fill_the_next_uses_do_not_match_is_never_read():
    net = build(lean=True)
    a, b = net.blocks[0].up, net.blocks[0].down
    a2, c = net.blocks[1].up, net.blocks[1].down  # a pool buffer each with a, b
    x = batch(0, 0)
    xa, xb = x[..., :48], torch.randn(2, 12, 80).to(torch.bfloat16)
    for _ in range(2):  # the order a -> b is learned: a's fill also writes b's copy
        a(xa), b(xb), a2(xa), c(xb)
    n = pool.pool_stats()["launches"]
    assert torch.equal(a(xa), _ref(a, xa)) and torch.equal(b(xb), _ref(b, xb))
    assert pool.pool_stats()["launches"] == n + 1, "a's batched fill did not make b's copy"
    a(xa)  # writes b's copy ...
    with torch.no_grad():
        b.weight.copy_(torch.randn(tuple(b.weight.shape)).to(torch.bfloat16))  # ... which is then stale
    assert torch.equal(b(xb), _ref(b, xb))
    a(xa)  # writes b's copy, and c (another order) then takes the buffer
    assert torch.equal(c(xb), _ref(c, xb)) and torch.equal(b(xb), _ref(b, xb))


def test_a_batch_fill_leaves_a_copy_kept_past_its_use_alone():
    pool.release_pool()
    net = build(lean=True)
    a, b = net.blocks[0].up, net.blocks[0].down
    xa, xb = batch(0, 0)[..., :48], torch.randn(2, 12, 80).to(torch.bfloat16)
    kept = []
    with torch.no_grad():
        for _ in range(2):
            a(xa), b(xb)  # learn a -> b
        a(xa)
        lean.lean_call(b, b.weight, lambda v: kept.append(v) or F.linear(xb, v))  # b's copy, kept
        old = b.weight.dequantize(torch.bfloat16)
        for w in (a.weight, b.weight):
            w.copy_(torch.randn(tuple(w.shape)).to(torch.bfloat16))
        n = pool.pool_stats()["launches"]
        assert torch.equal(a(xa), _ref(a, xa))  # a's batch would write b's buffer: it is held, so a fills its own
        assert pool.pool_stats()["launches"] == n + 1
        assert torch.equal(kept[0], old)
        replaced = pool.pool_stats()["replaced"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the pool's warning about the holder (once per process)
            assert torch.equal(b(xb), _ref(b, xb))
        assert pool.pool_stats()["replaced"] == replaced + 1 and torch.equal(kept[0], old)
    kept.clear()


def _write_unversioned(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write `src` into `dst` the way an NCCL all-gather lands: no version counter of this process moves."""
    before = dst._version
    dst.view(torch.uint8).numpy()[...] = src.view(torch.uint8).numpy()
    assert dst._version == before


def test_bytes_an_all_gather_writes_after_a_cast_are_seen_though_no_version_moves():
    from fp4_dist.tensor.copy import mark_pending

    net = build(lean=True)
    lin = net.blocks[0].up
    w, x = lin.weight, batch(0, 0)[..., :48]
    assert torch.equal(lin(x), _ref(lin, x))  # the pool buffer holds w's values
    for rnd in range(2):
        new = fp4_dist.quantize(torch.randn(tuple(w.shape), generator=torch.Generator().manual_seed(rnd)))
        mark_pending([w])  # a cast (this rank's shard would be written here)
        if rnd:  # a use between the cast and the gather's processing proves nothing about later bytes
            lin(x)
        for field in ("rowwise_data", "rowwise_scale_inv", "amax"):
            _write_unversioned(getattr(w, field), getattr(new, field))
        fp4_dist.post_all_gather_processing([w])
        assert torch.equal(w.dequantize(torch.bfloat16), new.dequantize(torch.bfloat16))
        assert torch.equal(lin(x), _ref(lin, x)), f"round {rnd}: a copy of the bytes before the gather was used"
