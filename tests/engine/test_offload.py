"""Weight offload: the planner (pure decisions), the spec section, and the streaming
mechanics on CPU (the host plays the device: copies are synchronous clones, counted)."""

import contextlib

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.engine import apply, needs_streaming, remove
from magi_zoo.engine import offload as off
from magi_zoo.engine.offload import GIB, OffloadPlanError, Unit, plan_offload, prefetch_schedule, simulate
from magi_zoo.specs import PlanLayer
from magi_zoo.overrides import with_memory_budget
from magi_zoo.specs.offload_spec import OffloadSpec

MB = 2 ** 20


# -- planner --------------------------------------------------------------------------------

# Tiny Wan plans without the spec's activation reserves (they are for the published shapes):
# the plan-wide one and the VAE phase's.
NO_RESERVE = {"offload": {"": {"activation_gib": 0.0}, "vae.encoder": {"phase_activation_gib": 0.0},
                          "vae.decoder": {"phase_activation_gib": 0.0}}}

def blocks(n, nbytes=GIB, time_s=None, group="Block", phase="t", **kw):
    return [Unit(f"{phase}.blocks.{i}", nbytes, group, phase, time_s=time_s, **kw) for i in range(n)]


def test_plan_everything_fits():
    p = plan_offload(blocks(10), fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=12 * GIB)
    assert not p.streams and len(p.resident) == 10 and p.slots == {} and p.schedule == {}
    assert p.expected_peak == 12 * GIB  # 1 fixed + 10 blocks + 1 activations: exactly the budget


def test_plan_budget_too_small_names_the_minimum():
    # Minimum: fixed 1 + one buffer of one block 1 + activations 1 = 3 GiB.
    with pytest.raises(OffloadPlanError, match=r"at least 3.00 GiB") as e:
        plan_offload(blocks(10), fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=2 * GIB)
    assert e.value.minimum_bytes == 3 * GIB
    # Exactly the minimum works: everything streams through one buffer (prefetch drops to 0).
    p = plan_offload(blocks(10), fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=3 * GIB)
    assert len(p.streamed) == 10 and p.prefetch == 0 and p.slots == {"Block": (1, GIB)} and p.schedule == {}


def test_plan_partial_residency_spread_and_peak():
    # 9 GiB: fixed 1 + activations 1 + 2 buffers (prefetch 1) = 4, so 5 of 10 blocks stay.
    p = plan_offload(blocks(10), fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=9 * GIB)
    assert len(p.resident) == 5 and p.slots == {"Block": (2, GIB)}
    assert p.expected_peak <= p.budget
    streamed = sorted(int(n.rsplit(".", 1)[1]) for n in p.streamed)
    assert streamed == [1, 3, 5, 7, 9]  # spread evenly, the last block streams
    assert p.copy_s["t"] == pytest.approx(5 * GIB / 55e9)


def test_plan_fits_each_phase_own_activation_peak():
    # A VAE phase whose activations (4 GiB) exceed the plan-wide reserve (1 GiB): resident
    # blocks stay on the card through it, so the VAE phase's peak decides how many stay.
    vae = Unit("vae.decoder", GIB // 4, "Dec", "vae", once=True, mode="resident", activation=4 * GIB)
    plain = plan_offload(blocks(10) + [Unit("vae.decoder", GIB // 4, "Dec", "vae", once=True, mode="resident")],
                         fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=9 * GIB)
    p = plan_offload(blocks(10) + [vae], fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=9 * GIB)
    # fixed 1 + decoder 0.25 + blocks: the transformer phase needs 2 buffers + 1 of
    # activations, the VAE phase 4 of activations (no buffers): 9 - 1.25 - max(3, 4) = 3.75
    # -> 3 blocks stay (4 with the plan-wide reserve alone).
    assert len(plain.resident) == 5 and len([n for n in p.resident if n.startswith("t.")]) == 3
    assert p.expected_peak == GIB + GIB // 4 + 3 * GIB + 4 * GIB <= p.budget
    # The minimum counts the largest phase's activations, and the error says so.
    with pytest.raises(OffloadPlanError, match=r"activations 4.00 GiB in its largest phase") as e:
        plan_offload(blocks(10) + [vae], fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=5 * GIB)
    assert e.value.minimum_bytes == GIB + GIB // 4 + 4 * GIB
    # A phase reserve below the plan-wide one changes nothing.
    low = Unit("vae.decoder", GIB // 4, "Dec", "vae", once=True, mode="resident", activation=GIB // 2)
    assert plan_offload(blocks(10) + [low], fixed_bytes=GIB, activation_bytes=GIB,
                        budget_bytes=9 * GIB).resident == plain.resident


def test_phase_activation_spec_field():
    assert OffloadSpec(once=True, phase_activation_gib=9).phase_activation_gib == 9
    with pytest.raises(ValueError, match="phase_activation_gib must be >= 0"):
        OffloadSpec(phase_activation_gib=-1)


def test_plan_pins_and_forced_streams():
    us = blocks(4)
    us[0] = Unit(us[0].name, GIB, "Block", "t", mode="resident")
    us[3] = Unit(us[3].name, GIB, "Block", "t", mode="stream")
    p = plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=100 * GIB)
    assert p.streamed == ["t.blocks.3"]  # stream = always, even when everything would fit
    with pytest.raises(OffloadPlanError):  # a pin the budget cannot hold
        plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=GIB)


def test_plan_streams_run_once_units_first():
    # A text encoder (once per generation) streams before any per-step block.
    us = blocks(4) + [Unit("te", 2 * GIB, "TE", "te", once=True)] + blocks(4, GIB // 2, group="TEBlock",
                                                                       phase="te", once=True)
    # All resident: 4 + 2 + 4 x 0.5 = 8 GiB. At 7 GiB the TE parts stream (te's transient
    # buffer 2 + TE pool 2 x 0.5 replace 2 + 2 resident: 7), every transformer block stays.
    p = plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=7 * GIB)
    assert set(p.streamed) == {"te", *(u.name for u in us if u.group == "TEBlock")}
    # At 6 GiB transformer blocks must stream too.
    assert any(n.startswith("t.") for n in
               plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=6 * GIB).streamed)


