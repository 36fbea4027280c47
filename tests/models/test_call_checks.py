"""A call's sizes and counts are checked against the family's constraints before any work
(issue 34): divisibility (VAE factor x patch), the longest grid the model's position table
covers, a memory estimate against the machine, and counts that make no sense (0 steps)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch

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
    ({"guidance_scale": -1.0}, "guidance_scale must be a finite number >= 0"),
    # inf passed `>= 0` and made a video of NaNs
    ({"guidance_scale": float("inf")}, "guidance_scale must be a finite number >= 0, got inf"),
    ({"generator": 5}, "generator must be a torch.Generator or a list of them"),
    ({"generator": []}, "generator must be a torch.Generator"),
    # Z-Image's pipeline failed on a bare assert; others broadcast or fail deep
    ({"prompt": ["a", "b"], "negative_prompt": ["c"]}, "negative_prompt: 1 negative prompts for 2 prompt"),
    ({"negative_prompt": ["c", "d"]}, "negative_prompt: 2 negative prompts for 1 prompt"),
    # 10**9 tiny videos are ~100 TiB decoded: the outputs count, not one video's size
    ({"num_videos_per_prompt": 10**9}, r"x 1000000000 outputs: .* GiB"),
    ({"prompt": ["x"] * 10**5, "height": 512, "width": 512, "num_frames": 81}, r"x 100000 outputs: .* GiB"),
    ({"height": 40}, "divisible by 16"),
    # read only after the last step: Wan's video processor raised there, image pipelines coerce
    ({"output_type": "bogus"}, "output_type must be one of 'pil', 'np', 'pt', 'latent', got 'bogus'"),
    ({"output_type": ["np"]}, "output_type must be one of"),
    # the tokenizers failed inside: an empty list as an IndexError, a number as a TypeError
    ({"prompt": []}, "prompt is an empty list"),
    ({"prompt": ["a", 3]}, r"prompt: every item must be a string, got int \(3\)"),
    ({"prompt": 5}, "prompt must be a string or a list of strings, got int"),
    ({"negative_prompt": b"x"}, "negative_prompt must be a string or a list of strings, got bytes"),
    # failed after the first denoising step ("'int' object is not callable")
    ({"callback_on_step_end": 5}, "callback_on_step_end must be callable"),
    ({"attention_kwargs": 5}, "attention_kwargs must be a dict"),
    # read by truth value: "no" returned the output object
    ({"return_dict": "no"}, "return_dict must be True or False, got 'no'"),
    ({"generator": [torch.Generator()] * 3}, r"generator: 3 generators for 1 output\(s\)"),
    ({"latents": [1.0, 2.0]}, "latents must be a torch.Tensor, got list"),
    # guidance_scale <= 1: WanPipeline builds no unconditional branch and drops the prompt
    ({"negative_prompt": "blurry", "guidance_scale": 1.0},
     "negative_prompt would be ignored: guidance runs at guidance_scale > 1, and this call has guidance_scale=1.0"),
])
def test_python_call_is_checked_before_any_work(kwargs, match):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)

    def boom(*a, **k):
        raise AssertionError("the pipeline ran before the bad call was refused")

    h.pipe = type("P", (), {"__call__": boom})()
    with pytest.raises((ValueError, TypeError), match=match):
        h(**{"prompt": "x", **kwargs})


def test_an_unknown_keyword_names_the_closest_and_all_taken():
    """Python's own TypeError named neither; the check runs before the defaults merge."""
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    with pytest.raises(TypeError, match="wan2.1-tiny's call takes no argument 'num_inference_step' -- did you mean "
                                        "'num_inference_steps'\\? It takes: .*guidance_scale, .*num_frames"):
        h(prompt="x", num_inference_step=2)
    with pytest.raises(TypeError, match="takes no argument 'sigmas'\\. It takes"):  # nothing close: no guess
        h(prompt="x", sigmas=[1.0, 0.5])


