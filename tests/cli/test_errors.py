"""Bad input is refused before the model is built (issue 13's cases that live in `load`
and in the adapters' run checks); each test fails on the code before the fix."""

from __future__ import annotations

import pytest

import magi_zoo
from magi_zoo import adapters


@pytest.fixture
def no_build(monkeypatch):
    """Any build is a test failure: the error must come first."""
    adapter, _ = adapters.lookup("wan2.1-tiny")

    def build(*a, **k):
        raise AssertionError("the model was built before the bad input was refused")

    monkeypatch.setattr(adapter, "build", build)


def test_cache_dir_that_is_a_file_is_refused_before_the_build(tmp_path, no_build):
    f = tmp_path / "cache"
    f.write_text("not a directory")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", cache_dir=f)


@pytest.mark.parametrize("options, match", [
    ({"num_inference_steps": 0}, "--steps must be a positive integer, got 0"),
    ({"num_frames": -3}, "--frames must be a positive integer, got -3"),
    ({"height": 0}, "--height must be a positive integer"),
])
def test_non_positive_sizes_are_refused(options, match, tmp_path):
    adapter, variant = adapters.lookup("wan2.1-tiny")
    with pytest.raises(ValueError, match=match):
        adapter.check_run(variant, options, tmp_path / "out.mp4")


def test_max_new_tokens_zero_is_refused_not_replaced(tmp_path):
    # It used to be `max_new_tokens or default`: 0 silently became the default.
    adapter, variant = adapters.lookup("qwen3-omni-tiny")
    with pytest.raises(ValueError, match="--max-new-tokens must be a positive integer, got 0"):
        adapter.check_run(variant, {"max_new_tokens": 0}, tmp_path / "a.txt")


def test_gpu_names_are_case_insensitive_in_api_and_cli():
    from magi_zoo.cli import build_parser

    assert magi_zoo.get_profile("H100").name == "h100"
    args = build_parser().parse_args(["spec", "wan2.1-tiny", "--gpu", "H100"])
    assert args.gpu == "h100"


def test_cache_save_failure_is_a_warning_not_a_lost_result(tmp_path, monkeypatch):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile={"WanTransformerBlock": {"backend": "eager"}},
                      cache_dir=tmp_path / "cache")
    monkeypatch.setattr("torch.compiler.save_cache_artifacts", lambda: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.warns(RuntimeWarning, match="could not save the compile cache"):
        out = h(prompt="a corgi", output_type="np")
    assert out.frames.shape[1] == 9  # the generation came back


def test_qwen_run_has_a_progress_bar_and_says_when_nothing_decodes(tmp_path, capsys):
    from magi_zoo.cli import main

    out = tmp_path / "a.txt"
    assert main(["run", "qwen3-omni-tiny", "--gpu", "cpu", "--no-compile", "--prompt", "hi",
                 "--out", str(out), "--max-new-tokens", "3"]) == 0
    cap = capsys.readouterr()
    assert "thinker tokens" in cap.err and "3/3" in cap.err  # tqdm writes to stderr
    # the tiny model's seeded random weights decode to special tokens only: the run says so
    # instead of leaving a silent blank file
    assert out.read_text().strip() == "" and "decode to no text" in cap.out


def test_known_library_notices_are_quiet(capfd):
    # transformers' torchvision fallback and Qwen3-Omni's rope keys notice are not actionable
    magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)
    magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    err = capfd.readouterr().err
    assert "requires torchvision" not in err and "rope_parameters" not in err
