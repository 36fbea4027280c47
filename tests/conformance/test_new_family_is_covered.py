"""A family gets every conformance check by being registered: the suite is parametrized
over the registry, so a family installed through the `magi_zoo.adapters` entry-point
group (no edit to this repository) shows up in every check of test_conformance.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SUITE = Path(__file__).with_name("test_conformance.py")
REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
import torch.nn as nn
from magi_zoo.adapters.base import Adapter, Variant


class ConfAdapter(Adapter):
    family = "confplug"
    spec_file = "confplug.toml"
    variants = {v.name: v for v in [
        Variant(name="confplug-big", family="confplug", config={"d": 4096}),
        Variant(name="confplug-tiny", family="confplug", config={"d": 8}, tiny=True),
    ]}
    entry_points = ("prefill", "decode_step")

    def build_random(self, variant, dtype, device):
        return nn.Linear(variant.config["d"], variant.config["d"], device=device, dtype=dtype)

    def components(self, native):
        return {"model": native}
'''


def test_an_entry_point_family_gets_every_check(tmp_path):
    pkg = tmp_path / "confplug_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    (pkg / "confplug.toml").write_text('[default.compile]\nmodel = { fullgraph = true }\n')
    dist = tmp_path / "confplug_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: confplug-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[magi_zoo.adapters]\nconfplug = confplug_pkg:ConfAdapter\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(SUITE)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    tests = {i.split("::")[1].split("[")[0] for i in ids}
    covered = {i.split("::")[1].split("[")[0] for i in ids if "confplug" in i}
    assert covered == tests, f"checks that skip the new family: {sorted(tests - covered)}"
    # Published variants are resolved on meta; tiny ones are run; every entry point is driven.
    assert any("[confplug-big]" in i for i in ids) and any("[confplug-tiny]" in i for i in ids)
    assert any("[confplug-big:decode_step]" in i for i in ids)
