"""The engine on plain nn.Modules (not zoo models): regional, per-method and whole-graph
compile, counters as the oracle, nesting, removal, and error messages."""

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo import PlanError, TorchCompileSpec
from magi_zoo.engine import counters as compat
from magi_zoo.engine import installed, remove

EAGER = {"backend": "eager"}


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.lin(self.norm(x)))

    def forward_batched(self, xs):
        return torch.stack([self.forward(x) for x in xs.unbind(0)])


class Net(nn.Module):
    def __init__(self, n=6, d=16):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class BreakyHead(nn.Module):
    def forward(self, x):
        if x.sum().item() > 1e9:  # .item() in a branch: a data-dependent graph break
            x = x * 2
        return x + 1


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net().eval()


def test_n_identical_blocks_cost_one_compile(net, fresh_dynamo):
    rep = magi_zoo.apply(net, {"Block": EAGER})
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        net(x)
    r = rep.region("Block")
    # 6 blocks, one spec: block 0 compiles one frame; blocks 1..5 hit its cache entry
    # (guards on type and tensor metadata, not identity) => 1 frame, 1 graph, 0 recompiles.
    assert (r.counters.frames, r.counters.graphs, len(r.counters.recompiles)) == (1, 1, 0)
    assert r.calls == 6 and len(r.modules) == 6


