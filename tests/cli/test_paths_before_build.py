"""Every path a run writes or reads is checked before the model is built (issue 34): output
files and folders, the compile cache, `--image`, and `--weights` (a local path that does not
exist, weights of another family). Each test fails on the code before the fix."""

from __future__ import annotations

import json
import os

import pytest

import magi_zoo
from magi_zoo import adapters
from magi_zoo.cli import main


class Built(Exception):
    """Raised by the patched build: reaching it means every check before it passed."""


@pytest.fixture
def no_load(monkeypatch):
    """`zoo.load` (the build) raises `Built`: a check that comes too late never runs."""
    def load(*a, **k):
        raise Built("the model build was reached")

    monkeypatch.setattr(magi_zoo.zoo, "load", load)


@pytest.fixture
def no_build(monkeypatch):
    """Any adapter build is a test failure: the error must come first."""
    def build(self, *a, **k):
        raise AssertionError("the model was built before the bad input was refused")

    monkeypatch.setattr(adapters.Adapter, "build", build)


def read_only(monkeypatch, directory):
    """`directory` is read-only: chmod, and where running as root makes chmod ineffective,
    os.access answers as it would for another user (the check under test calls os.access)."""
    directory.chmod(0o555)
    if os.geteuid() == 0:
        real = os.access

        def access(path, mode, *a, **k):
            if os.path.abspath(path) == str(directory) and mode & os.W_OK:
                return False
            return real(path, mode, *a, **k)

        monkeypatch.setattr(os, "access", access)


def run(*argv):
    return main(["run", "wan2.1-tiny", "--gpu", "cpu", "--no-compile", "--prompt", "a corgi", *argv])


# -- outputs ------------------------------------------------------------------------------------
def test_out_naming_a_directory_is_refused_before_the_build_naming_the_users_path(tmp_path, no_load, capsys):
    d = tmp_path / "isdir.mp4"
    d.mkdir()
    assert run("--out", str(d)) == 2
    err = capsys.readouterr().err
    assert f"--out {str(d)!r} is an existing directory" in err
    assert ".partial" not in err and "build was reached" not in err


def test_existing_out_file_needs_overwrite(tmp_path, no_load, capsys):
    f = tmp_path / "a.mp4"
    f.write_bytes(b"the user's video")
    assert run("--out", str(f)) == 2
    err = capsys.readouterr().err
    assert "already exists; pass --overwrite" in err and "build was reached" not in err
    assert f.read_bytes() == b"the user's video"
    with pytest.raises(Built):  # with --overwrite every check passes and the build starts
        main(["--debug", "run", "wan2.1-tiny", "--gpu", "cpu", "--no-compile", "--prompt", "a corgi",
              "--out", str(f), "--overwrite"])


