"""Every registered family: names resolve, tiny variants build offline with real weights."""

import pytest
import torch

import magi_zoo
from magi_zoo import adapters

TINY = [v.name for a in adapters.all_adapters() for v in a.variants.values() if v.tiny]


def test_every_family_has_a_tiny_variant_and_a_spec():
    from magi_zoo.specs import SpecFile, spec_path

    for a in adapters.all_adapters():
        assert any(v.tiny for v in a.variants.values()), a.family
        sf = SpecFile.from_toml(spec_path(a.spec_file))  # validates
        assert {"cpu", "h100", "h200"} <= set(sf.gpu), a.family
        for alias, target in a.aliases.items():
            assert adapters.lookup(alias)[1].name == target


@pytest.mark.parametrize("name", TINY)
def test_tiny_random_weights_are_real_draws(name):
    # Parameters left as torch.empty would hold leftover memory: huge or non-finite values.
    h = magi_zoo.load(name, gpu="cpu", compile=False)
    params = [(f"{c}.{n}", p) for c, m in h.modules.items() for n, p in m.named_parameters()]
    assert params
    bad = [n for n, p in params if not torch.isfinite(p).all() or p.abs().max() > 100]
    assert bad == []
    assert all(not m.training for m in h.modules.values())  # eval mode: dropout off
