"""Checks made before heavy work (issue 34, second round): a plan key error names the spec
file it came from, `--spec-file` is read before an `--nproc` launch, Self-Forcing's frame rule
holds for the Python handle, and `load()`'s arguments are typed strictly."""

from __future__ import annotations

import pytest
import torch

import magi_zoo
from magi_zoo import adapters
from magi_zoo.cli import main

BAD_KEY = '[default.compile]\nNoSuchBlock = { fullgraph = true }\n'


def test_plan_key_error_names_the_spec_file_and_table(tmp_path, capsys):
    """`spec --spec-file` with a key that matches nothing: the error names the file, the table
    and what to do (it named only the layer, "model default")."""
    mine = tmp_path / "mine.toml"
    mine.write_text(BAD_KEY)
    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu", "--spec-file", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "plan key 'NoSuchBlock'" in err and f"[default.compile] of the spec file '{mine}'" in err, err
    assert "fix or remove the key there" in err, err


def test_plan_key_error_of_a_load_names_the_spec_file(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text('[default.compile]\nWanTransformerBlock = { fullgraph = true }\n'
                    '[gpu.cpu.compile]\nNoSuchBlock = { enabled = false }\n')
    with pytest.raises(magi_zoo.PlanError, match=r"\[gpu\.cpu\.compile\] .*of the spec file") as e:
        magi_zoo.load("wan2.1-tiny", gpu="cpu", spec_file=mine)
    assert str(mine) in str(e.value) and e.value.layer == "gpu"


def test_a_user_override_key_is_named_as_the_users(tmp_path):
    from magi_zoo.overrides import name_plan_source

    e = name_plan_source(magi_zoo.PlanError("plan key 'X' (user, compile) matches no submodule", layer="user",
                                            section="compile"), tmp_path / "s.toml", "cpu", shipped=True)
    assert "your overrides" in str(e) and "s.toml" not in str(e)


@pytest.mark.parametrize("line, match", [
    ('NoSuchBlock = { fullgraph = "yes" }', "fullgraph"),
    ("NoSuchBlock = { fullgraph = true }", "plan key 'NoSuchBlock'"),
])
def test_spec_file_is_checked_once_before_an_nproc_launch(tmp_path, monkeypatch, capsys, line, match):
    """A bad --spec-file under --nproc is one error before torchrun starts (it reached every
    rank: a wrong-typed value after N starts, a bad key after N builds)."""
    from magi_zoo.cli.commands import run

    adapter, _ = adapters.lookup("wan2.1-tiny")
    shipped = adapter.spec_path().read_text()  # with its [default.parallel] table: --nproc needs one
    mine = tmp_path / "mine.toml"
    mine.write_text(shipped.replace("[default.compile]\n", f"[default.compile]\n{line}\n", 1))
    monkeypatch.setattr(run, "launch", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(run.distributed, "is_launched", lambda: False)
    assert main(["run", "wan2.1-tiny", "--gpu", "cpu", "--prompt", "p", "--out", str(tmp_path / "x.mp4"),
                 "--nproc", "2", "--spec-file", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.count("magi-zoo: error:") == 1 and match in err and str(mine) in err, err


def test_self_forcing_frame_rule_holds_for_the_python_handle(monkeypatch):
    """`handle(prompt, num_frames=82)` is refused by the handle's check, before the pipeline
    runs (the rule lived in the CLI's check_run only)."""
    adapter, variant = adapters.lookup("self-forcing-tiny")
    with pytest.raises(ValueError, match=r"num_frames 82: Self-Forcing makes whole blocks of 3 latent frames"):
        adapter.check_call(variant, {**adapter.call_defaults(variant), "num_frames": 82})
    adapter.check_call(variant, {**adapter.call_defaults(variant), "num_frames": 21})  # a whole number of blocks

    class Pipe:  # the handle's own path: check_call, then the native pipeline
        def __call__(self, *a, **k):
            pytest.fail("the pipeline ran before the frame count was refused")

    handle = magi_zoo.ZooPipeline(Pipe(), None, None, adapter=adapter, variant=variant,
                                  profile=magi_zoo.get_profile("cpu"), dtype=None, device=torch.device("cpu"), layers=[])
    with pytest.raises(ValueError, match="num_frames 82"):
        handle(prompt="p", num_frames=82)
    with pytest.raises(ValueError, match="--frames 82"):  # the CLI words it as its flag
        adapter.check_run(variant, {"num_frames": 82})


@pytest.mark.parametrize("kwargs, match", [
    ({"train": 1}, r"load\(train=1\): train takes bool, got int"),
    ({"calibrate": "yes"}, r"calibrate takes bool, got str"),
    ({"memory_budget_gib": "4"}, r"memory_budget_gib takes float \| None, got str"),
    ({"memory_budget_gib": True}, r"memory_budget_gib takes float \| None, got bool"),
    ({"gpu": 3}, r"gpu takes str, got int"),
    ({"spec_file": 3}, r"spec_file takes str \| Path \| None, got int"),
])
def test_load_arguments_are_typed_strictly(kwargs, match, monkeypatch):
    adapter, _ = adapters.lookup("wan2.1-tiny")
    monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(TypeError, match=match):
        magi_zoo.load("wan2.1-tiny", **kwargs)
