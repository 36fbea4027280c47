"""LoRA over every registered family, with no edit for a new one: a family whose pipeline has
a diffusers LoRA loader takes a LoRA written for one of its denoiser's block linears and
refuses one at another width, naming both; any other family refuses LoRA with the reason,
before anything is built (each tiny variant's module tree on the meta device)."""

import re

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from magi_zoo.adapters import all_adapters, lora

pytest.importorskip("peft")

ADAPTERS = all_adapters()


def _tiny(adapter):
    return next(v for v in adapter.variants.values() if v.tiny)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[a.family for a in ADAPTERS])
def test_lora_fits_or_is_refused(adapter, tmp_path):
    v = _tiny(adapter)
    native = adapter.build(v, weights="random", dtype=torch.float32, device=torch.device("meta"))
    comps = adapter.components(native)
    spec = lora.LoraSpec(str(tmp_path / "one.safetensors"))
    if not callable(getattr(native, "load_lora_weights", None)):
        save_file({"transformer.x.lora_A.weight": torch.zeros(4, 16)}, spec.source)
        with pytest.raises(ValueError, match=f"{re.escape(v.name)} does not take LoRA"):
            lora.prepare([spec], native, comps, v.name)
        return
    den = comps["transformer"]
    path, lin = next((p, m) for p, m in den.named_modules() if isinstance(m, nn.Linear) and re.search(r"\.\d+\.", p))
    save_file({f"transformer.{path}.lora_A.weight": torch.zeros(4, lin.in_features),
               f"transformer.{path}.lora_B.weight": torch.zeros(lin.out_features, 4)}, spec.source)
    states = lora.prepare([spec], native, comps, v.name)
    assert lora.adapted_layers(states[0]) == 1
    wide = lora.LoraSpec(str(tmp_path / "wide.safetensors"))
    save_file({f"transformer.{path}.lora_A.weight": torch.zeros(4, lin.in_features + 16),
               f"transformer.{path}.lora_B.weight": torch.zeros(lin.out_features, 4)}, wide.source)
    with pytest.raises(ValueError, match=f"does not fit {re.escape(v.name)}: 1 layer"):
        lora.prepare([wide], native, comps, v.name)