def test_out_in_a_read_only_directory_is_refused_before_the_build(tmp_path, no_load, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    try:
        assert run("--out", str(ro / "a.mp4")) == 2
        assert run("--out", str(ro / "new" / "a.mp4")) == 2  # a folder the write would create there
    finally:
        ro.chmod(0o755)
    err = capsys.readouterr().err
    assert f"the directory {str(ro)!r} is not writable" in err and "build was reached" not in err


def test_audio_out_and_cache_dir_are_checked_too(tmp_path, no_load, monkeypatch, capsys):
    speech = tmp_path / "s.wav"
    speech.write_bytes(b"RIFF")
    assert main(["run", "qwen3-omni-tiny", "--gpu", "cpu", "--no-compile", "--prompt", "hi",
                 "--out", str(tmp_path / "a.txt"), "--audio-out", str(speech)]) == 2
    assert "--audio-out" in capsys.readouterr().err
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    try:
        assert run("--out", str(tmp_path / "a.mp4"), "--cache-dir", str(ro / "cache")) == 2
    finally:
        ro.chmod(0o755)
    err = capsys.readouterr().err
    assert "--cache-dir" in err and "not writable" in err and "build was reached" not in err


def test_load_refuses_a_cache_dir_it_could_not_save_to(tmp_path, no_build, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    try:
        with pytest.raises(ValueError, match="not writable"):
            magi_zoo.load("wan2.1-tiny", gpu="cpu", cache_dir=ro / "cache")
    finally:
        ro.chmod(0o755)


def test_explain_out_is_checked_before_the_build(tmp_path, no_load, monkeypatch, capsys):
    used = tmp_path / "explain"
    used.mkdir()
    (used / "notes.md").write_text("the user's notes")
    base = ["explain", "wan2.1-tiny", "--gpu", "cpu"]
    assert main([*base, "--out", str(used)]) == 2
    assert "not empty; pass --overwrite" in capsys.readouterr().err
    with pytest.raises(Built):
        main(["--debug", *base, "--out", str(used), "--overwrite"])
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    try:
        assert main([*base, "--out", str(ro / "explain")]) == 2
    finally:
        ro.chmod(0o755)
    assert "not writable" in capsys.readouterr().err


def test_atomic_write_over_a_directory_names_the_path_not_the_temporary_file(tmp_path):
    from magi_zoo.io import atomic_write_text

    d = tmp_path / "isdir.txt"
    d.mkdir()
    with pytest.raises(IsADirectoryError) as e:
        atomic_write_text(d, "x")
    assert str(d) in str(e.value) and ".partial" not in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["isdir.txt"]  # no temporary file left behind


# -- inputs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, extra", [("bagel-tiny", []), ("qwen3-omni-tiny", ["--max-new-tokens", "2"])])
def test_image_missing_or_not_an_image_is_refused_before_the_build(tmp_path, no_load, capsys, model, extra):
    out = tmp_path / ("a.png" if model.startswith("bagel") else "a.txt")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    for image, why in [(tmp_path / "nope.png", "no such file"), (text, "not an image"),
                       (tmp_path, "file")]:  # a directory: "not a file" (Qwen3-Omni's own check: "no such file")
        assert main(["run", model, "--gpu", "cpu", "--no-compile", "--prompt", "p", "--out", str(out),
                     "--image", str(image), *extra]) == 2
        err = capsys.readouterr().err
        assert f"--image {str(image)!r}" in err and why in err and "build was reached" not in err, err


# -- weights --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, path", [
    ("/abs/dir", True), ("./rel", True), ("../up", True), ("~/w", True), (".", True), ("a/b/c", True),
    ("ckpt.safetensors", True), ("org/model.pt", True), ("my weights", True), ("a\\b", True),
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", False), ("Qwen/Qwen3-Omni-30B-A3B-Instruct", False), ("gpt2", False),
])
def test_the_shape_of_weights_decides_path_or_hub_id(text, path):
    from magi_zoo.adapters.weights_check import path_reason

    assert (path_reason(text) is not None) == path


@pytest.mark.parametrize("model", ["wan2.1-tiny", "wan2.1-t2v-1.3b", "flux-tiny"])
def test_a_missing_local_weights_path_is_an_error_about_the_path(tmp_path, no_build, model):
    missing = str(tmp_path / "no" / "such" / "weights")
    with pytest.raises(ValueError, match=r"no such directory \(it reads as a local path"):
        magi_zoo.load(model, gpu="cpu", weights=missing)
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file; pass the checkpoint directory"):
        magi_zoo.load(model, gpu="cpu", weights=str(f))


def test_a_hub_id_that_cannot_be_fetched_says_no_local_directory_either():
    from magi_zoo.adapters.diffusers_pipeline import weights_error

    _, variant = adapters.lookup("wan2.1-t2v-1.3b")
    e = weights_error(variant, "someorg/nosuchmodel", False, OSError("offline"))
    assert "no local directory 'someorg/nosuchmodel' either" in str(e)


