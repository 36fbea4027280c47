"""Out-of-tree adapters: a package registers a family through the `magi_zoo.adapters`
entry-point group and is then loaded, planned and reported like a built-in family,
with no edit to this repository."""

from __future__ import annotations

import textwrap

import pytest
import torch

import magi_zoo
from magi_zoo import adapters

PLUGIN = '''
"""A contributed family: a stack of identical MLP blocks."""
import torch
import torch.nn as nn

from magi_zoo.adapters.base import Adapter, Output, Variant


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Stack(nn.Module):
    def __init__(self, d=8, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class StackAdapter(Adapter):
    family = "plugstack"
    spec_file = "plugstack.toml"  # next to this module: out-of-tree specs live with their adapter
    variants = {"plugstack-tiny": Variant(name="plugstack-tiny", family="plugstack", config={"d": 8},
                                          tiny=True, description="3 MLP blocks")}
    entry_points = ("denoise",)
    run_options = ("seed",)
    output_suffixes = (".txt",)

    def build_random(self, variant, dtype, device):
        with torch.device(device):
            return Stack(variant.config["d"]).to(dtype)

    def components(self, native):
        return {"model": native}

    def entry(self, native, name):
        self.check_entry(name)
        return native, "forward"

    def example_inputs(self, native, variant, entry, **shape):
        return {"x": torch.randn(2, variant.config["d"], generator=torch.Generator().manual_seed(0))}

    def generate(self, handle, *, prompt, progress=True, **options):
        with torch.no_grad():
            y = handle(**self.example_inputs(handle.pipe, handle.variant, "denoise"))
        return Output("text", f"{prompt}: {y.sum().item():.4f}")
'''

SPEC = '''
[default.compile]
Block = { fullgraph = true, backend = "eager" }
[gpu.cpu]
inherits = "h100"
[gpu.h100.compile]
Block = { dynamic = false }
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The package as pip would leave it: the module, its spec, and a dist-info whose
    entry_points.txt registers the family."""
    pkg = tmp_path / "plugstack_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    (pkg / "plugstack.toml").write_text(SPEC)
    dist = tmp_path / "plugstack_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugstack-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text('[magi_zoo.adapters]\nplugstack = plugstack_pkg:StackAdapter\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    adapters._loaded.pop("plugstack", None)


def test_entry_point_family_loads_plans_and_runs(plugin, fresh_dynamo, tmp_path):
    assert "plugstack" in adapters.families()
    assert "plugstack-tiny" in magi_zoo.list_models()
    h = magi_zoo.load("plugstack-tiny", gpu="cpu")
    r = h.report().region("Block")
    # the spec file beside the module was used: [default] fullgraph + [gpu.cpu] inherits h100's dynamic=False
    assert (r.spec.fullgraph, r.spec.dynamic, r.spec.backend) == (True, False, "eager")
    assert r.layers == ["model default", "gpu"]
    x = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    with torch.no_grad():
        h.pipe(**x)
    # 3 identical blocks, one compile (under no_grad: see docs/testing.md)
    assert (r.calls, r.counters.frames, len(r.counters.recompiles)) == (3, 1, 0)

    from magi_zoo.cli import main

    out = tmp_path / "o.txt"
    assert main(["run", "plugstack-tiny", "--gpu", "cpu", "--prompt", "hi", "--out", str(out)]) == 0
    assert out.read_text().startswith("hi: ")


def test_entry_point_clashing_with_builtin_is_refused(tmp_path, monkeypatch):
    dist = tmp_path / "clash-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: clash\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text('[magi_zoo.adapters]\nwan = elsewhere:WanAdapter\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="clashes with the built-in family"):
        adapters.families()
