"""Spec files and plan dicts are parsed strictly (issue 34): a value of the wrong type is
refused, never coerced (``fullgraph = "yes"`` used to become True); an empty file, or one
that sets no section, is an error showing a minimal file; every file error names the file."""

from __future__ import annotations

import pytest

import magi_zoo
from magi_zoo import PlanLayer, SpecFile
from magi_zoo.specs.recompute_spec import RecomputeSpec


def _spec(tmp_path, text: str | bytes, name: str = "my.toml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("line, field, expected", [
    ('fullgraph = "yes"', "fullgraph", "a boolean"),
    ("fullgraph = 1", "fullgraph", "a boolean"),
    ('dynamic = "0"', "dynamic", "a boolean"),
    ("dynamic = 0", "dynamic", "a boolean"),
    ("backend = 3", "backend", "a string"),
    ('enabled = "false"', "enabled", "a boolean"),
])
def test_wrong_types_in_a_spec_file_are_refused_naming_file_key_field_and_type(tmp_path, line, field, expected):
    path = _spec(tmp_path, f'[default.compile]\n"blocks.*" = {{ {line} }}\n')
    with pytest.raises(ValueError) as e:
        SpecFile.from_toml(path)
    msg = str(e.value)
    assert str(path) in msg and "'blocks.*'" in msg and field in msg and expected in msg, msg
    assert "got" in msg  # what was written


@pytest.mark.parametrize("section, entry, field", [
    ("parallel", '{ ulysses_degree = "2" }', "ulysses_degree"),
    ("parallel", "{ cfg = 1 }", "cfg"),
    ("offload", '{ once = "true" }', "once"),
    ("offload", '{ prefetch = 2.0 }', "prefetch"),
    ("cuda_graphs", '{ enabled = 1 }', "enabled"),
    ("precision", '{ fast_accum = "yes" }', "fast_accum"),
    ("step_cache", '{ method = "first_block", threshold = "0.1" }', "threshold"),
])
def test_every_section_is_strict(tmp_path, section, entry, field):
    path = _spec(tmp_path, f"[default.{section}]\nBlock = {entry}\n")
    with pytest.raises(ValueError) as e:
        SpecFile.from_toml(path)
    assert str(path) in str(e.value) and field in str(e.value), str(e.value)


def test_right_types_still_parse(tmp_path):
    path = _spec(tmp_path, '[default.compile]\n"blocks.*" = { fullgraph = true, dynamic = false }\n'
                           '[default.precision]\nBlock = { matmul = "bf16", keep_bf16 = ["ffn.net.2"] }\n'
                           '[default.offload]\n"" = { activation_gib = 4, host_bandwidth_gbs = 55 }\n'
                           '[default.recompute]\nBlock = { policy = "selective", save = ["matmuls"] }\n')
    spec = SpecFile.from_toml(path)
    assert spec.default.entries("precision")["Block"].keep_bf16 == ("ffn.net.2",)
    assert spec.default.entries("offload")[""].activation_gib == 4.0  # an int where a float goes: kept


@pytest.mark.parametrize("text", ["", "\n# only a comment\n", "[default]\n", "[default.compile]\n",
                                  "[gpu.h100]\n", '[gpu.h100]\ninherits = "h200"\n[gpu.h200]\n'])
def test_a_file_that_sets_no_section_is_an_error_showing_a_minimal_file(tmp_path, text):
    path = _spec(tmp_path, text)
    with pytest.raises(ValueError) as e:
        SpecFile.from_toml(path)
    msg = str(e.value)
    assert str(path) in msg and "[default.compile]" in msg and "minimal" in msg, msg


def test_a_binary_spec_file_names_the_file(tmp_path):
    path = _spec(tmp_path, b"\x89\xb6PNG\x00\x01\x02", "weights.bin")
    with pytest.raises(ValueError) as e:
        SpecFile.from_toml(path)
    assert str(path) in str(e.value) and "UTF-8" in str(e.value), str(e.value)


def test_a_directory_or_a_non_table_names_the_file(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        SpecFile.from_toml(tmp_path)
    assert str(tmp_path) in str(e.value)
    for text in ('default = 1\n', 'gpu = "h100"\n', '[gpu]\nh100 = 3\n', '[default]\ncompile = 1\n'):
        path = _spec(tmp_path, text)
        with pytest.raises(ValueError) as e:
            SpecFile.from_toml(path)
        assert str(path) in str(e.value), (text, str(e.value))


def test_an_empty_spec_file_is_refused_by_load_before_the_build(tmp_path, monkeypatch):
    adapter, _ = magi_zoo.adapters.lookup("wan2.1-tiny")
    monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built before the bad spec file was refused"))
    path = _spec(tmp_path, "")
    with pytest.raises(ValueError, match="minimal"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", spec_file=path)


@pytest.mark.parametrize("plan", [
    {"compile": {"blocks.*": {"fullgraph": "yes"}}},
    {"compile": {"blocks.*": {"dynamic": 0}}},
    {"parallel": {"transformer": {"ulysses_degree": "2"}}},
    {"attention": {"transformer": {"backend": 1}}},
])
def test_python_plan_dicts_are_strict_too(plan):
    with pytest.raises(ValueError, match="expected"):
        PlanLayer.coerce(plan)


def test_python_numbers_where_floats_go_keep_working():
    assert RecomputeSpec(policy="auto", train_peak_gib=16).train_peak_gib == 16.0
    layer = PlanLayer.coerce({"offload": {"": {"memory_budget_gib": 24}}})
    assert layer.entries("offload")[""].memory_budget_gib == 24.0
    layer = PlanLayer.coerce({"precision": {"Block": {"keep_bf16": ["a", "b"]}}})
    assert layer.entries("precision")["Block"].keep_bf16 == ("a", "b")


def test_cli_compile_override_is_strict():
    from magi_zoo.cli.commands.run_options import parse_compile_overrides

    with pytest.raises(ValueError, match="fullgraph"):
        parse_compile_overrides(['blocks={"fullgraph": 1}'])


def test_recompute_dict_is_strict_with_one_line():
    from magi_zoo.specs.recompute_spec import with_recompute

    with pytest.raises(ValueError) as e:
        with_recompute([], {"policy": "auto", "train_peak_gib": "16"})
    assert str(e.value) == "recompute=: train_peak_gib: expected a number, got str '16'"