def test_regional_compile_matches_eager_inductor(net, fresh_dynamo):
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        ref = net(x)
        magi_zoo.apply(net, {"blocks.*": {"fullgraph": True}})
        out = net(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_no_spec_equals_plain_torch_compile(fresh_dynamo):
    # Acceptance 1: a module with no spec compiles exactly as plain torch.compile would.
    torch.manual_seed(0)
    a, b = Net().eval(), Net().eval()
    b.load_state_dict(a.state_dict())
    a.blocks[2] = nn.Sequential(a.blocks[2], BreakyHead())  # give it a graph break to count
    b.blocks[2] = nn.Sequential(b.blocks[2], BreakyHead())
    x = torch.randn(2, 8, 16)

    before = compat.snapshot()
    plain = torch.compile(a, backend="eager")
    with torch.no_grad():
        plain(x), plain(x)
    d_plain = compat.delta(before)

    torch.compiler.reset()
    rep = magi_zoo.apply(b, {})  # empty plan -> engine default: TorchCompileSpec() on the root
    assert [(r.name, r.spec) for r in rep.regions] == [("", TorchCompileSpec())]
    rep = magi_zoo.apply(b, {"": EAGER})  # same default spec, eager backend to keep it fast
    before = compat.snapshot()
    with torch.no_grad():
        b(x), b(x)
    d_zoo = compat.delta(before)
    assert d_plain.graphs >= 2 and d_plain.n_graph_breaks >= 1  # the .item() break is there
    assert (d_zoo.graphs, d_zoo.frames, d_zoo.n_graph_breaks) == (d_plain.graphs, d_plain.frames, d_plain.n_graph_breaks)
    assert d_zoo.recompiles == d_plain.recompiles == []
    # and the report books all of it to the root region
    assert rep.graphs == d_zoo.graphs and rep.recompiles == 0


def test_graph_break_reasons_are_reported(fresh_dynamo):
    m = nn.Sequential(nn.Linear(4, 4), BreakyHead()).eval()
    rep = magi_zoo.apply(m, {"": EAGER})
    with torch.no_grad():
        m(torch.randn(3, 4))
    assert rep.graph_breaks >= 1
    assert any("item" in reason.lower() or "data-dependent" in reason.lower()
               for reason in rep.regions[0].counters.graph_breaks), rep.regions[0].counters.graph_breaks
    assert "graph break" in rep.details()


def test_fullgraph_true_turns_break_into_error(fresh_dynamo):
    m = nn.Sequential(nn.Linear(4, 4), BreakyHead()).eval()
    magi_zoo.apply(m, {"": {"backend": "eager", "fullgraph": True}})
    with pytest.raises(Exception, match="(?i)item|data-dependent|graph break|Unsupported"):
        with torch.no_grad():
            m(torch.randn(3, 4))


def test_dynamic_false_recompiles_with_reason_dynamic_true_does_not(net, fresh_dynamo):
    rep = magi_zoo.apply(net, {"Block": {"backend": "eager", "dynamic": False}})
    with torch.no_grad():
        net(torch.randn(2, 8, 16)), net(torch.randn(2, 12, 16))
    r = rep.region("Block")
    # static shapes: a new sequence length fails the size guard -> exactly one recompile
    assert (r.counters.frames, len(r.counters.recompiles)) == (2, 1)
    assert "size" in r.counters.recompiles[0].lower()

    torch.compiler.reset()
    rep = magi_zoo.apply(net, {"Block": {"backend": "eager", "dynamic": True}})
    with torch.no_grad():
        net(torch.randn(2, 8, 16)), net(torch.randn(2, 12, 16))
    r = rep.region("Block")
    assert (r.counters.frames, len(r.counters.recompiles)) == (1, 0)  # symbolic from the first call


def test_per_method_compile(net, fresh_dynamo):
    rep = magi_zoo.apply(net, {"blocks.0": {"forward_batched": EAGER}})
    assert installed(net) == [("blocks.0", "forward_batched")]
    xs = torch.randn(3, 5, 16)
    with torch.no_grad():
        out = net.blocks[0].forward_batched(xs)
        ref = torch.stack([Block.forward(net.blocks[0], x) for x in xs.unbind(0)])
    torch.testing.assert_close(out, ref)
    r = rep.region("blocks.0.forward_batched")
    assert r.calls == 1 and r.counters.frames == 1
    # forward itself was left alone
    assert "forward" not in net.blocks[0].__dict__


def test_disabled_region_fences_off_inside_compiled_parent(net, fresh_dynamo):
    rep = magi_zoo.apply(net, {"": EAGER, "blocks.3": {"enabled": False}})
    with torch.no_grad():
        net(torch.randn(2, 8, 16))
    root, fenced = rep.region(""), rep.region("blocks.3")
    assert fenced.spec.enabled is False and fenced.counters.frames == 0
    # the disabled block splits the root: dynamo compiles the root frame and a resume
    # frame after the skipped call, and the break names torch.compiler.disable as its reason
    assert root.counters.frames >= 2 and root.counters.n_graph_breaks == 1
    assert any("disable" in r.lower() or "skip" in r.lower() for r in root.counters.graph_breaks)


def test_nested_regions_book_exclusive_counts(net, fresh_dynamo):
    # Root compiled around regionally compiled blocks: tracing the root inlines the
    # blocks, so the root books the whole graph and the blocks book nothing of it.
    rep = magi_zoo.apply(net, {"": EAGER, "Block": EAGER})
    with torch.no_grad():
        net(torch.randn(2, 8, 16))
    assert rep.region("").counters.frames == 1
    assert rep.region("Block").counters.frames == 0
    assert rep.frames == 1  # totals add up: nothing booked twice


def test_remove_restores_eager_and_reapply_replaces(net, fresh_dynamo):
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        ref = net(x)
    rep1 = magi_zoo.apply(net, {"Block": EAGER})
    n = len(rep1.steps)  # every registered step records itself (prepare, attention, ..., offload, ...)
    assert [r.step for r in rep1.steps] == [s for s in magi_zoo.engine.STEP_ORDER if s in {r.step for r in rep1.steps}]
    rep2 = magi_zoo.apply(net, {"Block": EAGER})  # re-apply: replaces, never stacks wrappers
    # the earlier plan's steps were all undone first
    assert f"replaced an earlier plan ({n} step(s) undone)" in rep2.step("compile").did
    assert len(installed(net)) == 6
    assert remove(net) == n and installed(net) == []
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref)


def test_precedence_and_field_merge(net):
    from magi_zoo.engine import resolve
    from magi_zoo.specs import PlanLayer

    layers = [
        ("model default", PlanLayer.coerce({"Block": {"fullgraph": True}, "blocks.0": {"enabled": False}})),
        ("gpu", PlanLayer.coerce({"blocks.*": {"dynamic": False}})),
        ("user", PlanLayer.coerce({"Block": {"dynamic": True}})),
    ]
    plan = resolve(net, layers)
    by_path = {t.path: t for t in plan.targets}
    # user's dynamic=True beats gpu's dynamic=False; fullgraph from the model default survives
    assert by_path["blocks.1"].spec == TorchCompileSpec(fullgraph=True, dynamic=True)
    assert by_path["blocks.1"].layers == ["model default", "gpu", "user"]
    # within the model default, the exact path beats the class name for block 0
    assert by_path["blocks.0"].spec.enabled is False and by_path["blocks.0"].spec.dynamic is True
    # block 0 ends with another spec than its siblings: it becomes its own region
    regions = plan.regions()
    assert ("Block", "forward") in regions and len(regions[("Block", "forward")]) == 5
    assert ("Block@blocks.0", "forward") in regions