def test_load_names_the_keyword_meant():
    with pytest.raises(TypeError, match="load\\(\\) takes no argument 'complie' -- did you mean 'compile'\\? It takes: "
                                        "cache_dir, calibrate, compile"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", complie=False)
    import inspect
    assert "memory_budget_gib" in inspect.signature(magi_zoo.load).parameters  # help() still shows them


def test_true_cfg_arguments_that_would_be_dropped_are_refused():
    """FluxPipeline runs true CFG only with true_cfg_scale > 1 *and* a negative prompt, and
    only logged a warning when one came without the other."""
    adapter, variant = adapters.lookup("flux-tiny")
    call = adapter.call_defaults(variant)
    with pytest.raises(ValueError, match="negative_prompt would be ignored: .*leaves true_cfg_scale at the "
                                         "pipeline's default; raise true_cfg_scale above 1"):
        adapter.check_call(variant, {**call, "negative_prompt": "x"}, given={"negative_prompt": "x"})
    with pytest.raises(ValueError, match="true_cfg_scale=4.0 would be ignored: .*pass negative_prompt"):
        adapter.check_call(variant, {**call, "true_cfg_scale": 4.0}, given={"true_cfg_scale": 4.0})
    both = {"true_cfg_scale": 4.0, "negative_prompt": "x"}
    adapter.check_call(variant, {**call, **both}, given=both)
    # a default negative prompt is the variant's, not the caller's: never refused
    adapter.check_call(variant, {**call, "negative_prompt": "x"}, given={})


def test_a_custom_schedule_is_numbers_and_sets_the_step_count():
    adapter, variant = adapters.lookup("flux-tiny")
    call = adapter.call_defaults(variant)
    with pytest.raises(ValueError, match="sigmas: every item must be a finite number, got nan"):
        adapter.check_call(variant, {**call, "sigmas": [1.0, float("nan")]})
    with pytest.raises(TypeError, match="sigmas must be a non-empty list of numbers"):
        adapter.check_call(variant, {**call, "sigmas": "1.0,0.5"})
    given = {"sigmas": [1.0, 0.6, 0.3], "num_inference_steps": 2}
    with pytest.raises(ValueError, match="num_inference_steps=2 but sigmas has 3 entries"):
        adapter.check_call(variant, {**call, **given}, given=given)
    import numpy as np
    for sigmas in (np.array([1.0, 0.5]), torch.tensor([1.0, 0.5])):  # what the pipelines take, as they take it
        adapter.check_call(variant, {**call, "sigmas": sigmas, "num_inference_steps": 2},
                           given={"sigmas": sigmas, "num_inference_steps": 2})


@pytest.mark.parametrize("model", ["wan2.1-tiny", "flux-tiny"])
def test_latents_the_pipeline_drew_pass_the_check_unchanged(model):
    """The latents check compares a given tensor with the pipeline's own draw; the tensor the
    pipeline drew itself, passed back, makes the same output as the generator did."""
    h = magi_zoo.load(model, gpu="cpu", compile=False)
    drawn = []
    prepare = h.pipe.prepare_latents

    def spy(*a, **k):
        out = prepare(*a, **k)
        drawn.append((out[0] if isinstance(out, tuple) else out).clone())
        return out

    h.pipe.prepare_latents = spy
    first = h(prompt="a corgi", num_inference_steps=1, generator=torch.Generator().manual_seed(0),
              output_type="latent")
    h.pipe.prepare_latents = prepare
    again = h(prompt="a corgi", num_inference_steps=1, latents=drawn[0], output_type="latent")
    key = "frames" if hasattr(first, "frames") else "images"
    assert torch.equal(getattr(first, key), getattr(again, key))
    with pytest.raises(ValueError, match=rf"do not fit this call of .*Pipeline: .*prepare to {re.escape(str(tuple(drawn[0].shape)))}"):
        h(prompt="a corgi", num_inference_steps=1, latents=drawn[0][..., :-1])


def test_numpy_counts_and_scales_are_numbers():
    """Sizes computed with numpy are integers: taken as they are, not refused."""
    import numpy as np

    adapter, variant = adapters.lookup("wan2.1-tiny")
    adapter.check_call(variant, {"height": np.int64(32), "width": np.int32(32), "num_frames": np.int64(9),
                                 "guidance_scale": np.float32(3.0)})
    with pytest.raises(ValueError, match="height must be a positive integer"):
        adapter.check_call(variant, {"height": np.float64(32.0)})


def test_defaults_of_every_variant_pass_their_own_checks():
    """Also when a caller passes them explicitly: the checks on what was given (`check_given`:
    a negative prompt without guidance, true CFG without one) never refuse a variant's defaults."""
    from PIL import Image

    for name in adapters.list_models():
        adapter, variant = adapters.lookup(name)
        adapter.check_call(variant, adapter.call_defaults(variant))
        given = adapter.call_defaults(variant)
        if adapter.image_to_video(variant):  # its first frame is the caller's, never a default
            given["image"] = Image.new("RGB", (64, 64))
        adapter.check_call(variant, adapter.call_defaults(variant), given=given)


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
    assert "num_inference_steps" not in adapter.count_caps(variant)  # a fixed denoising list: no scheduler


def test_python_call_past_a_token_cap_is_refused_before_the_cache_is_sized():
    """qwen3-omni sizes its static KV cache by the token budget: 10**9 asked the host for 128 GB
    before this check; now the handle refuses it before the pipeline runs."""
    h = magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)

    def boom(*a, **k):
        raise AssertionError("the pipeline ran before the bad call was refused")

    h.pipe = type("P", (), {"__call__": boom})()
    with pytest.raises(ValueError, match="max_new_tokens=1000000000: qwen3-omni-tiny takes at most 4,096"):
        h("x", max_new_tokens=10**9)


