"""A call's sizes and counts are checked against the family's constraints before any work
(issue 34): divisibility (VAE factor x patch), the longest grid the model's position table
covers, a memory estimate against the machine, and counts that make no sense (0 steps)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import magi_zoo
from magi_zoo import adapters
from magi_zoo.cli import main


@pytest.fixture
def no_build(monkeypatch):
    """Any build is a test failure: the error must come first."""
    def build(*a, **k):
        raise AssertionError("the model was built before the bad input was refused")

    for name in ("wan2.1-tiny", "flux-tiny", "bagel-tiny", "self-forcing-tiny"):
        adapter, _ = adapters.lookup(name)
        monkeypatch.setattr(adapter, "build", build)


def _cli_error(capsys, argv) -> str:
    """stderr of a refused run, less the heartbeat (`  ... loading the model libraries: 1 s`,
    printed when a stage is quiet for 1.25 s: on a busy machine, or the first import in a process)."""
    assert main(argv) == 2
    return "".join(line for line in capsys.readouterr().err.splitlines(keepends=True) if not line.startswith("  ... "))


@pytest.mark.parametrize("model, out, extra, match", [
    # the RoPE table of wan2.1-tiny covers 32 patches per axis: 32 x 16 = 512 px
    ("wan2.1-tiny", "v.mp4", ["--height", "4096", "--width", "4096"], "at most 512"),
    ("wan2.1-tiny", "v.mp4", ["--height", "17"], "divisible by 16"),
    ("wan2.1-tiny", "v.mp4", ["--frames", "10"], "1 \\+ 4 k"),
    ("wan2.1-tiny", "v.mp4", ["--height", "100000", "--width", "100000", "--frames", "100000"], "at most"),
    ("flux-tiny", "i.png", ["--height", "17"], "divisible by 16"),
    ("flux-tiny", "i.png", ["--height", "100000", "--width", "100000"], "GiB"),
    ("bagel-tiny", "i.png", ["--height", "4096", "--width", "4096"], "at most 128"),
    ("bagel-tiny", "i.png", ["--height", "40"], "divisible by 16"),
])
def test_cli_sizes_are_refused_before_the_build(capsys, tmp_path, no_build, model, out, extra, match):
    err = _cli_error(capsys, ["run", model, "--gpu", "cpu", "--prompt", "x", "--out", str(tmp_path / out), *extra])
    assert err.startswith("magi-zoo: error:") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


def test_memory_estimate_is_against_the_machine():
    adapter, variant = adapters.lookup("flux-tiny")
    # 100000^2 decoded as float32 is ~112 GiB: beyond a 16 GiB card, whatever the host has
    with pytest.raises(ValueError, match="GiB"):
        adapter.check_call(variant, {"height": 100000, "width": 100000}, device_gib=16)
    adapter.check_call(variant, {"height": 1024, "width": 1024}, device_gib=16)  # fits


@pytest.mark.parametrize("kwargs, match", [
    ({"num_inference_steps": 0}, "num_inference_steps must be a positive integer, got 0"),
    ({"num_inference_steps": 1.5}, "num_inference_steps must be a positive integer"),
    ({"num_frames": -3}, "num_frames must be a positive integer, got -3"),
    ({"height": True}, "height must be a positive integer"),
    ({"guidance_scale": -1.0}, "guidance_scale must be a number >= 0"),
    ({"height": 40}, "divisible by 16"),
])
def test_python_call_is_checked_before_any_work(kwargs, match):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)

    def boom(*a, **k):
        raise AssertionError("the pipeline ran before the bad call was refused")

    h.pipe = type("P", (), {"__call__": boom})()
    with pytest.raises(ValueError, match=match):
        h(prompt="x", **kwargs)


def test_defaults_of_every_variant_pass_their_own_checks():
    for name in adapters.list_models():
        adapter, variant = adapters.lookup(name)
        adapter.check_call(variant, adapter.call_defaults(variant))


def test_limits_come_from_the_config():
    adapter, variant = adapters.lookup("wan2.1-t2v-1.3b")
    lim = adapter.call_limits(variant)
    assert lim.pixel_multiple == 16 and lim.max_grid == 1024 and lim.frame_step == 4
    adapter, variant = adapters.lookup("flux.1-dev")
    assert adapter.call_limits(variant).pixel_multiple == 16
    adapter, variant = adapters.lookup("bagel-7b-mot")
    lim = adapter.call_limits(variant)
    assert lim.pixel_multiple == 16 and lim.max_grid == 64


def test_check_run_uses_cli_flag_names(tmp_path):
    adapter, variant = adapters.lookup("wan2.1-tiny")
    with pytest.raises(ValueError, match="--height 17"):
        adapter.check_run(variant, {"height": 17}, Path(tmp_path / "v.mp4"))


@pytest.mark.parametrize("model, argv, match", [
    # 10**8 steps built sigma arrays until the OOM killer came; the cap is the scheduler's grid
    ("wan2.1-tiny", ["--out", "v.mp4", "--steps", "100000000"],
     r"--steps 100000000: wan2.1-tiny takes at most 1,000 \(its scheduler has 1,000 training timesteps\)"),
    ("flux-tiny", ["--out", "i.png", "--steps", "1001"], "takes at most 1,000"),
    ("bagel-tiny", ["--out", "a.txt", "--task", "understand", "--image", "IMAGE", "--max-new-tokens", "100000000"],
     r"takes at most 1,024 \(its language model holds 1,024 positions\)"),
])
def test_cli_counts_past_their_caps_are_refused_before_the_build(capsys, tmp_path, no_build, model, argv, match):
    from PIL import Image

    image = tmp_path / "in.png"
    Image.new("RGB", (64, 64)).save(image)
    argv = [str(tmp_path / a) if a.endswith((".mp4", ".png", ".txt")) else str(image) if a == "IMAGE" else a
            for a in argv]
    err = _cli_error(capsys, ["run", model, "--gpu", "cpu", "--prompt", "x", *argv])
    assert err.startswith("magi-zoo: error:") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


def test_count_caps_come_from_the_config():
    """Each cap is read from the variant's config, so a config with another grid or table
    moves it; a count at its cap passes, one past it is refused."""
    for name, key, cap in [("wan2.1-t2v-1.3b", "num_inference_steps", 1000),
                           ("ltx-2", "num_inference_steps", 1000),  # its config leaves the default
                           ("bagel-7b-mot", "max_think_tokens", 32768),
                           ("qwen3-omni-30b-a3b", "max_new_tokens", 65536),
                           ("qwen3-omni-30b-a3b", "talker_max_new_tokens", 65536),
                           ("qwen3-omni-tiny", "max_new_tokens", 4096)]:
        adapter, variant = adapters.lookup(name)
        assert adapter.count_caps(variant)[key][0] == cap, name
        adapter.check_call(variant, {key: cap})
        with pytest.raises(ValueError, match=f"{key}={cap + 1}: {name} takes at most {cap:,}"):
            adapter.check_call(variant, {key: cap + 1})
    adapter, variant = adapters.lookup("wan2.1-tiny")
    other = dataclasses.replace(variant, config=dict(variant.config, scheduler=dict(variant.config["scheduler"],
                                                                                   num_train_timesteps=50)))
    with pytest.raises(ValueError, match="at most 50"):
        adapter.check_call(other, {"num_inference_steps": 51})
    adapter, variant = adapters.lookup("self-forcing-tiny")
    assert adapter.count_caps(variant) == {}  # a fixed denoising list: no scheduler to cap


def test_python_call_past_a_token_cap_is_refused_before_the_cache_is_sized():
    """qwen3-omni sizes its static KV cache by the token budget: 10**9 asked the host for 128 GB
    before this check; now the handle refuses it before the pipeline runs."""
    h = magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)

    def boom(*a, **k):
        raise AssertionError("the pipeline ran before the bad call was refused")

    h.pipe = type("P", (), {"__call__": boom})()
    with pytest.raises(ValueError, match="max_new_tokens=1000000000: qwen3-omni-tiny takes at most 4,096"):
        h("x", max_new_tokens=10**9)