def test_glob_rules(net):
    from magi_zoo.engine.resolve import match_key

    assert match_key(net, "blocks.*")[0] == [f"blocks.{i}" for i in range(6)]
    assert set(match_key(net, "blocks.**")[0]) >= {"blocks.0", "blocks.0.lin", "blocks.5.norm"}
    assert match_key(net, "blocks.*.lin")[0] == [f"blocks.{i}.lin" for i in range(6)]
    assert match_key(net, "")[0] == [""]
    assert match_key(net, "LayerNorm") == ([f"blocks.{i}.norm" for i in range(6)], False)


def test_key_matching_nothing_names_closest(net):
    with pytest.raises(PlanError, match=r"'blocks\.\*\.lins'.*matches no submodule.*blocks\.\d\.lin"):
        magi_zoo.apply(net, {"blocks.*.lins": EAGER})
    with pytest.raises(PlanError, match=r"'Blok'.*Closest.*Block") as e:
        magi_zoo.apply(net, {"Blok": EAGER})
    assert "plan section" not in str(e.value)  # near no section name: no section hint
    # a misspelled section makes the dict read as compile regions: the error says which section
    with pytest.raises(PlanError, match=r"'compiel' is close to the plan section 'compile'"):
        magi_zoo.apply(net, {"compiel": {"blocks.*": EAGER}})


def test_missing_method_names_closest(net):
    with pytest.raises(PlanError, match=r"has no method 'forward_batch'.*forward_batched"):
        magi_zoo.apply(net, {"Block": {"forward_batch": EAGER}})


def test_report_renders(net, fresh_dynamo):
    rep = magi_zoo.apply(net, {"Block": EAGER, "head": {"enabled": False}})
    with torch.no_grad():
        net(torch.randn(2, 8, 16))
    text = str(rep)
    names = [r.step for r in rep.steps]  # every registered step, in STEP_ORDER
    assert names[:3] == ["prepare", "attention", "precision"] and "compile" in names and "offload" in names
    steps = text.splitlines()[1:1 + len(names)]
    assert [line.split(":")[0].strip() for line in steps] == [f"{i}. {n}" for i, n in enumerate(names, 1)]
    assert "custom ops registered" in steps[1]
    assert "6 x Block" in text and "disabled" in text
    d = rep.to_dict()
    assert d["totals"]["frames_compiled"] == 1 and d["regions"][0]["spec"]["backend"] == "eager"


def test_public_api_names_what_the_readme_documents():
    # README "The API": these are reachable from the top-level package
    for name in ("apply", "remove", "load", "TorchCompileSpec", "AttentionSpec", "PrecisionSpec", "PlanLayer"):
        assert hasattr(magi_zoo, name), name


def test_cuda_graphs_on_repeated_blocks_refused_whole_model_allowed():
    """CUDA graphs on a region of several instances are refused before anything is installed
    (their replays overwrite each other's outputs); one instance (the whole model) may."""
    net = Net()
    for spec in ({"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"options": {"triton.cudagraphs": True}}):
        with pytest.raises(ValueError, match=r"'Block' \(forward, 6 instances\) asks for CUDA graphs.*"
                                             r"max-autotune-no-cudagraphs"):
            magi_zoo.apply(net, {"compile": {"Block": spec}}, gpu="cpu")
        assert installed(net) == []
    rep = magi_zoo.apply(net, {"compile": {"Block": {"mode": "max-autotune-no-cudagraphs"}}}, gpu="cpu")
    assert len(installed(net)) == 6
    remove(net)
    rep = magi_zoo.apply(net, {"compile": {"": {"mode": "reduce-overhead"}}}, gpu="cpu")
    assert [r.name for r in rep.regions] == [""] and len(installed(net)) == 1
    remove(net)