def test_plan_counts_buffers_per_phase():
    # Two components run one after the other; each streams through its own 2 buffers, but
    # only one component's buffers exist at a time: 2 x 1 GiB, not 4.
    us = blocks(4, phase="a") + blocks(4, group="B", phase="b")
    p = plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=2 * GIB)
    assert len(p.streamed) == 8 and p.expected_peak == 2 * GIB and p.slots == {"Block": (2, GIB), "B": (2, GIB)}
    # Two groups of one phase share one pool: 2 buffers of the larger block, not 2 of each.
    us = blocks(4, 2 * GIB, phase="a") + [Unit(f"a.small.{i}", GIB, "B", "a") for i in range(4)]
    p = plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=4 * GIB)
    assert len(p.streamed) == 8 and p.slots == {"Block+B": (2, 2 * GIB)} and p.expected_peak == 4 * GIB


def test_prefetch_order_without_times():
    # "Copy of streamed block j starts when streamed block j - prefetch starts", cyclic.
    p = plan_offload(blocks(6), fixed_bytes=0, activation_bytes=0, budget_bytes=4 * GIB, prefetch=1)
    s = p.streamed
    assert len(s) == 4
    for a, b in zip(s, s[1:] + s[:1]):
        assert p.schedule[a] == [b]
    p2 = plan_offload(blocks(8), fixed_bytes=0, activation_bytes=0, budget_bytes=3 * GIB, prefetch=2)
    s = p2.streamed  # all 8 stream through 3 buffers; each copy starts two streamed blocks ahead
    assert p2.slots["Block"][0] == 3 and p2.schedule[s[0]] == [s[2]] and p2.schedule[s[7]] == [s[1]]


def test_prefetch_jit_with_times():
    # Copy of 1 GiB at 10 GiB/s = 0.1 s; blocks take 0.07 s: two blocks of compute cover it,
    # so the copy starts two blocks before use ("as late as possible, finished in time") ...
    # 8 GiB with prefetch 3: 4 buffers, 4 blocks resident, 6 stream (0.6 s of copies per
    # 0.7 s call: they can hide).
    us = blocks(10, time_s=0.07)
    p = plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=8 * GIB, prefetch=3,
                     bandwidth_bytes_s=10 * GIB)
    assert len(p.streamed) == 6
    pos = {u.name: i for i, u in enumerate(us)}
    for issuer, copies in p.schedule.items():
        for c in copies:
            assert (pos[c] - pos[issuer]) % 10 == 2
    assert p.stall_s["t"] == pytest.approx(0.0, abs=1e-9)
    # ... and with slow copies (1 s each) the same schedule cannot hide them: stalls appear.
    slow = plan_offload(us, fixed_bytes=0, activation_bytes=0, budget_bytes=8 * GIB, prefetch=3,
                        bandwidth_bytes_s=GIB)
    assert slow.stall_s["t"] > 1.0


def test_simulate_counts_waits():
    us = blocks(2, time_s=1.0)
    # Both stream through one buffer, no prefetch: each waits its whole copy (0.5 s).
    w = simulate(us, {u.name for u in us}, {}, {"Block": (1, GIB)}, 2 * GIB)
    assert w == pytest.approx(1.0)


# -- the spec section -----------------------------------------------------------------------

