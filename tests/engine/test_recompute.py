"""The recompute section: spec validation, the selective policy (which reads the custom-op
registry's `is_compute_sensitive` flag), the pure `auto` choice, and gradients of compiled +
checkpointed tiny Wan / Flux equal to eager gradients (fp32, CPU), with no graph break."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.engine import counters, remove
from magi_zoo.engine.recompute import (BlockProfile, GroupCost, Option, OptionCost, block_choices, choose, options,
                                       recompute_state)
from magi_zoo.engine.recompute.auto import _hull
from magi_zoo.specs import PlanLayer, RecomputeSpec
from magi_zoo.specs.plan import with_backend
from magi_zoo.specs.recompute_spec import with_recompute


# -- the spec ------------------------------------------------------------------------------------

def test_spec_shorthand_fields_and_errors():
    assert RecomputeSpec.from_shorthand("full").policy == "full"
    assert RecomputeSpec(policy="selective").saved == ("matmuls", "attention")
    assert RecomputeSpec(policy="selective", save="aten.mm").save == ("aten.mm",)
    RecomputeSpec(policy="selective", save=["attention", "aten::bmm", "aten.mm.default"])  # all forms
    with pytest.raises(ValueError, match="'ful'.*did you mean 'full'"):
        PlanLayer(recompute={"Block": "ful"})
    with pytest.raises(ValueError, match="save entry 'matmul' is not an op group -- did you mean 'matmuls'"):
        RecomputeSpec(policy="selective", save=["matmul"])
    with pytest.raises(ValueError, match="no torch op aten.mmm -- did you mean 'aten.mm'"):
        RecomputeSpec(policy="selective", save=["aten.mmm"])
    with pytest.raises(ValueError, match="aten.mm has no overload 'nope'; overloads: .*default"):
        RecomputeSpec(policy="selective", save=["aten.mm.nope"])
    with pytest.raises(ValueError, match="save= is for policy='selective'"):
        RecomputeSpec(policy="full", save=["matmuls"])
    with pytest.raises(ValueError, match="policy='auto' needs train_peak_gib"):
        RecomputeSpec(policy="auto")
    with pytest.raises(ValueError, match="train_peak_gib is for policy='auto'"):
        RecomputeSpec(policy="full", train_peak_gib=8)
    # the training peak's former name (the offload budget's) says what to write instead, however given
    with pytest.raises(ValueError, match="'memory_budget_gib' was renamed 'train_peak_gib': write train_peak_gib=16"):
        RecomputeSpec(policy="auto", memory_budget_gib=16)
    with pytest.raises(ValueError, match="'memory_budget_gib' was renamed 'train_peak_gib'"):
        PlanLayer(recompute={"Block": {"policy": "auto", "memory_budget_gib": 16}})
    with pytest.raises(ValueError, match="unknown field 'polcy' -- did you mean 'policy'"):
        PlanLayer(recompute={"Block": {"polcy": "full"}})


def test_with_recompute_sets_declared_regions_only():
    layers = [("model default", PlanLayer(recompute={"Block": "none"}, compile={"Block": {}}))]
    out = with_recompute(layers, {"policy": "auto", "train_peak_gib": 16})
    spec = out[-1][1].entries("recompute")["Block"]
    assert (spec.policy, spec.train_peak_gib) == ("auto", 16)
    with pytest.raises(ValueError, match="declares no \\[\\*.recompute\\] regions"):
        with_recompute([("model default", PlanLayer(compile={"Block": {}}))], "full")
    with pytest.raises(ValueError, match="needs train_peak_gib"):
        with_recompute(layers, "auto")


# -- the choice (pure) ------------------------------------------------------------------------------

def _profile(mm_b=40, mm_s=0.6, at_b=10, at_s=0.3, other_s=0.1, boundary=5, no_ckpt=120):
    return BlockProfile(groups={"matmuls": GroupCost(mm_b, mm_s, 4), "attention": GroupCost(at_b, at_s, 1),
                                "other": GroupCost(200, other_s, 30)},
                        forward_s=mm_s + at_s + other_s, boundary_bytes=boundary, no_checkpoint_bytes=no_ckpt)


def test_options_follow_the_profile():
    opts = {o.name: o for o in options(_profile())}
    assert opts["full"] == Option("full", (), 5, pytest.approx(1.0))
    assert (opts["keep attention"].bytes, opts["keep attention"].recompute_s) == (15, pytest.approx(0.7))
    assert (opts["keep matmuls"].bytes, opts["keep matmuls"].recompute_s) == (45, pytest.approx(0.4))
    assert (opts["keep matmuls+attention"].bytes, opts["keep matmuls+attention"].recompute_s) == (55, pytest.approx(0.1))
    assert (opts["no checkpoint"].bytes, opts["no checkpoint"].recompute_s) == (120, 0.0)
    # what the compiled forward measured replaces the estimate where it is larger, only there
    # (bytes), and the recompute seconds become forward + backward time over no checkpoint's
    got = {o.name: (o.bytes, o.recompute_s) for o in options(_profile(), {
        "keep attention": OptionCost(90, 0.5), "full": OptionCost(1, 0.75), "no checkpoint": OptionCost(100, 0.25)})}
    assert got == {"full": (5, 0.5), "keep attention": (90, 0.25), "keep matmuls": (45, pytest.approx(0.4)),
                   "keep matmuls+attention": (55, pytest.approx(0.1)), "no checkpoint": (120, 0.0),
                   "keep attention+down-projections": (15, pytest.approx(0.7))}  # no down-projections here
    # the down-projections are counted apart (a subset of the matmuls): attention + them
    p = _profile()
    p = BlockProfile(groups={**p.groups, "down-projections": GroupCost(8, 0.25, 1)}, forward_s=p.forward_s,
                     boundary_bytes=p.boundary_bytes, no_checkpoint_bytes=p.no_checkpoint_bytes)
    o = {o.name: o for o in options(p)}["keep attention+down-projections"]
    assert (o.bytes, o.recompute_s) == (23, pytest.approx(0.45))


def test_down_projections_are_matmuls_with_k_over_n():
    from magi_zoo.engine.recompute import is_down_projection, save_set
    from magi_zoo.engine.recompute.policy import _policy
    from torch.utils.checkpoint import CheckpointPolicy

    a, up, down = torch.empty(4, 16), torch.empty(16, 64), torch.empty(64, 16)
    h = torch.empty(4, 64)
    mm, addmm, linear = torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default
    assert not is_down_projection(mm, (a, up)) and is_down_projection(mm, (h, down))
    assert is_down_projection(addmm, (torch.empty(16), h, down))
    assert is_down_projection(linear, (h, torch.empty(16, 64))) and not is_down_projection(linear, (a, torch.empty(64, 16)))
    assert not is_down_projection(torch.ops.aten.sin.default, (h,))
    policy = _policy(save_set(["attention", "down-projections"]))
    assert policy(None, mm, h, down) == CheckpointPolicy.MUST_SAVE
    assert policy(None, mm, a, up) == CheckpointPolicy.PREFER_RECOMPUTE
    with pytest.raises(ValueError, match="did you mean 'down-projections'"):
        RecomputeSpec(policy="selective", save=["down-projection"])


def test_choose_fits_the_budget_at_least_recompute_time():
    opts = options(_profile())  # bytes: full 5, attn 15, mm 45, both 55, none 120
    blocks = [opts] * 10
    names = lambda c: [opts[i].name for i in c.picks]  # noqa: E731
    # nothing beyond full fits: all full
    c = choose(blocks, 50)
    assert c.fits and names(c) == ["full"] * 10 and c.bytes == 50
    # everything fits: no checkpoint anywhere
    c = choose(blocks, 10 * 120)
    assert names(c) == ["no checkpoint"] * 10 and c.recompute_s == 0
    # in between: the bytes go to the best seconds-per-byte upgrades first (attention: 0.3 s
    # for 10 B, then matmuls: 0.3 s for 30 B more), never over the budget, and more budget
    # never costs more recompute time
    last = float("inf")
    for budget in range(50, 1201, 37):
        c = choose(blocks, budget)
        assert c.fits and c.bytes <= budget
        assert c.recompute_s <= last + 1e-12
        last = c.recompute_s
    c = choose(blocks, 150)  # 10 x full = 50; +10 per attention upgrade -> all 10 = 150
    assert names(c) == ["keep attention"] * 10
    # brute force over counts agrees for identical blocks (optimal up to one block's step)
    best = min(sum(o.recompute_s for o in combo) for combo in _combos(opts, 10)
               if sum(o.bytes for o in combo) <= 400)
    assert choose(blocks, 400).recompute_s <= best + max(o.recompute_s for o in opts)
    # infeasible: the cheapest everywhere, flagged
    c = choose(blocks, 10)
    assert not c.fits and names(c) == ["full"] * 10


def test_choose_within_counts_the_largest_backward_working_set_once():
    from magi_zoo.engine.recompute import choose_within

    # a: keeps little, a bigger backward working set; b: keeps more, works in less
    opts = [Option("a", (), 10, 1.0), Option("b", ("attention",), 20, 0.5)]
    blocks, works = [opts] * 4, [[20, 5]] * 4
    names = lambda c: sorted(opts[i].name for i in c.picks)  # noqa: E731
    c, w = choose_within(blocks, works, 85)  # 4 x b: 80 + 5
    assert c.fits and names(c) == ["b"] * 4 and w == 5
    c, w = choose_within(blocks, works, 70)  # 3 x a + b: 50 + 20 (a's working set, counted once)
    assert c.fits and names(c) == ["a", "a", "a", "b"] and w == 20 and c.recompute_s == pytest.approx(3.5)
    c, w = choose_within(blocks, works, 60)  # 4 x a: 40 + 20
    assert c.fits and names(c) == ["a"] * 4
    c, w = choose_within(blocks, works, 30)  # nothing fits: the smallest peak, flagged
    assert not c.fits and c.bytes + w == 60


def _combos(opts, n):
    import itertools

    for counts in itertools.combinations_with_replacement(range(len(opts)), n):
        yield [opts[i] for i in counts]


def test_hull_drops_dominated_options():
    opts = [Option("a", (), 10, 1.0), Option("b", (), 20, 1.0), Option("c", (), 30, 0.2),
            Option("d", (), 40, 0.5), Option("e", (), 12, 0.95)]
    # b (more bytes, same time as a) and d (more bytes and time than c) are dominated; e is
    # above the segment a-c, so upgrading a -> c is the better use of bytes
    assert _hull(opts) == [0, 2]


# -- the selective policy reads is_compute_sensitive ---------------------------------------------------

CALLS = {"n": 0}


@magi_zoo.register_custom_op("test_recompute_sensitive", is_compute_sensitive=True,
                             fake=lambda x, w: torch.empty_like(x @ w))
def _sensitive(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    CALLS["n"] += 1
    return x @ w


def _sens_backward(ctx, g):
    x, w = ctx.saved_tensors
    return g @ w.t(), x.t() @ g


def _sens_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


_sensitive.register_autograd(_sens_backward, setup_context=_sens_setup)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(_sensitive(x, self.w))) + x


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("policy, calls", [
    ("none", 2),        # one forward call per block, nothing recomputed
    ("full", 4),        # backward re-runs each block's forward, the custom op included
    ("selective", 2),   # kept (compute-sensitive), not recomputed
])
def test_compute_sensitive_custom_op_is_saved_not_recomputed(policy, calls):
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(3, 8, requires_grad=True)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    magi_zoo.apply(net, {"recompute": {"_Block": policy}, "compile": {"_Block": {"enabled": False}}})
    CALLS["n"] = 0
    net(x).sum().backward()
    assert CALLS["n"] == calls
    for p, r in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, r)
    remove(net)
    assert all("forward" not in b.__dict__ for b in net.blocks)  # undone exactly


class _MatBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).sin().cos() + x


def test_blocks_of_one_class_with_different_choices_run_their_own_compiled_variant(fresh_dynamo):
    # dynamo does not guard on which selective policy a checkpoint uses: blocks of one class
    # whose choices differ must not share compiled code (each choice: its own code object).
    net = nn.Sequential(_MatBlock(), _MatBlock())
    magi_zoo.apply(net, {"recompute": {"_MatBlock": {"policy": "selective", "save": ["matmuls"]}},
                         "compile": {"_MatBlock": {"backend": "aot_eager", "fullgraph": True}}}, gpu="cpu", train=True)
    recompute_state(net[1]).choose(("attention",))  # block 1: another save set (no attention here: nothing)

    def saved_bytes(block, x):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        return sum(n for k, n in seen.items() if k not in params)

    x = torch.randn(64, 16, requires_grad=True)
    before = counters.snapshot()
    kept_mm, kept_attn = saved_bytes(net[0], x), saved_bytes(net[1], x)
    assert kept_mm == kept_attn + 64 * 16 * 4  # the linear's output, kept only by block 0
    counters.expect(counters.delta(before), frames=2, breaks=0, recompiles=0)
    assert [c for _, c in block_choices(net)] == ["keep matmuls", "keep attention"]
    remove(net)


def test_selective_checkpoint_keeps_its_outputs_out_of_saved_tensors_hooks():
    # What `measure_options` relies on, on every torch: the outputs a selective checkpoint keeps
    # bypass a surrounding saved_tensors_hooks. torch 2.14 made that a choice
    # (`respect_saved_tensors_hooks`, warning while unset, later an error, then the other
    # default); the wrapper passes False where torch takes it. So the hook sees only the
    # block's input -- as under full recompute -- and nothing warns.
    import warnings

    for policy in ("full", {"policy": "selective", "save": ["matmuls"]}):
        net = nn.Sequential(_MatBlock())
        magi_zoo.apply(net, {"recompute": {"_MatBlock": policy}, "compile": {"": False}}, gpu="cpu", train=True)
        params = {p.untyped_storage().data_ptr() for p in net.parameters()}
        seen = set()

        def pack(t):
            seen.add(t.untyped_storage().data_ptr())
            return t.detach()

        x = torch.randn(64, 16, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = net(x)
        y.sum().backward()
        remove(net)
        assert seen - params == {x.untyped_storage().data_ptr()}, policy


# -- tiny Wan and Flux: compiled + recompute gradients equal eager ----------------------------------------

def _grads(model, kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)[0]
    out.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel(got, ref):
    assert got.keys() == ref.keys()
    return max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)) for n in ref)


@pytest.fixture(scope="module")
def wan():
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    h.pipe.transformer.train()
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    return h, kw, _grads(h.pipe.transformer, kw)


@pytest.mark.parametrize("recompute", ["full", {"policy": "selective", "save": ["matmuls", "aten._softmax"]}])
def test_wan_compiled_recompute_gradients_equal_eager(wan, fresh_dynamo, recompute):
    h, kw, ref = wan
    # static shapes, as GPU plans compile the block (the CPU plan's dynamic=true made this
    # symbolic trace of the block's joint graph ~3x slower: ~10 s of each case on 2 cores)
    static = ("user", PlanLayer(compile={"WanTransformerBlock": {"dynamic": False}}))
    layers = with_recompute([*with_backend(h.layers, "aot_eager"), static], recompute)
    rep = magi_zoo.apply(h.modules, layers=layers, gpu="cpu", train=True,
                         preparations=h.adapter.preparations(h.pipe))
    try:
        assert {c for _, c in block_choices(h.modules)} == {"full" if recompute == "full" else
                                                            "keep matmuls+aten._softmax"}
        before = counters.snapshot()
        got = _grads(h.pipe.transformer, kw)
        # 4 blocks, one compiled frame (the checkpoint is one higher-order op inside it), no break
        counters.expect(counters.delta(before), frames=1, breaks=0, recompiles=0)
        assert rep.region("WanTransformerBlock").counters.n_graph_breaks == 0
        assert _max_rel(got, ref) < 1e-4
    finally:
        remove(h.modules)
    assert not any("forward" in b.__dict__ for b in h.pipe.transformer.blocks)


def test_flux_compiled_selective_gradients_equal_eager(fresh_dynamo):
    h = magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    model = h.pipe.transformer.train()
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    ref = _grads(model, kw)
    layers = with_recompute(with_backend(h.layers, "aot_eager"), "selective")
    rep = magi_zoo.apply(h.modules, layers=layers, gpu="cpu", train=True,
                         preparations=h.adapter.preparations(h.pipe))
    before = counters.snapshot()
    got = _grads(model, kw)
    # one compile per block class (2 double + 2 single blocks), no break
    counters.expect(counters.delta(before), frames=2, breaks=0, recompiles=0)
    assert "selective on FluxTransformerBlock (2 x FluxTransformerBlock)" in rep.step("recompute").did
    assert _max_rel(got, ref) < 1e-4


def test_inference_is_untouched_by_recompute(wan):
    h, kw, _ = wan
    layers = with_recompute([("model default", PlanLayer(compile={"": False}, recompute={"WanTransformerBlock": "none"}))],
                            "full")
    with torch.no_grad():
        ref = h.pipe.transformer(**kw)[0]
        magi_zoo.apply(h.modules, layers=layers, gpu="cpu")
        try:
            torch.testing.assert_close(h.pipe.transformer(**kw)[0], ref, rtol=0, atol=0)
        finally:
            remove(h.modules)


# -- auto through load(train=True), and attention for training -------------------------------------------

def test_load_train_auto_measures_chooses_and_reports(fresh_dynamo, monkeypatch):
    from magi_zoo.train import flow_matching_loss

    # static shapes: the CPU plan's dynamic=true made each of the 6 option variants' joint
    # graph a symbolic trace (~3x the compile time, ~35 s of this test on 2 cores); the
    # calibration is what is under test here, and it compiles and measures each option the
    # same way either way (auto under the CPU plan's dynamic shapes: test_load_can_defer_...)
    big = magi_zoo.load("wan2.1-tiny", gpu="cpu", train=True, recompute={"policy": "auto", "train_peak_gib": 4},
                        compile={"WanTransformerBlock": {"backend": "aot_eager", "dynamic": False}})
    assert big.trainable.training and not big.pipe.text_encoder.training
    assert not any(p.requires_grad for p in big.pipe.text_encoder.parameters())
    rec = big.report().step("recompute")
    auto = rec.details["auto"]["WanTransformerBlock"]
    # 4 GiB is far more than the tiny model needs: every block at the least recompute time
    # (no checkpoint, or an option whose measured forward + backward is no slower: at this
    # size timings are noise, so the test reads the measured times rather than a name)
    (name, n), = auto["choice"].items()
    by_name = {o["name"]: o for o in auto["options"]}
    assert auto["fits"] and n == 4
    assert by_name[name]["recompute_ms_per_block"] <= min(o["recompute_ms_per_block"] for o in auto["options"]) + 1e-3
    assert f"auto (4 GiB budget) on WanTransformerBlock (4 x WanTransformerBlock): 4 x {name}" in rec.did
    assert [o["name"] for o in auto["options"]] == ["full", "keep attention", "keep attention+down-projections",
                                                    "keep matmuls", "keep matmuls+attention", "no checkpoint"]
    before = counters.snapshot()
    loss = flow_matching_loss(big.trainable, big.adapter.example_inputs(big.pipe, big.variant, "denoise"))
    loss.backward()
    # calibration compiled every option's variant of the block with the inputs' grad flags as
    # a training step has them: the step reuses one, compiling nothing
    counters.expect(counters.delta(before), frames=0, breaks=0, recompiles=0)
    # a budget below the weights, gradients and optimizer states: full everywhere, with a warning.
    # The budget is made small by making its unit small (GIB: 1 KiB, so 4 GiB reads 4 KiB): the
    # option variants compiled above are measured again as they are, instead of a re-applied plan
    # compiling all 6 again (~20 s of this test on 2 cores). At 1 KiB the frozen components'
    # weights left on the device (the text encoder) are "large" too: the accounting, which
    # separates them from the rest, names them.
    from magi_zoo.engine.recompute import calibration as rc
    from magi_zoo.train import calibrate

    monkeypatch.setattr(rc, "GIB", 1024)
    with pytest.warns(RuntimeWarning) as caught:
        out = calibrate(big)
    said = [str(w.message) for w in caught]
    assert any("even full recompute everywhere is estimated" in s for s in said), said
    assert any("of frozen weights (parameters without grad" in s and "count against the" in s for s in said), said
    live = _live_tensor_bytes()  # after a calibration: the next one (below) must add nothing
    # what is left when nothing fits: every block at the option with the smallest footprint --
    # max(what it keeps, as its compiled forward measured it, its gradient), then the least
    # recompute (with aot_eager on CPU that need not be `full`)
    grad = sum(p.numel() * p.element_size() for p in big.pipe.transformer.blocks[0].parameters())
    (name, n), = out[0]["choice"].items()
    foot = {o["name"]: max(o["bytes_per_block"], grad) for o in out[0]["options"]}
    assert n == 4 and foot[name] == min(foot.values()) and not out[0]["fits"]
    assert out[0]["bytes_from"] == "compiled forward + backward per option"
    text = sum(p.numel() * p.element_size() for p in big.pipe.text_encoder.parameters())
    assert out[0]["frozen_weights_on_device_gib"] * 1024 >= text * 0.99 and out[0]["other_live_gib"] == 0
    with pytest.warns(RuntimeWarning, match="even full recompute everywhere is estimated"):
        calibrate(big)
    # The profiling pass's autograd graph goes with it (a pack hook returning the saved tensor
    # itself made node -> tensor -> node cycles no gc sees: at the Wan-1.3B shape, 3.8 GiB left
    # on the card per calibration; here every calibration would add its saved activations).
    assert _live_tensor_bytes() == live
    # The plan applied anew with an auto region (a budget below everything, through the spec):
    # a training forward before any calibration is refused, saying what to call.
    remove(big.modules)
    layers = with_recompute(big.layers, {"policy": "auto", "train_peak_gib": 1e-6})
    magi_zoo.apply(big.modules, layers=layers, gpu="cpu", train=True)
    with pytest.raises(RuntimeError, match="not made yet.*calibrate"):
        big.trainable(**big.adapter.example_inputs(big.pipe, big.variant, "denoise"))


def _live_tensor_bytes() -> int:
    import gc

    gc.collect()
    seen = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, nn.Parameter) and o.device.type != "meta":
            s = o.untyped_storage()
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def test_recompute_needs_train():
    with pytest.raises(ValueError, match="recompute= sets activation recompute for training: pass train=True"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", recompute="full")


def test_cli_spec_shows_the_training_plan(capsys):
    from magi_zoo.cli import main

    assert main(["spec", "wan2.1-t2v-1.3b", "--gpu", "h100", "--recompute", "auto:16"]) == 0
    out = capsys.readouterr().out
    assert "| WanTransformerBlock | -      | 30 x WanTransformerBlock | policy=auto, train_peak_gib=16.0" in out
    assert "recompute auto: the per-block choice is measured" in out and "--measure" in out
    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu", "--recompute", "auto"]) == 2
    assert "auto needs a budget: auto:GIB" in capsys.readouterr().err


def test_load_can_defer_the_auto_calibration():
    """load(..., calibrate=False): nothing measured at load, a training forward through an auto
    block is refused with what to call, and `magi_zoo.train.calibrate` then chooses."""
    from magi_zoo.train import calibrate, flow_matching_loss

    auto = {"policy": "auto", "train_peak_gib": 1.0}
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", train=True, recompute=auto, calibrate=False,
                      compile={"WanTransformerBlock": {"backend": "eager"}})
    assert "auto" not in h.report().step("recompute").details
    inputs = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    with pytest.raises(RuntimeError, match=r"not made yet.*calibrate=False\) call magi_zoo.train.calibrate"):
        flow_matching_loss(h.trainable, inputs)
    calibrate(h)
    assert "WanTransformerBlock" in h.report().step("recompute").details["auto"]
    flow_matching_loss(h.trainable, inputs).backward()
    for bad in (dict(train=False), dict(train=True, recompute="full")):
        with pytest.raises(ValueError, match="calibrate= defers the measuring of recompute='auto'"):
            magi_zoo.load("wan2.1-tiny", gpu="cpu", calibrate=False, **bad)
