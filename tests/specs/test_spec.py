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
    with pytest.raises(ValidationError, match="unknown field 'dinamic' -- did you mean 'dynamic'"):
        PlanLayer.coerce({"blocks": {"fullgraph": True, "dinamic": True}})


@pytest.mark.parametrize("entry", [
    {"fulgraph": True},                       # alone: a bool could be a method entry, but the name is a field's
    {"forward": {"fulgraph": True}},          # inside a method table
    {"dynamic": True, "fulgraph": True},      # beside a real field
])
def test_field_typo_says_did_you_mean(entry):
    # Before sections, {"fulgraph": True} was read as a method 'fulgraph' and reported as a
    # missing method at resolution; it is a misspelt field, said at validation.
    with pytest.raises(ValidationError, match="unknown field 'fulgraph' -- did you mean 'fullgraph'"):
        PlanLayer.coerce({"Block": entry})


def test_sections_and_shorthand():
    from magi_zoo.specs import SECTIONS, AttentionSpec

    assert {"compile", "attention"} <= set(SECTIONS)
    layer = PlanLayer.coerce({"compile": {"Block": {"fullgraph": True}}, "attention": {"transformer": "flash"}})
    assert list(layer.items("attention")) == [("transformer", None, AttentionSpec(backend="flash"))]
    assert list(layer.items("compile")) == [("Block", "forward", TorchCompileSpec(fullgraph=True))]
    # a dict without section names is the compile section
    assert PlanLayer.coerce({"Block": {"fullgraph": True}}) == PlanLayer(compile={"Block": {"fullgraph": True}})
    with pytest.raises(ValueError, match="mixes section names"):
        PlanLayer.coerce({"compile": {}, "Block": {}})
    with pytest.raises(ValidationError, match="unknown plan section.*'atention'.*did you mean 'attention'"):
        PlanLayer(atention={"x": "flash"})
    with pytest.raises(ValidationError, match="unknown field 'backnd' -- did you mean 'backend'"):
        PlanLayer(attention={"transformer": {"backnd": "flash"}})
    # attention specs apply to a module as a whole: no method tables
    with pytest.raises(ValidationError, match="attention"):
        PlanLayer(attention={"transformer": {"forward": {"backend": "flash"}}})
    with pytest.raises(ValidationError, match="'regions' is now the 'compile' section"):
        PlanLayer(regions={"Block": {}})


def test_with_backend_overrides_every_compile_spec():
    from magi_zoo.specs import with_backend

    layers = [("model default", PlanLayer.coerce({"Block": {"fullgraph": True}, "vae": {"decode": False}})),
              ("gpu", PlanLayer.coerce({"Block": {"dynamic": False}}))]
    out = with_backend(layers, "eager")
    specs = [s for _, layer in out for _, _, s in layer.items("compile")]
    assert len(specs) == 3 and all(s.backend == "eager" for s in specs)
    assert specs[0].fullgraph is True and specs[1].enabled is False and specs[2].dynamic is False