def test_plan_phase_residency_evicts_for_the_phase_that_needs_it():
    # A VAE phase needing 4 GiB of activations beside 10 x 1 GiB blocks at a 10 GiB budget:
    # without phase residency it decides how many blocks stay; with it, two resident blocks
    # leave the card while the VAE runs and the denoiser's own needs decide.
    us = blocks(10) + [Unit("vae.decoder", GIB // 4, "Dec", "vae", once=True, activation=4 * GIB)]
    plain = plan_offload(us, fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=10 * GIB)
    p = plan_offload(us, fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=10 * GIB, phase_residency=True)
    assert (len(plain.streamed), len(p.streamed)) == (7, 5) and not plain.evict
    # denoiser phase: 1 fixed + 6 resident + 2 buffers + 1 activations = 10; VAE phase:
    # 1 + 6 + 0.25 decoder + 4 = 11.25 -> the last two resident blocks leave (2 GiB).
    assert p.expected_peak == 10 * GIB and p.evict == {"vae": ["t.blocks.8", "t.blocks.6"]}
    assert p.reload_s == {"t": pytest.approx(2 * GIB / 55e9)}
    assert p.to_dict()["evict"] == {"vae": ["t.blocks.8", "t.blocks.6"]}
    roomy = plan_offload(us, fixed_bytes=GIB, activation_bytes=GIB, budget_bytes=20 * GIB, phase_residency=True)
    assert not roomy.streamed and not roomy.evict  # everything fits in place: nothing moves


def test_plan_streams_an_equal_share_of_every_block_group():
    # Flux's shape: 4 large blocks, then 8 small ones, in one phase, 12 GiB. Largest-first
    # streams the 4 large ones back to back (copy-bound there, while the copy engine idles
    # behind the resident small ones); the balanced choice, the default, streams as equal a
    # share of each group as the block sizes allow, spread over the call. Both groups stream
    # through one pool of 2 buffers of the largest block (2 x 2 GiB, not 2 x 2 + 2 x 1).
    def mk(t_big=None, t_small=None):
        return [*blocks(4, 2 * GIB, time_s=t_big, group="Big"),
                *[Unit(f"t.s{i}", GIB, "Small", "t", time_s=t_small) for i in range(8)]]

    p = plan_offload(mk(), fixed_bytes=0, activation_bytes=0, budget_bytes=12 * GIB)
    big = [n for n in p.streamed if n.startswith("t.blocks")]
    assert (len(big), len(p.streamed) - len(big)) == (2, 4)
    assert p.slots == {"Big+Small": (2, 2 * GIB)} and p.expected_peak == 12 * GIB
    # With per-block times the planner simulates both choices and keeps the one that waits
    # less: the balanced one when the small blocks' compute can hide copies, largest-first
    # when only the large blocks' compute can (the balanced set streams small blocks whose
    # compute hides nothing).
    largest = {f"t.blocks.{i}" for i in range(4)}
    picked = []
    for times in ((0.01, 0.01), (0.005, 0.04), (0.08, 0.005)):
        timed = mk(*times)
        q = plan_offload(timed, fixed_bytes=0, activation_bytes=0, budget_bytes=12 * GIB)
        cost = lambda st, pools: simulate(timed, st, prefetch_schedule(timed, st, 1, 55e9), pools, 55e9)  # noqa: E731
        assert cost(set(q.streamed), q.slots) <= min(cost(largest, {"Big": (2, 2 * GIB)}),
                                                     cost(set(p.streamed), p.slots)) + 1e-12
        picked.append(set(q.streamed) == largest)
    assert picked == [False, False, True]


def test_spec_validation():
    assert OffloadSpec.from_shorthand("once").once and OffloadSpec.from_shorthand("stream").mode == "stream"
    with pytest.raises(ValueError, match="choices: auto, resident, stream"):
        PlanLayer(offload={"Block": "streem"})
    with pytest.raises(ValueError, match="did you mean 'memory_budget_gib'"):
        PlanLayer(offload={"": {"memory_budgt_gib": 3}})
    with pytest.raises(ValueError, match="must be > 0"):
        PlanLayer(offload={"": {"memory_budget_gib": 0}})
    with pytest.raises(ValueError, match="prefetch must be 1..8"):
        PlanLayer(offload={"": {"prefetch": 0}})
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive, finite number of GiB"):
            with_memory_budget([("user", PlanLayer(offload={"Block": "auto"}))], bad)
    with pytest.raises(ValueError, match="names no"):
        with_memory_budget([("user", PlanLayer())], 24)


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.a, self.b, self.n = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(self.n(x))))


class Net(nn.Module):
    def __init__(self, n=6, d=32):
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return x


BLOCK = sum(p.numel() * 4 for p in Block().parameters())  # fp32 bytes of one block


def offload_plan(budget_bytes, **compile_spec):
    return {"compile": {"Block": {"fullgraph": True, "backend": "eager", **compile_spec}},
            "offload": {"": {"memory_budget_gib": budget_bytes / GIB, "activation_gib": 0.0}, "Block": "auto"}}


def test_spec_keys_in_the_wrong_place():
    root = nn.ModuleDict({"t": Net()})
    with pytest.raises(ValueError, match="apply to the whole plan"):
        apply(root, {"offload": {"Block": {"memory_budget_gib": 1}}}, gpu="cpu")
    with pytest.raises(ValueError, match="phase_activation_gib belongs to a unit"):
        apply(root, {"offload": {"": {"phase_activation_gib": 1}, "Block": "auto"}}, gpu="cpu")
    with pytest.raises(ValueError, match="the root is never a unit"):
        apply(root, {"offload": {"": {"mode": "stream"}, "Block": "auto"}}, gpu="cpu")


# -- mechanics on CPU -----------------------------------------------------------------------

def tiny_net(n=6):
    """A seeded Net in a ModuleDict, an input, its output and its weights before any plan."""
    torch.manual_seed(0)
    root = nn.ModuleDict({"t": Net(n=n)})
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref = root.t(x)
    return root, x, ref, {k: v.clone() for k, v in root.state_dict().items()}


def assert_undone(root, before):
    """After remove: every weight as before, no hook left."""
    after = root.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in root.modules())


def test_streaming_compiled_blocks_no_recompile_exact_undo(fresh_dynamo):
    root, x, ref, before = tiny_net()
    # fixed = emb (32*32+32)*4 B; 3 blocks resident + 2 buffers: 3 streamed of 6.
    fixed = (32 * 32 + 32) * 4
    rep = apply(root, offload_plan(fixed + 5 * BLOCK), gpu="cpu")
    rt = off.runtime(root)
    assert len(rt.plan.streamed) == 3 and "3 streamed" in rep.step("offload").did
    with torch.no_grad():
        outs = [root.t(x) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)  # copies are exact
    r = rep.region("Block")
    # One compiled frame for all 6 blocks, resident or streamed: swapping a parameter's
    # storage (same shape, stride, dtype, device) is not a guard failure.
    assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (1, 0, 0)
    c = rt.counters
    # 3 calls x 3 streamed blocks = 9 uses; the first is a demand copy, every later one was
    # prefetched, and the last block prefetched the first one of a 4th call: 10 copies.
    assert (c.copies, c.demand, c.prefetched, c.deferred) == (10, 1, 9, 0)
    assert c.bytes_copied == 10 * BLOCK
    # Between calls the streamed blocks' weights are in their host buffers, not the device buffers.
    streamed = root.get_submodule(rt.plan.streamed[0])
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in rt.units[rt.plan.streamed[0]].group.slots
             if b is not None]
    assert spans and all(not lo <= p.data_ptr() < hi for p in streamed.parameters() for lo, hi in spans)
    remove(root)
    assert off.runtime(root) is None
    assert_undone(root, before)
    with torch.no_grad():
        assert torch.equal(root.t(x), ref)


class SmallBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.a = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.a(x))


SMALL = sum(p.numel() * 4 for p in SmallBlock().parameters())


def test_two_block_classes_stream_through_one_shared_pool(fresh_dynamo):
    """Flux's shape in miniature: 4 large blocks then 4 small ones in one component. Both
    classes stream through one pool of 2 flat buffers sized for the large block (views laid
    out like each unit's weights); outputs exact, one compiled frame per class, no recompile."""
    torch.manual_seed(0)
    net = Net(n=4)
    net.blocks.extend(SmallBlock() for _ in range(4))
    root = nn.ModuleDict({"t": net})
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref = root.t(x)
    fixed = (32 * 32 + 32) * 4
    plan = {"compile": {c: {"fullgraph": True, "backend": "eager"} for c in ("Block", "SmallBlock")},
            "offload": {"": {"memory_budget_gib": (fixed + 2 * BLOCK + 2 * BLOCK + 2 * SMALL) / GIB,
                             "activation_gib": 0.0}, "Block": "auto", "SmallBlock": "auto"}}
    rep = apply(root, plan, gpu="cpu")
    rt = off.runtime(root)
    assert rt.plan.slots == {"Block+SmallBlock": (2, BLOCK)}
    kinds = {type(root.get_submodule(p)).__name__ for p in rt.plan.streamed}
    assert kinds == {"Block", "SmallBlock"}  # the balanced placement streams some of each
    pools = {id(u.group) for u in rt.units.values()}
    assert len(pools) == 1
    with torch.no_grad():
        outs = [root.t(x) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    g = next(iter(rt.units.values())).group
    # Two flat buffers, each as large as the larger block's packed weights, never more.
    assert [b.numel() for b in g.slots if b is not None] == [g.nbytes] * 2 and g.nbytes >= BLOCK
    assert g.nbytes < BLOCK + SMALL
    for cls in ("Block", "SmallBlock"):
        r = rep.region(cls)
        assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (1, 0, 0)
    assert rt.counters.copies == 3 * len(rt.plan.streamed) + 1 and rt.counters.demand == 1
    remove(root)
    with torch.no_grad():
        assert torch.equal(root.t(x), ref)


def test_refit_moves_units_both_ways_without_recompiles(fresh_dynamo):
    """A refit on another activation reserve re-plans and moves only the units whose place
    changes: a lower reserve makes streamed blocks resident (their hooks gone), a higher one
    streams more again; outputs stay exact and the compiled blocks never recompile."""
    root, x, ref, before = tiny_net()
    fixed = (32 * 32 + 32) * 4
    spec = offload_plan(fixed + 5 * BLOCK)
    spec["offload"][""]["activation_gib"] = 2 * BLOCK / GIB  # 1 resident + 2 buffers + 2 reserved
    rep = apply(root, spec, gpu="cpu")
    rt = off.runtime(root)
    assert len(rt.plan.streamed) == 5
    with torch.no_grad():
        assert torch.equal(root.t(x), ref)
    got = off.refit(root, activation_gib={"t": 0.0})  # the measured peak: nothing beyond the weights
    assert len(got["made_resident"]) == 2 and not got["made_streamed"] and len(rt.plan.streamed) == 3
    assert got["plan"]["measured_phases"] == ["t"] and got["plan"]["activation_gib_per_phase"] == {"t": 0.0}
    for path in got["made_resident"]:
        m = root.get_submodule(path)
        assert not off.streams(m) and not m._forward_pre_hooks and not m._forward_hooks
    with torch.no_grad():
        outs = [root.t(x) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    streamed = set(rt.plan.streamed)
    got = off.refit(root, activation_gib={"t": 2 * BLOCK / GIB})
    assert len(got["made_streamed"]) == 2 and set(got["made_streamed"]) == set(rt.plan.streamed) - streamed
    assert len(rt.plan.streamed) == 5 and all(off.streams(root.get_submodule(p)) for p in rt.plan.streamed)
    with torch.no_grad():
        assert torch.equal(root.t(x), ref)
    r = rep.region("Block")
    assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (1, 0, 0)
    assert rt.counters.refits == 2
    remove(root)
    assert_undone(root, before)


def test_refit_errors_say_what_to_pass():
    root = nn.ModuleDict({"t": Net()})
    with pytest.raises(ValueError, match="no weights stream"):
        off.refit(root, activation_gib={"t": 0.0})
    fixed = (32 * 32 + 32) * 4
    apply(root, offload_plan(fixed + 5 * BLOCK), gpu="cpu")
    with pytest.raises(ValueError, match=r"unknown phase\(s\) \['vae'\]; the plan's phases are \['t'\]"):
        off.refit(root, activation_gib={"vae": 1.0})
    with pytest.raises(ValueError, match="pass call"):
        off.refit(root)
    with pytest.raises(ValueError, match="needs CUDA"):
        off.refit(root, lambda: None)
    remove(root)


def test_phase_residency_moves_resident_blocks_out_and_back():
    """While the one-block component "v" runs (declared to need a large activation reserve),
    the denoiser's resident blocks the plan evicts point at their host copies; they are back
    before the denoiser runs again (and "v", run once per generation, leaves while the
    denoiser runs: the whole model never has to fit at once); outputs stay exact, nothing
    streams per step, nothing recompiles, remove undoes all."""
    torch.manual_seed(0)
    root = nn.ModuleDict({"t": Net(n=6), "v": Block()})
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref_t, ref_v = root.t(x), root.v(x)
    before = {k: v.clone() for k, v in root.state_dict().items()}
    fixed = (32 * 32 + 32) * 4
    spec = {"compile": {"Block": {"backend": "eager", "fullgraph": True}},
            "offload": {"": {"memory_budget_gib": (fixed + 6 * BLOCK) / GIB, "activation_gib": 0.0,
                             "phase_residency": True},
                        "Block": "auto", "v": {"once": True, "phase_activation_gib": 3 * BLOCK / GIB}}}
    rep = apply(root, spec, gpu="cpu")
    rt = off.runtime(root)
    assert not rt.plan.streamed and rt.plan.evict == {"t": ["v"], "v": [f"t.blocks.{i}" for i in (5, 4, 3, 2)]}
    gone = rt.plan.evict["v"]
    seen = {}
    root.v.register_forward_pre_hook(lambda m, a: seen.update(
        v={p: all(any(t.data_ptr() == h.data_ptr() for h in rt.evict_host[p]) for t in root.get_submodule(p).parameters())
           for p in gone}))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(root.t(x), ref_t)
            assert rt.evicted == {"v"}
            assert torch.equal(root.v(x), ref_v)
            assert rt.evicted == set(gone) and all(seen["v"].values())  # host copies while v ran
    with torch.no_grad():
        assert torch.equal(root.t(x), ref_t) and rt.evicted == {"v"}  # t's blocks back before they ran
    c = rt.counters
    assert c.copies == 0 and c.reloads == 2 + 2 * len(gone) and c.evictions == c.reloads + len(rt.evicted)
    r = rep.region("Block")
    assert (len(r.counters.recompiles), r.counters.n_graph_breaks) == (0, 0)
    remove(root)
    after = root.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in root.modules() if m is not root.v)


def test_refit_with_phase_residency_rebuilds_the_evictions():
    """A refit under phase residency: every evicted unit comes back first, the new plan's
    evictions (here: none, "v"'s measured reserve is small) replace the old ones, units move,
    and the outputs stay exact through it."""
    torch.manual_seed(0)
    root = nn.ModuleDict({"t": Net(n=6), "v": Block()})
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref_t, ref_v = root.t(x), root.v(x)
    fixed = (32 * 32 + 32) * 4
    spec = {"compile": {"Block": {"backend": "eager"}},
            "offload": {"": {"memory_budget_gib": (fixed + 8 * BLOCK) / GIB, "activation_gib": 0.0,
                             "phase_residency": True},
                        "Block": "auto", "v": {"once": True, "phase_activation_gib": 3 * BLOCK / GIB}}}
    apply(root, spec, gpu="cpu")
    rt = off.runtime(root)
    assert rt.plan.evict.get("v")
    with torch.no_grad():
        root.t(x), root.v(x)  # v ran last: its evictions are in force
    assert rt.evicted == set(rt.plan.evict["v"])
    got = off.refit(root, activation_gib={"v": 0.0})
    assert not rt.plan.evict and not rt.evicted and not rt._evict_hooks and not rt.plan.streamed
    assert got["made_resident"] == [] and got["made_streamed"] == []
    with torch.no_grad():
        assert torch.equal(root.t(x), ref_t) and torch.equal(root.v(x), ref_v)
    off.refit(root, activation_gib={"v": 3 * BLOCK / GIB})  # and back: the evictions return
    assert rt.plan.evict.get("v")
    with torch.no_grad():
        assert torch.equal(root.v(x), ref_v) and rt.evicted == set(rt.plan.evict["v"])
        assert torch.equal(root.t(x), ref_t)
    remove(root)


def test_everything_fits_changes_nothing():
    root = nn.ModuleDict({"t": Net()})
    ptrs = [p.data_ptr() for p in root.parameters()]
    rep = apply(root, offload_plan(GIB), gpu="cpu")
    assert rep.step("offload").did.startswith("all weights resident") and off.runtime(root) is None
    assert ptrs == [p.data_ptr() for p in root.parameters()]
    assert not any(m._forward_pre_hooks for m in root.modules())


def test_budget_too_small_refused_before_anything_changes():
    root = nn.ModuleDict({"t": Net()})
    ptrs = [p.data_ptr() for p in root.parameters()]
    with pytest.raises(OffloadPlanError, match="needs at least"):
        apply(root, offload_plan(BLOCK), gpu="cpu")
    assert ptrs == [p.data_ptr() for p in root.parameters()]
    assert not any(m._forward_pre_hooks for m in root.modules())


def test_nested_component_unit_and_grad_guard():
    # A whole component (its own weights: emb) streams, and its blocks stream inside it.
    torch.manual_seed(0)
    root = nn.ModuleDict({"enc": Net(n=3)})
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref = root.enc(x)
    plan = {"compile": {"Block": {"backend": "eager"}},
            "offload": {"": {"memory_budget_gib": 3 * BLOCK / GIB, "activation_gib": 0.0},
                        "enc": "once", "Block": "once"}}
    apply(root, plan, gpu="cpu")
    rt = off.runtime(root)
    assert "enc" in rt.plan.streamed and rt.plan.transient > 0
    with torch.no_grad():
        assert torch.equal(root.enc(x), ref)
    assert rt.units["enc"].group.slots == [None]  # a one-of-a-kind unit's buffer is freed after use
    with pytest.raises(RuntimeError, match="inference-only"):
        root.enc(x)
    remove(root)


def two_components():
    """Two 4-block Nets as two components ("a" then "b"), an input, their chained output,
    and the bytes outside blocks (the two embeddings)."""
    torch.manual_seed(0)
    root = nn.ModuleDict({"a": Net(n=4), "b": Net(n=4)})
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref = root.b(root.a(x))
    return root, x, ref, 2 * (32 * 32 + 32) * 4


def test_a_new_phase_frees_the_previous_ones_buffers():
    root, x, ref, fixed = two_components()
    plan = {"compile": {"Block": {"backend": "eager"}},
            "offload": {"": {"memory_budget_gib": (fixed + 2 * BLOCK) / GIB, "activation_gib": 0.0}, "Block": "auto"}}
    apply(root, plan, gpu="cpu")
    rt = off.runtime(root)
    assert len(rt.plan.streamed) == 8  # both components' blocks, 2 buffers per phase
    ga, gb = rt.units["a.blocks.0"].group, rt.units["b.blocks.0"].group
    assert ga is not gb
    with torch.no_grad():
        for _ in range(2):
            y = root.a(x)
            assert gb.slots == [None, None] and all(s is not None for s in ga.slots)
            y = root.b(y)
            assert ga.slots == [None, None] and all(s is not None for s in gb.slots)
            assert torch.equal(y, ref)
    assert rt.counters.phase_changes == 4
    remove(root)


class FakeMemory:
    """Allocator statistics for a CPU run: `level` is what is reserved now; the peak is its
    maximum since the last reset."""

    def __init__(self):
        self.level, self.peak, self.resets = 0, 0, 0

    def set(self, level):
        self.level = level
        self.peak = max(self.peak, level)

    sync = empty_cache = lambda self: None  # noqa: E731

    def peak_reserved(self):
        return self.peak

    def reset_peak(self):
        self.peak, self.resets = self.level, self.resets + 1


def test_refit_measures_each_phase_of_one_call():
    """refit's measuring call spans two components: each gets its own peak (the statistics
    restart at the phase change), and the new plan is the planner's on those peaks."""
    root, x, ref, fixed = two_components()
    plan = {"compile": {"Block": {"backend": "eager"}},
            "offload": {"": {"memory_budget_gib": (fixed + 7 * BLOCK) / GIB, "activation_gib": 2 * BLOCK / GIB},
                        "Block": "auto"}}
    apply(root, plan, gpu="cpu")
    rt = off.runtime(root)
    mem = rt.memory = FakeMemory()
    act = {"a": 3 * BLOCK, "b": BLOCK // 2}  # what each component's blocks "allocate" while they run
    live = lambda: sum({id(u.group): sum(b.numel() for b in u.group.slots if b is not None)  # noqa: E731
                        for u in rt.units.values()}.values())
    for name in ("a", "b"):
        for blk in root[name].blocks:
            blk.register_forward_pre_hook(lambda m, a, n=name: mem.set(rt.weights_on_device + live() + act[n]))
            blk.register_forward_hook(lambda m, a, o: mem.set(rt.weights_on_device + live()))

    def call():
        with torch.no_grad():
            return root.b(root.a(x))

    units, old = rt.plan_units, rt.plan
    got = off.refit(root, call, margin=0.0, floor_gib=0.0)
    assert got["measured_gib"] == {"a": round(3 * BLOCK / GIB, 3), "b": round(BLOCK / 2 / GIB, 3)}
    assert mem.resets >= 2  # at the start and at the phase change
    want = plan_offload(units, fixed_bytes=old.fixed, activation_bytes=old.activation, budget_bytes=old.budget,
                        phase_activation_bytes={"a": 3 * BLOCK, "b": BLOCK // 2})
    assert rt.plan.streamed == want.streamed and rt.plan.phase_activation == {"a": 3 * BLOCK, "b": BLOCK // 2}
    assert rt.plan.streamed != old.streamed  # the measured peaks moved units
    with torch.no_grad():
        assert torch.equal(call(), ref)
    remove(root)


def test_profile_units_feeds_the_planner():
    root = nn.ModuleDict({"t": Net(n=4)})
    x = torch.randn(2, 32)
    paths = [f"t.blocks.{i}" for i in range(4)]
    with torch.no_grad():
        times = off.profile_units(root, paths, lambda: root.t(x), "cpu")
    assert set(times) == set(paths) and all(t > 0 for t in times.values())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in root.modules())
    plan = {"offload": {"": {"memory_budget_gib": 3 * BLOCK / GIB, "activation_gib": 0.0}, "Block": "auto"}}
    from magi_zoo.engine.resolve import resolve
    from magi_zoo.specs.plan import as_layers

    p, *_ = off.plan_units(root, resolve(root, as_layers(plan)), magi_zoo.specs.get_profile("cpu"), times_s=times)
    assert "t" in p.stall_s  # times known for every unit: the plan simulates its stalls


def test_profile_units_refuses_a_call_that_runs_none_of_them():
    # a call served without running the units' Python (a CUDA graph's replay) would give an
    # empty profile, which the planner would read as "every copy hidden"
    root = nn.ModuleDict({"t": Net(n=2)})
    x = torch.randn(2, 32)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"none of the 2 units .*cuda_graphs.bypassed"):
        off.profile_units(root, ["t.blocks.0", "t.blocks.1"], lambda: x * 2, "cpu")
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in root.modules())


def test_training_apply_refuses_streaming():
    root = nn.ModuleDict({"t": Net()})
    with pytest.raises(ValueError, match="inference-only"):
        apply(root, offload_plan(3 * BLOCK), gpu="cpu", train=True)
    assert not any(m._forward_pre_hooks for m in root.modules())


def test_compiled_ancestor_and_cudagraphs_refused():
    root = nn.ModuleDict({"t": Net()})
    plan = offload_plan(3 * BLOCK)
    plan["compile"] = {"t": {"backend": "eager"}}
    with pytest.raises(ValueError, match="inside the compiled region"):
        apply(root, plan, gpu="cpu")
    with pytest.raises(ValueError, match="CUDA graphs"):
        apply(root, offload_plan(3 * BLOCK, mode="reduce-overhead"), gpu="cpu")
    with pytest.raises(ValueError, match="uses options triton.cudagraphs \\(CUDA graphs\\)"):
        apply(root, offload_plan(3 * BLOCK, options={"triton.cudagraphs": True}), gpu="cpu")
    assert not any(m._forward_pre_hooks for m in root.modules())


def test_host_memory_check(monkeypatch):
    monkeypatch.setattr(off.arena, "available_host_bytes", lambda: 10 * MB)
    with pytest.raises(MemoryError, match="pinned host memory"):
        off.check_host_memory(20 * GIB, already_on_host=GIB)
    off.check_host_memory(5 * MB)
    off.check_host_memory(20 * GIB, already_on_host=20 * GIB)  # built in host memory: moved, not doubled


def test_host_arenas_do_not_round_each_block_up():
    # Torch's pinned allocator rounds each request up to a power of two: 24 Wan blocks of
    # 0.75 GiB one buffer each would take 24 GiB; packed into 1 GiB arenas they take 19.
    block = [int(0.752 * GIB) // 30] * 30
    assert off.HostArenas.rounded(block * 24, pinned=True) == 19 * GIB
    assert off.HostArenas.rounded([int(1.96 * GIB)], pinned=True) == 2 * GIB  # own buffer, rounded
    assert off.HostArenas.rounded([1000] * 10, pinned=True) == 16384  # a tiny model: one small arena


def test_cli_spec_shows_the_offload_plan(capsys):
    from magi_zoo.cli import main

    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu", "--memory-budget", "0.00001"]) == 0
    out = capsys.readouterr().out
    assert "[offload plan]" in out and "refused" in out and "needs at least" in out
    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu"]) == 0
    assert "all weights resident" in capsys.readouterr().out


def test_gpu_profiles_select_offload_by_themselves():
    # The published Wan-I2V-14B (42.8 GiB of weights) on the meta device: fits an H100, not
    # an L40S (48 GiB with a 6 GiB activation reserve) nor an RTX 4090.
    from magi_zoo import adapters
    from magi_zoo.specs import get_profile
    from magi_zoo.overrides import spec_layers

    adapter, variant = adapters.lookup("wan2.1-i2v-14b-480p")
    native = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    root = nn.ModuleDict(adapter.components(native))
    need = {g: needs_streaming(root, spec_layers(adapter, get_profile(g)), get_profile(g))
            for g in ("h100", "l40s", "rtx4090")}
    assert need["h100"] is None and need["l40s"] is not None and need["rtx4090"] is not None
    p = need["rtx4090"]
    assert p.expected_peak <= 24 * GIB and "transformer.blocks.39" in p.streamed
    assert "text_encoder" in p.streamed  # the text encoder is on the card only while it encodes


def test_load_refuses_a_budget_before_building(monkeypatch):
    from magi_zoo.adapters.wan import WanAdapter

    built = []
    real = WanAdapter.build
    monkeypatch.setattr(WanAdapter, "build", lambda self, v, **kw: built.append(kw["device"].type) or real(self, v, **kw))
    # the reserves sized for the tiny call (docs/offload.md): 0.25 GiB plan-wide, 0.251 GiB while
    # the VAE runs (the largest phase; each estimate + the 0.25 GiB floor)
    with pytest.raises(OffloadPlanError, match="needs at least 0.25 GiB.*activations 0.25 GiB in its largest phase"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", memory_budget_gib=0.2)
    assert built == ["meta"]  # only the sizes were built


def test_load_tiny_wan_with_a_budget_generates_the_same_video():
    kw = dict(gpu="cpu", compile={"WanTransformerBlock": {"backend": "eager"}},
              overrides=NO_RESERVE)
    ref = magi_zoo.load("wan2.1-tiny", **kw)
    call = dict(prompt="a corgi", output_type="np", num_inference_steps=2)
    want = ref(generator=torch.Generator().manual_seed(0), **call).frames
    h = magi_zoo.load("wan2.1-tiny", memory_budget_gib=0.00025, **kw)  # 256 KiB: most units stream
    rt = off.runtime(h.modules)
    assert rt is not None and "transformer.blocks.0" in rt.plan.streamed and "text_encoder" in rt.plan.streamed
    got = h(generator=torch.Generator().manual_seed(0), **call).frames
    assert (got == want).all()
    assert rt.counters.copies > 0
    rec = h.report().step("offload")
    assert "streamed" in rec.did and rec.details["plan"]["streamed"]
    # refit through the handle measures one generation phase by phase (allocator statistics
    # faked on CPU: no activations, so with no margin the plan stays as it is).
    rt.memory = FakeMemory()
    fit = h.refit_offload(prompt="a corgi", output_type="np", num_inference_steps=1, margin=0.0, floor_gib=0.0)
    streamed_phases = {p.split(".")[0] for p in rt.plan.streamed}
    assert set(fit["measured_gib"]) == streamed_phases and {"text_encoder", "transformer"} <= streamed_phases
    assert not fit["made_resident"] and not fit["made_streamed"] and rt.counters.refits == 1
    assert (h(generator=torch.Generator().manual_seed(0), **call).frames == want).all()
    with pytest.raises(ValueError, match=r"unknown phase\(s\) \['transformerr'\] \(did you mean \['transformer'\]\?\)"):
        h.refit_offload(activation_gib={"transformerr": 1.0})


def test_bagel_tiny_streams_its_mot_layers_exactly():
    # The [gpu.rtx4090] way: whole-graph entry points fenced off, regional MoT layers streamed.
    import numpy as np

    comp = {"BagelMoTLayer": {"backend": "eager"}, "model.vit_model": {"backend": "eager"},
            "model": {"denoise_step": {"enabled": False}, "decode_step": {"enabled": False}}}
    kw = dict(gpu="cpu", compile=comp, overrides={"offload": {"": {"activation_gib": 0.0}}})
    ref = magi_zoo.load("bagel-tiny", **kw)
    want = np.asarray(ref.adapter.generate(ref, prompt="a corgi", progress=False, seed=0).value, dtype=np.float32)
    h = magi_zoo.load("bagel-tiny", memory_budget_gib=5.85 / 1024, **kw)  # 5.85 MiB: every layer streams
    rt = off.runtime(h.modules)
    assert rt is not None and len(rt.plan.streamed) == 3
    got = np.asarray(h.adapter.generate(h, prompt="a corgi", progress=False, seed=0).value, dtype=np.float32)
    assert (got == want).all() and rt.counters.copies > 0
    assert h.report().recompiles == 0 and h.report().graph_breaks == 0


def test_bagel_guided_step_streams_each_layer_once():
    from magi_zoo.adapters.bagel import model as bagel_model

    # One CFG step over three contexts runs every MoT layer three times. Streamed layers run
    # layer by layer under offload.hold: each is copied once per step (not once per context),
    # and the velocity is exactly the resident one (same operations, another order).
    comp = {"BagelMoTLayer": {"backend": "eager"}, "model.vit_model": {"backend": "eager"},
            "model": {"denoise_step": {"enabled": False}, "decode_step": {"enabled": False}}}
    kw = dict(gpu="cpu", compile=comp, overrides={"offload": {"": {"activation_gib": 0.0}}})
    ref = magi_zoo.load("bagel-tiny", **kw)
    h = magi_zoo.load("bagel-tiny", memory_budget_gib=5.85 / 1024, **kw)  # every layer streams
    h.pipe.model.load_state_dict(ref.pipe.model.state_dict())  # the same weights in both
    rt = off.runtime(h.modules)
    layers = list(h.pipe.model.layers)
    assert all(off.streams(layer) for layer in layers) and not any(off.streams(x) for x in ref.pipe.model.layers)
    inputs = ref.adapter.example_inputs(ref.pipe, ref.variant, "denoise")
    with torch.inference_mode():
        want = ref.pipe.model(**inputs)
        before = rt.counters.copies
        got = h.pipe.model(**inputs)
    assert rt.counters.copies - before == len(layers)  # 3 contexts, one copy per layer
    assert torch.equal(got, want)
    # Context by context (no hold), the same step copies every layer once per context.
    seen = []

    def no_hold(module):
        seen.append(module)
        return contextlib.nullcontext()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bagel_model, "offload_hold", no_hold)  # the name BAGEL's model calls
        with torch.inference_mode():
            before = rt.counters.copies
            again = h.pipe.model(**inputs)
    assert len(seen) == len(layers) and rt.counters.copies - before == 3 * len(layers)
    assert torch.equal(again, want)
    # hold() on a module that does not stream is a no-op
    with off.hold(ref.pipe.model.layers[0]):
        pass


def test_bagel_whole_graph_entry_points_refuse_streaming():
    # The shipped default compiles denoise_step whole: streaming a layer inside it is refused.
    with pytest.raises(ValueError, match="inside the compiled region 'model'"):
        magi_zoo.load("bagel-tiny", gpu="cpu", memory_budget_gib=5.85 / 1024,
                      compile={"BagelMoTLayer": {"backend": "eager"}, "model.vit_model": {"backend": "eager"}},
                      overrides={"offload": {"": {"activation_gib": 0.0}}})


def test_streamed_pipeline_executes_on_the_card():
    # With units on the host, diffusers' `_execution_device` would be the host (the first
    # component's parameter device): prompt ids and latents would be made on the CPU while
    # the streamed embedding runs on the card. The runtime marks each component with the
    # card as its execution device (accelerate's convention) and takes the mark off on undo.
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    assert h.pipe._execution_device == torch.device("cpu")
    rt = off.OffloadRuntime.__new__(off.OffloadRuntime)
    rt.root, rt.device, rt.cuda = h.modules, torch.device("cuda", 0), False
    rt._originals, rt.units, rt._marked, rt.evicted, rt._evict_hooks = [], {}, [], set(), []
    rt._mark_execution_device()
    assert h.pipe._execution_device == torch.device("cuda", 0)
    h.pipe.remove_all_hooks()  # the diffusers API still works with the mark in place
    rt._mark_execution_device()
    rt.remove()
    assert h.pipe._execution_device == torch.device("cpu")
    assert not any("_hf_hook" in m.__dict__ for m in h.modules.children())