def test_positional_arguments_are_checked_where_they_land():
    """The handle binds positional arguments to the pipeline's own parameter names before its
    checks: WanPipeline's sixth positional is num_inference_steps, so 10**8 there is refused as
    steps; a name given by position and by keyword is Python's TypeError, before any work."""
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    seen = {}

    native = type(h.pipe).__call__

    @functools.wraps(native)  # the pipeline's own signature, which the handle binds by
    def record(self, *args, **kwargs):
        seen.update(args=args, kwargs=kwargs)

    h.pipe.__class__ = type("Recording", (type(h.pipe),), {"__call__": record})
    with pytest.raises(ValueError, match="num_inference_steps=100000000: wan2.1-tiny takes at most 1,000"):
        h("x", None, 64, 64, 9, 10**8)
    with pytest.raises(ValueError, match="height must be a positive integer, got 0"):
        h("x", None, 0)
    with pytest.raises(TypeError, match="multiple values for argument 'prompt'"):
        h("x", prompt="y")
    assert not seen  # the pipeline never ran
    h("x", "blurry", num_inference_steps=2)
    assert seen["args"] == () and seen["kwargs"]["prompt"] == "x" and seen["kwargs"]["negative_prompt"] == "blurry"
    assert seen["kwargs"]["num_inference_steps"] == 2


def test_text_length_caps():
    """max_sequence_length: Wan's official text_len (and exactly it for image-to-video, whose
    attention splits image from text tokens at 512 from the end), the pipelines' own limits
    (Flux 512, Qwen-Image 1024) checked before the build, the text encoder's position table."""
    for name, cap in [("wan2.1-t2v-1.3b", 512), ("self-forcing-tiny", 512), ("flux.1-dev", 512),
                      ("qwen-image", 1024), ("ltx-2", 131072), ("flux.2-klein-4b", 40960), ("z-image-turbo", 992)]:
        adapter, variant = adapters.lookup(name)
        adapter.check_call(variant, {"max_sequence_length": cap})
        with pytest.raises(ValueError, match=f"max_sequence_length={cap + 1}: {name} takes at most {cap:,}"):
            adapter.check_call(variant, {"max_sequence_length": cap + 1})
    adapter, variant = adapters.lookup("wan2.1-i2v-14b-480p")
    adapter.check_call(variant, {"max_sequence_length": 512})
    with pytest.raises(ValueError, match="takes exactly 512 text tokens"):
        adapter.check_call(variant, {"max_sequence_length": 256})
    adapter, variant = adapters.lookup("wan2.1-t2v-1.3b")
    adapter.check_call(variant, {"max_sequence_length": 256})  # text-to-video may take fewer


def test_z_image_caption_cap_is_the_rope_table_edge():
    """The cap is exact: a 4,000-token prompt runs at max_sequence_length=992 (the caption padded
    to 992, the image at position 993 of RoPE's 1,024) and 1,024 is refused before the text
    encoder runs, where it failed with an IndexError after it."""
    h = magi_zoo.load("z-image-tiny", gpu="cpu", compile=False)
    prompt = " ".join(["cat dog bird fish"] * 400)
    assert len(h.pipe.tokenizer(prompt).input_ids) > 1024
    h(prompt, max_sequence_length=992, num_inference_steps=1, height=64, width=64)

    def boom(*a, **k):
        raise AssertionError("the pipeline ran before the bad call was refused")

    h.pipe = type("P", (), {"__call__": boom})()
    with pytest.raises(ValueError, match="max_sequence_length=1024: z-image-tiny takes at most 992"):
        h(prompt=prompt, max_sequence_length=1024)


