"""One block class at several call sites (Z-Image's refiners and main layers): a region per site,
keyed by path, compiles once for its own inputs, because each region runs a code object of its
own (engine/compile/step.py `region_method`). Counters are the oracle."""

from __future__ import annotations

import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.engine import installed, remove

EAGER = {"backend": "eager", "fullgraph": True}


class Block(nn.Module):
    def __init__(self, gated: bool):
        super().__init__()
        self.gated = gated
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=None):
        y = self.lin(x)
        if self.gated:  # a Python branch on the instance: another graph at this site
            y = y * scale.tanh()
        return x + y


class TwoSites(nn.Module):
    """2 ungated blocks on 4 tokens, then 3 gated blocks on 6 (the first site's output joined
    with 2 more tokens): one class, two sites, other inputs."""

    def __init__(self):
        super().__init__()
        self.pre = nn.ModuleList(Block(False) for _ in range(2))
        self.main = nn.ModuleList(Block(True) for _ in range(3))

    def forward(self, x, extra, scale):
        for b in self.pre:
            x = b(x)
        x = torch.cat([x, extra], dim=1)
        for b in self.main:
            x = b(x, scale)
        return x


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, 8, generator=g), torch.randn(1, 2, 8, generator=g), torch.randn(1, 1, 8, generator=g)


def _counts(report, key):
    r = report.region(key)
    return r.counters.frames, len(r.counters.recompiles)


def test_a_region_per_site_compiles_once_each(fresh_dynamo):
    torch.manual_seed(0)
    net = TwoSites().eval()
    with torch.no_grad():
        ref = net(*_inputs())
    rep = magi_zoo.apply(net, {"pre.*": EAGER, "main.*": EAGER})
    with torch.no_grad():
        out, again = net(*_inputs()), net(*_inputs())
    assert torch.equal(out, ref) and torch.equal(again, ref)
    # each site: block 0 compiles its region's code, the others reuse it, the second call too
    assert _counts(rep, "pre.*") == (1, 0) and _counts(rep, "main.*") == (1, 0), rep.details()
    remove(net)
    assert installed(net) == [] and all("forward" not in b.__dict__ for b in net.modules())


def test_one_class_key_over_both_sites_recompiles(fresh_dynamo):
    """The same two sites as one region (a class key): one code object, so the second site's
    first call fails the first site's guards and recompiles -- what a key per site avoids."""
    net = TwoSites().eval()
    rep = magi_zoo.apply(net, {"Block": EAGER})
    with torch.no_grad():
        net(*_inputs())
    assert _counts(rep, "Block") == (2, 1), rep.details()


def test_two_models_share_a_region_code_object(fresh_dynamo):
    """A second model of the same class under the same key reuses the first's compiled code,
    as it did when regions compiled the class's method itself (a second load compiles nothing)."""
    a, b = TwoSites().eval(), TwoSites().eval()
    rep_a = magi_zoo.apply(a, {"pre.*": EAGER, "main.*": EAGER})
    rep_b = magi_zoo.apply(b, {"pre.*": EAGER, "main.*": EAGER})
    with torch.no_grad():
        a(*_inputs())
        b(*_inputs())
    assert _counts(rep_a, "main.*") == (1, 0) and _counts(rep_b, "main.*") == (0, 0), rep_b.details()