def test_spec_file_toml(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('[default.compile]\nBlock = { fullgraph = true }\n'
                 '[gpu.h100.attention]\ntransformer = { backend = "flash" }\n'
                 '[gpu.h100.compile]\nBlock = { dynamic = false }\n')
    sf = SpecFile.from_toml(p)
    assert [n for n, _ in sf.layers_for("h100")] == ["model default", "gpu"]
    assert [n for n, _ in sf.layers_for("cpu")] == ["model default"]
    assert sf.gpu["h100"].entries("attention")["transformer"].backend == "flash"


def test_spec_file_inherits(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('[gpu.h100.compile]\nBlock = { fullgraph = true, dynamic = false }\nhead = false\n'
                 '[gpu.h100.attention]\ntransformer = "flash"\n'
                 # h200 starts from h100 and changes one field of one key, field by field
                 '[gpu.h200]\ninherits = "h100"\n[gpu.h200.compile]\nBlock = { mode = "max-autotune" }\n'
                 '[gpu.a100]\ninherits = "h200"\n')
    sf = SpecFile.from_toml(p)
    h200 = {(k, m): s for k, m, s in sf.gpu["h200"].items("compile")}
    assert h200[("Block", "forward")] == TorchCompileSpec(fullgraph=True, dynamic=False, mode="max-autotune")
    assert h200[("head", "forward")].enabled is False
    assert sf.gpu["h200"].entries("attention")["transformer"].backend == "flash"
    assert sf.gpu["a100"] == sf.gpu["h200"]  # inheritance chains
    assert sf.gpu["h100"].entries("compile")["Block"] == TorchCompileSpec(fullgraph=True, dynamic=False)


@pytest.mark.parametrize("text, match", [
    ('[gpu.h200]\ninherits = "h10"\n', "inherits = 'h10'.*did you mean 'h100'"),
    ('[gpu.h100]\ninherits = "h200"\n[gpu.h200]\ninherits = "h100"\n', "inheritance cycle"),
    ('[default]\ninherits = "h100"\n', "unknown keys"),
])
def test_spec_file_inherits_errors(tmp_path, text, match):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        SpecFile.from_toml(p)


@pytest.mark.parametrize("text, match", [
    ("[gpu.h1000.compile]\nBlock = {}\n", "not a GPU profile.*did you mean 'h100'"),
    ("[defaults.compile]\nBlock = {}\n", "unknown top-level tables"),
    ("[default]\nBlock = { fullgraph = true }\n", "region keys go under"),
    ("[default.regions]\nBlock = {}\n", "'regions' is now 'compile'"),
    ("[default.compile]\nBlock = { mode = 'turbo' }\n", r"bad.toml.*\[default\].*'Block'.*valid modes"),
    ("[default.compile]\nBlock = { fulgraph = true }\n", "did you mean 'fullgraph'"),
    ("[default.compile\nBlock = {}\n", r"bad.toml' is not valid TOML"),
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


# -- a spec file is data: options naming programs or paths come only from Python ------------
@pytest.mark.parametrize("option, value", [
    ('"cpp.cxx"', '"/tmp/evil-g++"'),
    ('"cuda.cuda_cxx"', '"/tmp/nvcc"'),
    ('"trace.debug_dir"', '"/tmp/dbg"'),
    ('"global_cache_dir"', '"/tmp/c"'),
    ('"cpp.march"', '"native -fplugin=/tmp/x.so"'),
    ('"aot_inductor.custom_op_libs"', '["/tmp/x.so"]'),
    ('cpp.cxx', '"g++"'),                  # unquoted dotted key: a nested TOML table, same option
    ('"cuda.some_future_dir"', '"/x"'),    # not listed, but named like a path: refused too
])
def test_spec_file_refuses_program_and_path_options(tmp_path, option, value):
    p = tmp_path / "evil.toml"
    p.write_text(f"[gpu.h100.compile]\nBlock = {{ options = {{ {option} = {value} }} }}\n")
    name = option.strip('"')
    with pytest.raises(ValueError) as e:
        SpecFile.from_toml(p)
    msg = str(e.value)
    assert "evil.toml" in msg and "[gpu.h100.compile]" in msg and repr(name) in msg and "'Block'" in msg
    assert "allowed only from Python" in msg and "magi_zoo.load(..., compile=" in msg and "apply(" in msg


def test_spec_file_refuses_them_in_method_tables_and_from_dict():
    data = {"default": {"compile": {"vae": {"decode": {"options": {"trace.debug_dir": "/tmp/d"}}}}}}
    with pytest.raises(ValueError, match=r"region 'vae.decode' sets inductor option 'trace.debug_dir'"):
        SpecFile.from_dict(data)


def test_spec_file_keeps_ordinary_options(tmp_path):
    p = tmp_path / "ok.toml"
    p.write_text('[default.compile]\nBlock = { options = { "max_autotune" = true, "triton.cudagraphs" = false,'
                 ' "cpp.descriptive_names" = "torch" } }\n')
    spec = SpecFile.from_toml(p).default.entries("compile")["Block"]
    assert spec.options == {"max_autotune": True, "triton.cudagraphs": False, "cpp.descriptive_names": "torch"}


def test_refused_options_are_allowed_from_python(tmp_path):
    # The same options from Python code (load's compile=, apply's plan) are the caller's choice.
    from magi_zoo.specs import as_layers

    opts = {"cpp.cxx": "g++", "trace.debug_dir": str(tmp_path)}
    (_, layer), = as_layers({"Block": {"options": opts}})
    assert layer.entries("compile")["Block"].compile_kwargs()["options"] == opts
    assert PlanLayer(compile={"Block": {"options": opts}}).entries("compile")["Block"].options == opts


def test_refused_option_names_exist_in_this_torch():
    # The list is read from torch/_inductor/config.py: every listed name but the 'debug_dir'
    # alias is a real option of the installed torch (a rename in torch shows up here).
    import torch._inductor.config as inductor_config

    from magi_zoo.specs.plan import REFUSED_FILE_OPTIONS, refused_file_option

    known = set(inductor_config.get_config_copy())
    assert sorted(set(REFUSED_FILE_OPTIONS) - known - {"debug_dir"}) == []
    # and nothing harmless is caught by the suffix rule
    assert refused_file_option("max_autotune") is None and refused_file_option("triton.cudagraphs") is None


def test_compile_spec_with_inductor_options_resolves_into_a_region():
    """A spec holding a dict (inductor `options`) must hash: regions are grouped by spec."""
    import magi_zoo

    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", overrides={
        "compile": {"WanTransformerBlock": {"options": {"triton.multi_kernel": 1}}}})
    rows = {r["region"]: r for r in h.report().plan.table() if r["section"] == "compile"}
    assert "options={'triton.multi_kernel': 1}" in rows["WanTransformerBlock"]["spec"]
    a = magi_zoo.TorchCompileSpec(options={"x": 1})
    assert hash(a) == hash(magi_zoo.TorchCompileSpec(options={"x": 1})) and len({a, a.model_copy()}) == 1
