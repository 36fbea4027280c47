"""TorchCompileSpec, plan layers and spec files: validation and errors."""

import inspect

import pytest
import torch
from pydantic import ValidationError

from magi_zoo import PlanLayer, SpecFile, TorchCompileSpec
from magi_zoo.specs import VALID_MODES, spec_path


def test_defaults_equal_plain_torch_compile():
    # Every field shared with torch.compile must default to torch.compile's own default,
    # so a region whose spec sets nothing compiles exactly like `torch.compile(fn)`.
    sig = inspect.signature(torch.compile).parameters
    spec = TorchCompileSpec()
    for field in ("fullgraph", "dynamic", "mode", "options"):
        assert getattr(spec, field) == sig[field].default, field
    # torch 2.11 spells the backend default "inductor"; 2.13 spells it None, meaning
    # "the default backend", which is inductor unless a user re-registered it.
    backend_default = sig["backend"].default
    if backend_default is None:
        from torch._dynamo.backends.registry import get_default_backend
        backend_default = get_default_backend()
    assert spec.backend == backend_default == "inductor"
    assert spec.enabled is True
    assert spec.compile_kwargs() == {"fullgraph": False, "dynamic": None, "backend": "inductor"}


def test_frozen_and_rejects_unknown_fields():
    spec = TorchCompileSpec()
    with pytest.raises(ValidationError):
        spec.fullgraph = True
    with pytest.raises(ValidationError, match="fulgraph"):
        TorchCompileSpec(fulgraph=True)


def test_invalid_mode_lists_valid_modes():
    with pytest.raises(ValidationError) as e:
        TorchCompileSpec(mode="fast")
    for m in VALID_MODES:
        assert m in str(e.value)


def test_mode_with_options_is_rejected():
    with pytest.raises(ValidationError, match="mode and options cannot both be set"):
        TorchCompileSpec(mode="max-autotune", options={"max_autotune": True})
    # each alone is fine
    TorchCompileSpec(mode="max-autotune")
    TorchCompileSpec(options={"max_autotune": True})


def test_explicit_fields_and_short():
    s = TorchCompileSpec(dynamic=True)
    assert s.explicit() == {"dynamic": True}
    assert s.short() == "dynamic=True"
    assert TorchCompileSpec(enabled=False).short() == "disabled"
    assert TorchCompileSpec().short() == "default"
    assert TorchCompileSpec(dynamic=True).digest() != TorchCompileSpec().digest()


def test_plan_layer_coercion_forms():
    layer = PlanLayer.coerce({
        "blocks.*": {"fullgraph": True},
        "Block": TorchCompileSpec(dynamic=True),
        "vae": {"decode": {"enabled": False}, "encode": False},
        "head": False,
    })
    got = {(k, m): s for k, m, s in layer.items_by_method()}
    assert got[("blocks.*", "forward")] == TorchCompileSpec(fullgraph=True)
    assert got[("Block", "forward")] == TorchCompileSpec(dynamic=True)
    assert got[("vae", "decode")].enabled is False
    assert got[("vae", "encode")].enabled is False
    assert got[("head", "forward")].enabled is False


def test_plan_layer_bad_values():
    with pytest.raises(ValidationError, match="expected a TorchCompileSpec"):
        PlanLayer.coerce({"blocks": 3})
    with pytest.raises(ValidationError, match="not TorchCompileSpec fields"):
        PlanLayer.coerce({"blocks": {"fullgraph": True, "dinamic": True}})


def test_spec_file_toml(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('[default.regions]\nBlock = { fullgraph = true }\n'
                 '[gpu.h100]\nattention_backend = "flash"\n[gpu.h100.regions]\nBlock = { dynamic = false }\n')
    sf = SpecFile.from_toml(p)
    assert [n for n, _ in sf.layers_for("h100")] == ["model default", "gpu"]
    assert [n for n, _ in sf.layers_for("cpu")] == ["model default"]
    assert sf.gpu["h100"].attention_backend == "flash"


@pytest.mark.parametrize("text, match", [
    ("[gpu.h1000.regions]\nBlock = {}\n", "not a GPU profile"),
    ("[defaults.regions]\nBlock = {}\n", "unknown top-level tables"),
    ("[default]\nBlock = { fullgraph = true }\n", "region keys go under"),
    ("[default.regions]\nBlock = { mode = 'turbo' }\n", "valid modes"),
])
def test_spec_file_errors(tmp_path, text, match):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises((ValueError, ValidationError), match=match):
        SpecFile.from_toml(p)


def test_missing_spec_file():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SpecFile.from_toml("/nonexistent/spec.toml")


def test_shipped_wan_spec_validates():
    sf = SpecFile.from_toml(spec_path("wan.toml"))
    assert {"h100", "h200", "cpu"} <= set(sf.gpu)
