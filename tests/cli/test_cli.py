"""The `magi-zoo` command line, run as a user would (subprocesses for the long ones)."""

import subprocess
import sys

import pytest

from magi_zoo.cli import main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "wan2.1-tiny" in out and "wan2.1, wan" in out


def test_spec_table_at_published_size(capsys):
    # resolved against the real 30-block module tree (built on the meta device)
    assert main(["spec", "wan2.1", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "30 x WanTransformerBlock" in out and "dynamic=False, fullgraph=True" in out
    assert "gpu > model default" in out and "disabled" in out


def test_unknown_model_is_one_clear_line(capsys):
    assert main(["spec", "wan3", "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("magi-zoo: error: unknown model 'wan3'") and "Did you mean" in err


def test_run_writes_mp4(tmp_path):
    out = tmp_path / "corgi.mp4"
    proc = subprocess.run(
        [sys.executable, "-m", "magi_zoo.cli", "run", "wan2.1-tiny", "--prompt", "a corgi surfing",
         "--out", str(out), "--gpu", "cpu", "--steps", "2", "--frames", "5",
         "--compile", 'WanTransformerBlock={"backend": "eager"}', "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.stat().st_size > 0 and out.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    o = proc.stdout
    assert "compiling 1 region(s)" in o  # WanTransformerBlock; text_encoder and vae are disabled
    # the report is printed after the output is written, with the --compile override in it
    assert o.index("wrote ") < o.index("| WanTransformerBlock") and "backend=eager" in o
    assert "torch_dtype" not in proc.stderr


@pytest.mark.slow
def test_demo_end_to_end():
    proc = subprocess.run([sys.executable, "-m", "magi_zoo.cli", "demo"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for needle in ("[1/4]", "[4/4]", "WanTransformerBlock", "s/step (median)", "max |eager - compiled|"):
        assert needle in out
    diff = float(out.rsplit("output pixels:", 1)[1].split()[0])
    assert diff < 1e-4  # compiled equals eager on the demo's own output


# -- issue 13: flags, errors before the build, one line each, no traceback --------------------

def _err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err  # a loader's progress bar may precede the error (\r, no newline)
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert last.startswith("magi-zoo: error: ") and "Traceback" not in err and err.count("magi-zoo: error") == 1, err
    return last


def test_version(capsys):
    import magi_zoo

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"magi-zoo {magi_zoo.__version__}"


RUN = ["run", "wan2.1-tiny", "--prompt", "a corgi", "--gpu", "cpu"]


@pytest.mark.parametrize("value, needle", [
    ('WanTransformerBlock={"dynamic": fals}', "is not JSON"),
    ('WanTransformerBlock={"dynamik": false}', "dynamik"),
    ('WanTransformerBlock={"mode": "fast"}', "valid modes"),
    ("WanTransformerBlock", "expected KEY=JSON"),
    ("WanTransformerBlock=[1]", "expected a JSON object"),
])
def test_bad_compile_override_is_refused_before_the_build(capsys, tmp_path, monkeypatch, value, needle):
    import magi_zoo.zoo

    monkeypatch.setattr(magi_zoo.zoo, "load", lambda *a, **k: pytest.fail("built the model"))
    err = _err(capsys, RUN + ["--out", str(tmp_path / "a.mp4"), "--compile", value])
    assert err.startswith("magi-zoo: error: --compile") and "WanTransformerBlock" in err and needle in err


def test_compile_overrides_parse():
    from magi_zoo.cli import parse_compile_overrides

    assert parse_compile_overrides(['WanTransformerBlock={"dynamic": false}', "text_encoder=false",
                                    'vae={"decode": {"enabled": false}}']) == {
        "WanTransformerBlock": {"dynamic": False}, "text_encoder": {"enabled": False},
        "vae": {"decode": {"enabled": False}}}


def test_cache_dir_that_is_a_file_is_refused_before_the_build(capsys, tmp_path, monkeypatch):
    import magi_zoo.zoo

    monkeypatch.setattr(magi_zoo.zoo.adapters.Adapter, "build", lambda *a, **k: pytest.fail("built the model"))
    f = tmp_path / "cache"
    f.write_text("x")
    err = _err(capsys, RUN + ["--out", str(tmp_path / "a.mp4"), "--cache-dir", str(f)])
    assert "is not a directory" in err


def test_missing_spec_file_is_refused(capsys, tmp_path):
    assert "no such file" in _err(capsys, RUN + ["--out", str(tmp_path / "a.mp4"),
                                                 "--spec-file", str(tmp_path / "nope.toml")])


def test_gpu_without_cuda_is_one_line(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    err = _err(capsys, RUN[:-2] + ["--gpu", "h100", "--out", str(tmp_path / "a.mp4")])
    assert "needs CUDA" in err and "gpu='cpu'" in err


def test_empty_weights_directory_is_one_line(capsys, tmp_path):
    (tmp_path / "w").mkdir()
    err = _err(capsys, RUN + ["--weights", str(tmp_path / "w"), "--out", str(tmp_path / "a.mp4")])
    assert "cannot load the weights in directory" in err and "--weights random" in err


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """wan2.1-tiny saved by its adapter; loading it back must not warn about torch_dtype."""
    import torch

    from magi_zoo import adapters

    a, v = adapters.lookup("wan2.1-tiny")
    path = tmp_path_factory.mktemp("wan_tiny")
    a.save_pretrained(a.build(v, weights="random", dtype=torch.float32, device=torch.device("cpu")), path)
    return a, v, path


def test_loading_passes_dtype_not_torch_dtype(saved_tiny):
    import warnings

    import torch

    a, v, path = saved_tiny
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a.build(v, weights=str(path), dtype=torch.float32, device=torch.device("cpu"))
    assert not [x for x in w if "torch_dtype" in str(x.message)], [str(x.message) for x in w]


def test_corrupt_safetensors_is_one_line(capsys, saved_tiny, tmp_path):
    import shutil

    _, _, path = saved_tiny
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    f = next((bad / "transformer").glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated mid-tensor
    err = _err(capsys, RUN + ["--weights", str(bad), "--out", str(tmp_path / "a.mp4")])
    assert str(bad) in err and "--weights random" in err


def test_offline_hub_model_names_random_or_a_directory():
    # Offline (HF_HUB_OFFLINE=1) and not in the hub cache: every family's loader says what to
    # pass instead, never the library's `local_files_only=False` advice. Subprocess: the hub
    # library reads HF_HUB_OFFLINE at import.
    import os
    import tempfile

    code = (
        "import magi_zoo\n"
        "for name, gpu in [('wan2.1', 'cpu'), ('qwen3-omni', 'cpu'), ('bagel', 'cpu')]:\n"
        "    try:\n"
        "        magi_zoo.load(name, gpu=gpu)\n"
        "    except ValueError as e:\n"
        "        print('ERR', e)\n"
    )
    with tempfile.TemporaryDirectory() as hub:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=hub)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    errs = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERR")]
    assert len(errs) == 3, proc.stdout + proc.stderr[-2000:]
    for e in errs:
        assert "weights='random'" in e and "local directory" in e and "local_files_only" not in e, e


def test_plan_prints_as_a_table():
    import magi_zoo

    h = magi_zoo.load("wan2.1-tiny", gpu="cpu")
    text = str(h.plan)
    # one row per region (not per target: a published Wan has ~600), whatever sections the spec grows
    assert text.startswith("ResolvedPlan: ") and "4 x WanTransformerBlock" in text
    assert len(text.splitlines()) == 3 + len(h.plan.table()) < 30
    assert repr(h.plan) == text


def test_report_does_not_list_other_families_custom_ops(capsys):
    import magi_zoo
    import magi_zoo.adapters.qwen3_omni.ops  # noqa: F401  (registers magi_zoo::qwen3_omni_moe_experts)

    h = magi_zoo.load("wan2.1-tiny", gpu="cpu")
    assert "qwen3_omni" not in h.report().step("attention").did
    assert main(["spec", "qwen3-omni-tiny", "--gpu", "cpu"]) == 0
    assert "custom ops of this model: magi_zoo::qwen3_omni_moe_experts" in capsys.readouterr().out
