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


# -- round three: what a user could pass that went through unchecked, or was only met after the build

@pytest.mark.parametrize("argv, match", [
    (["--cfg-parallel"], r"--cfg-parallel only apply to a run split over processes: add --nproc N"),
    (["--no-cfg-parallel"], r"--no-cfg-parallel only apply"),
    (["--uneven"], r"--uneven only apply"),
    (["--nproc", "1", "--cfg-parallel"], r"--cfg-parallel only apply"),
    (["--nproc", "0"], r"--nproc must be a positive integer .*got 0"),
    (["--nproc", "2", "--ulysses", "0"], r"--ulysses must be a positive integer"),
    (["--seed", str(2**64)], r"--seed must be an integer from 0 to 2\*\*64 - 1"),
    (["--seed", "-1"], r"--seed must be an integer from 0"),
    (["--dtype", "int8"], r"unknown dtype 'int8'; use bfloat16, float16 or float32"),
    (["--dtype", "float64"], r"unknown dtype 'float64'"),
])
def test_run_flags_refused_before_the_build(argv, match, tmp_path, monkeypatch, capsys):
    """A flag a run cannot use, or a value it cannot take, ends the command before the build
    (cfg=True once passed as "nothing asked", since True == 1; --nproc 0 was one process)."""
    adapter, _ = adapters.lookup("wan2.1-tiny")
    monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    out = tmp_path / "v.mp4"
    assert main(["run", "wan2.1-tiny", "--gpu", "cpu", "--prompt", "p", "--out", str(out), *argv]) == 2
    import re

    assert re.search(match, capsys.readouterr().err), match
    assert not out.exists()


def test_dtype_names_are_the_model_dtypes(monkeypatch):
    from magi_zoo.specs.gpu_profiles import get_profile
    from magi_zoo.zoo import _dtype

    cpu = get_profile("cpu")
    assert _dtype("BF16", cpu) is torch.bfloat16 and _dtype("fp16", cpu) is torch.float16
    assert _dtype(torch.float32, cpu) is torch.float32 and _dtype(None, cpu) is getattr(torch, cpu.default_dtype)
    for bad in (torch.float64, torch.int8, "bool", "complex64", 16):
        with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
            _dtype(bad, cpu)


@pytest.mark.parametrize("compile", [0, 1, 0.0])
def test_compile_takes_true_false_or_an_override_not_a_number(compile, monkeypatch):
    adapter, _ = adapters.lookup("wan2.1-tiny")
    monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(TypeError, match=r"compile= takes None/True .*got (int|float)"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=compile)


@pytest.mark.parametrize("toml, match", [
    ('[default.attention]\ntransformer = { backend = "flashh" }\n',
     r"\[attention\] 'transformer' in the spec's model default layer: attention backend 'flashh' .*did you mean 'flash'"),
    ('[default.compile]\nWanTransformerBlock = { backend = "inductr" }\n',
     r"backend 'inductr' is not a torch.compile backend -- did you mean 'inductor'"),
    ('[default.compile]\nWanTransformerBlock = { options = { nope = 1, triton = { cudagraphs = false } } }\n',
     r"'nope' is not an inductor option"),
])
def test_library_names_in_a_plan_are_checked_when_it_is_read(toml, match, tmp_path, monkeypatch, capsys):
    """Names only torch / diffusers know (an attention backend, a compile backend, an inductor
    option) are checked when the layers are read: `spec` refuses them too, and `run` never builds."""
    mine = tmp_path / "mine.toml"
    mine.write_text(toml)
    adapter, _ = adapters.lookup("wan2.1-tiny")
    monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    import re

    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu", "--spec-file", str(mine)]) == 2
    assert re.search(match, capsys.readouterr().err)
    with pytest.raises(ValueError, match=match):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", spec_file=mine)
    with pytest.raises(ValueError, match=r"backend 'nope' is not a torch.compile backend"):  # the user's layer too
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile={"WanTransformerBlock": {"backend": "nope"}})


def test_an_mp4_frame_larger_than_libx264_takes_is_refused_before_the_build(tmp_path, monkeypatch, capsys):
    """LTX-2 has no position-table cap on a side: --height 100000 generated a whole video and
    then failed to open the encoder; an .mp4 side above libx264's 16384 px is refused first."""
    adapter, _ = adapters.lookup("ltx-2-tiny")
    monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    base = ["run", "ltx-2-tiny", "--gpu", "cpu", "--prompt", "p", "--height", "16416"]
    assert main([*base, "--out", str(tmp_path / "v.mp4")]) == 2
    assert "--height 16416: an .mp4 (H.264, libx264) frame is at most 16384 px a side" in capsys.readouterr().err


def test_flags_that_would_be_ignored_are_refused(tmp_path, monkeypatch, capsys):
    """--cache-dir with --no-compile (nothing compiled to keep), `spec --measure` without
    --recompute auto:GIB (nothing to measure), and an --out that is the run's own --image even
    with --overwrite (the input would be lost): each an error before the build."""
    from PIL import Image

    for name in ("wan2.1-tiny", "flux.2-tiny"):
        adapter, _ = adapters.lookup(name)
        monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    assert main(["run", "wan2.1-tiny", "--gpu", "cpu", "--prompt", "p", "--no-compile", "--cache-dir",
                 str(tmp_path / "c"), "--out", str(tmp_path / "v.mp4")]) == 2
    assert "--cache-dir keeps compiled code for the next run, and --no-compile compiles none" in capsys.readouterr().err
    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu", "--measure"]) == 2
    assert "--measure calibrates --recompute auto:GIB" in capsys.readouterr().err
    image = tmp_path / "in.png"
    Image.new("RGB", (64, 64), (10, 20, 30)).save(image)
    before = image.read_bytes()
    assert main(["run", "flux.2-tiny", "--gpu", "cpu", "--prompt", "p", "--image", str(image), "--out", str(image),
                 "--overwrite"]) == 2
    assert "is the --image file this run reads" in capsys.readouterr().err
    assert image.read_bytes() == before


def test_a_sequence_split_on_the_cpu_names_what_asked_for_it(tmp_path, monkeypatch, capsys):
    """flux-tiny runs no CFG, so --nproc 2 picks Ulysses: the refusal names --nproc (it named
    --ulysses / --ring, which the user had not passed); a given --ulysses is named as given."""
    for name in ("flux-tiny", "wan2.1-tiny"):
        adapter, _ = adapters.lookup(name)
        monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    assert main(["run", "flux-tiny", "--gpu", "cpu", "--prompt", "p", "--nproc", "2", "--out",
                 str(tmp_path / "a.png")]) == 2
    assert "--nproc 2 would split the sequence (Ulysses / ring" in capsys.readouterr().err
    assert main(["run", "wan2.1-tiny", "--gpu", "cpu", "--prompt", "p", "--nproc", "2", "--ulysses", "2", "--out",
                 str(tmp_path / "a.mp4")]) == 2
    assert "--ulysses use diffusers' context parallelism, which runs on GPUs" in capsys.readouterr().err


def test_a_parallel_typo_is_one_line_naming_the_argument(monkeypatch):
    adapter, _ = adapters.lookup("wan2.1-tiny")
    monkeypatch.setattr(adapter, "build", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ValueError, match=r"^parallel=\{'ulysess_degree': 2\}: .*unknown field 'ulysess_degree' -- did "
                                         r"you mean 'ulysses_degree'\?[^\n]*$"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", parallel={"ulysess_degree": 2})