def test_an_image_pipelines_output_type_is_checked_not_coerced():
    """diffusers' image processor turned an unknown output_type into numpy arrays (with a
    deprecation warning) after the whole generation; it is refused before, and every kind the
    pipelines return passes."""
    adapter, variant = adapters.lookup("flux-tiny")
    with pytest.raises(ValueError, match="output_type must be one of"):
        adapter.check_call(variant, {"output_type": "jpeg"})
    for kind in ("pil", "np", "pt", "latent"):
        adapter.check_call(variant, {"output_type": kind})
    # BAGEL's own pipeline returns a tensor ("pt") or a PIL image: it turned "np" into PIL
    bagel, variant = adapters.lookup("bagel-tiny")
    with pytest.raises(ValueError, match="output_type must be one of 'pil', 'pt', got 'np'"):
        bagel.check_call(variant, {"output_type": "np"})
    bagel.check_call(variant, {"output_type": "pt"})


def test_an_api_image_is_a_kind_the_pipeline_reads():
    """FLUX.2's image processor reads PIL images only and raised after the text encoder ran; an
    empty list failed inside torch.cat. Both are refused first, with the minimum side too."""
    from PIL import Image

    adapter, variant = adapters.lookup("flux.2-tiny")
    call = adapter.call_defaults(variant)
    for bad, kind in ((5, "int"), ("in.png", "str"), (torch.zeros(3, 64, 64), "Tensor")):
        with pytest.raises(TypeError, match=f"image must be a PIL image, got {kind}; for a file, PIL.Image.open"):
            adapter.check_call(variant, {**call, "image": bad}, given={"image": bad})
    with pytest.raises(ValueError, match="image is an empty list"):
        adapter.check_call(variant, {**call, "image": []}, given={"image": []})
    with pytest.raises(ValueError, match="2x2; flux2 takes input images of at least 64x64"):
        adapter.check_call(variant, call, given={"image": [Image.new("RGB", (2, 2))]})
    adapter.check_call(variant, call, given={"image": [Image.new("RGB", (64, 64))] * 2})
    # BAGEL opens a file itself (first thing in its call, with its own errors): a path passes here
    bagel, bvariant = adapters.lookup("bagel-tiny")
    bagel.check_call(bvariant, bagel.call_defaults(bvariant), given={"image": "/nonexistent/in.png"})
    with pytest.raises(TypeError, match="image must be a PIL image or a file's path, got ndarray"):
        import numpy as np
        bagel.check_call(bvariant, bagel.call_defaults(bvariant), given={"image": np.zeros((8, 8, 3))})


def test_load_device_is_one_this_machine_has(monkeypatch):
    """torch's "Invalid device string" named no fix, and a card index past the machine's failed
    inside the build; both are refused first, with what to pass."""
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device .*pass 'cpu', 'cuda' or 'cuda:N'"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", device="gpu0")
    with pytest.raises(ValueError, match="device='meta': models are built on 'cpu' or 'cuda'"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="device='cuda:7': this machine has 2 CUDA device\\(s\\), cuda:0 to cuda:1"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", device="cuda:7")


@pytest.mark.parametrize("model", ["wan2.1-i2v-14b-480p", "hunyuanvideo-1.5-480p-i2v"])
def test_an_image_to_video_call_needs_its_first_frame(model):
    """Checked on the published variant's adapter (nothing is built): a call without `image=`
    was Python's "missing 1 required positional argument" from the pipeline."""
    from PIL import Image

    adapter, variant = adapters.lookup(model)
    call = adapter.call_defaults(variant)
    with pytest.raises(ValueError, match=f"{model} is image-to-video: pass image="):
        adapter.check_call(variant, call, given={"prompt": "x"})
    adapter.check_call(variant, call, given={"prompt": "x", "image": Image.new("RGB", (64, 64))})