def _wan_dirs(tmp_path):
    """Wan checkpoints as the published layouts declare them (only the declaring files)."""
    diffusers = tmp_path / "wan-diffusers"
    (diffusers / "transformer").mkdir(parents=True)
    (diffusers / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    (diffusers / "transformer" / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    original = tmp_path / "wan-original"
    original.mkdir()
    (original / "config.json").write_text(json.dumps({"model_type": "t2v", "dim": 1536, "num_heads": 12}))
    return diffusers, original


@pytest.mark.parametrize("model, expected", [("flux-tiny", "Flux"), ("flux-schnell", "Flux"),
                                             ("bagel-tiny", "BAGEL"), ("qwen3-omni-tiny", "Qwen3-Omni")])
def test_weights_of_another_family_are_named_before_the_plan(tmp_path, no_build, model, expected):
    for d in _wan_dirs(tmp_path):
        with pytest.raises(ValueError, match=f"are a Wan checkpoint .*found .*, not {expected}"):
            magi_zoo.load(model, gpu="cpu", weights=str(d))


def test_weights_identification_reads_each_published_layout(tmp_path):
    from magi_zoo.adapters.weights_check import identify

    diffusers, original = _wan_dirs(tmp_path)
    assert identify(diffusers).family == "Wan" and "WanPipeline" in identify(diffusers).found
    assert identify(original).family == "Wan"
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    bagel = tmp_path / "bagel"
    bagel.mkdir()
    (bagel / "llm_config.json").write_text("{}")
    (bagel / "vit_config.json").write_text("{}")
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"architectures": ["Qwen3OmniMoeForConditionalGeneration"]}))
    sf = tmp_path / "self-forcing"
    (sf / "transformer").mkdir(parents=True)
    (sf / "transformer" / "config.json").write_text(json.dumps({"_class_name": "CausalWanTransformer3DModel"}))
    assert [identify(d).family for d in (flux, bagel, qwen, sf)] == ["Flux", "BAGEL", "Qwen3-Omni", "Wan"]
    (tmp_path / "empty").mkdir()
    assert identify(tmp_path / "empty") is None  # nothing declared: the family's loader says what it expected
    # a family's own weights pass (the loader takes it from there)
    a, v = adapters.lookup("wan2.1-tiny")
    assert a.weights_source(v, str(diffusers)) == str(diffusers)
    a, v = adapters.lookup("self-forcing-tiny")
    assert a.weights_source(v, str(sf)) == str(sf)


def test_a_cached_hub_id_of_another_family_is_named_before_the_build(tmp_path, no_build, monkeypatch):
    # the hub cache's documented layout: models--org--name/{refs/main, snapshots/<commit>/...}
    import huggingface_hub.constants

    repo = tmp_path / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (snap / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="are a Wan checkpoint .*hub cache.*, not Flux"):
        magi_zoo.load("flux.1-schnell", gpu="cpu", weights="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


def test_generate_to_checks_the_output_path_before_generating(tmp_path, monkeypatch):
    # the Python path of `magi-zoo run` after the build: a path it cannot write is refused
    # before the generation, not after it
    import types

    from magi_zoo.cli import generate_to

    adapter, variant = adapters.lookup("wan2.1-tiny")
    monkeypatch.setattr(adapter, "generate", lambda *a, **k: (_ for _ in ()).throw(Built("generated")))
    handle = types.SimpleNamespace(adapter=adapter, variant=variant)
    d = tmp_path / "isdir.mp4"
    d.mkdir()
    with pytest.raises(ValueError, match="is an existing directory"):
        generate_to(handle, prompt="p", out=d)
    f = tmp_path / "a.mp4"
    f.write_bytes(b"old")
    with pytest.raises(ValueError, match="already exists"):
        generate_to(handle, prompt="p", out=f, overwrite=False)
    with pytest.raises(Built):
        generate_to(handle, prompt="p", out=f)  # the API's default replaces, as before
