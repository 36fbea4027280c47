"""Wan2.1 image-to-video: `--image` is the first frame of the I2V variants (480p, 720p), and
I2V weights in the original Wan layout (with the open-clip image encoder) load like the
diffusers-format directory.

The published I2V models are 14B; the path is run on a tiny I2V configuration built by the
Wan adapter (WanImageToVideoPipeline with a small CLIP image encoder), not registered as a
variant (so the conformance suite does not build it a second time).
"""

import numpy as np
import pytest
import torch

import magi_zoo
from magi_zoo import adapters
from magi_zoo.adapters.base import Variant
from magi_zoo.adapters.wan import WanAdapter
from magi_zoo.adapters.wan.config import TINY_I2V, TINY_I2V_CALL

# I2V-14B's structure in small (adapters/wan/config.py: TINY_I2V): 36 input channels (16 noise
# + 4 mask + 16 image latents), CLIP image tokens (224 / 14 = 16 -> 256 patches + class = 257,
# gelu as published) projected by the added K/V, and 512 text tokens, where diffusers' Wan
# attention splits image from text tokens.
VARIANT = Variant(name="wan2.1-i2v-tiny-test", family="wan", config=TINY_I2V, tiny=True,
                  call_defaults=dict(TINY_I2V_CALL))


@pytest.fixture(scope="module")
def handle():
    from magi_zoo.zoo import ZooPipeline

    adapter = WanAdapter()
    pipe = adapter.build(VARIANT, weights=None, dtype=torch.float32, device=torch.device("cpu"))
    return ZooPipeline(pipe, torch.nn.ModuleDict(adapter.components(pipe)), None, adapter=adapter, variant=VARIANT,
                       profile=magi_zoo.get_profile("cpu"), dtype=torch.float32, device=torch.device("cpu"), layers=[])


@pytest.fixture
def png(tmp_path):
    from PIL import Image

    path = tmp_path / "first.png"
    rgba = np.random.default_rng(0).integers(0, 256, (40, 48, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(path)
    return path


def test_generate_takes_the_image_as_the_first_frame(handle, png):
    from PIL import Image

    assert type(handle.pipe).__name__ == "WanImageToVideoPipeline"
    out = handle.adapter.generate(handle, prompt="a corgi surfing", image=str(png), seed=0, progress=False)
    assert out.kind == "video" and len(out.value) == 9 and out.value[0].shape == (32, 32, 3)
    # the pipeline's (F, H, W, 3) array as it is: a list of frames would be stacked again by the writer
    assert isinstance(out.value, np.ndarray) and out.value.shape == (9, 32, 32, 3)
    # The same call on the pipeline itself, with the image read as Wan's generate.py reads
    # it (convert("RGB")): the same video.
    want = handle(prompt="a corgi surfing", image=Image.open(png).convert("RGB"), output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames[0]
    assert np.array_equal(np.stack(out.value), want)


def test_image_is_required_by_i2v_and_refused_by_t2v(png, tmp_path):
    a, v720 = adapters.lookup("wan2.1-i2v-14b-720p")
    with pytest.raises(ValueError, match=r"wan2\.1-i2v-14b-720p is image-to-video: pass --image FILE"):
        a.check_run(v720, {"image": None}, tmp_path / "out.mp4")
    # the file itself is check_inputs' (each caller runs it after check_run: the header is read once)
    with pytest.raises(ValueError, match=r"--image '.*nope\.png': no such file"):
        a.check_inputs(a.check_run(v720, {"image": str(tmp_path / "nope.png")}, tmp_path / "out.mp4"))
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"not an image PIL can read"):
        a.check_inputs(a.check_run(v720, {"image": str(tmp_path / "text.png")}, tmp_path / "out.mp4"))
    assert a.check_run(v720, {"image": str(png)}, tmp_path / "out.mp4") == {"image": str(png)}
    a.check_inputs({"image": str(png)})
    a, tiny = adapters.lookup("wan2.1-tiny")
    with pytest.raises(ValueError, match=r"wan2\.1-tiny cannot use --image; .*; --image is for the image-to-video "
                                         r"variants: wan2\.1-i2v-14b-480p, wan2\.1-i2v-14b-720p, "
                                         r"wan2\.1-i2v-14b-480p-distill, wan2\.1-i2v-14b-480p-distill-lora$"):
        a.check_run(tiny, {"image": str(png)}, tmp_path / "out.mp4")
    a22, tiny22 = adapters.lookup("wan2.2-tiny")  # Wan2.2 registers no image-to-video variant
    with pytest.raises(ValueError, match=r"wan2\.2-tiny cannot use --image; it takes --prompt, --out and --steps, "
                                         r"--height, --width, --frames, --seed$"):
        a22.check_run(tiny22, {"image": str(png)}, tmp_path / "out.mp4")
    # An I2V variant lists what it takes when given something it cannot use.
    with pytest.raises(ValueError, match=r"wan2\.1-i2v-14b-720p cannot use --max-new-tokens"):
        a.check_run(v720, {"image": str(png), "max_new_tokens": 4}, tmp_path / "out.mp4")


# -- the original layout ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def i2v_dirs(handle, tmp_path_factory):
    """The tiny I2V model (with the published VAE structure at width 4, which diffusers' VAE
    converter needs) written as save_pretrained writes it and in the original layout."""
    from diffusers import AutoencoderKLWan

    from helpers.wan_original_layout import OFFICIAL, write_original_layout

    torch.manual_seed(1)
    handle.pipe.register_modules(vae=AutoencoderKLWan(base_dim=4, z_dim=16).eval())
    diffusers_dir = tmp_path_factory.mktemp("i2v-diffusers")
    handle.pipe.save_pretrained(diffusers_dir)
    orig = write_original_layout(handle.pipe, tmp_path_factory.mktemp("i2v-original"),
                                 OFFICIAL["i2v_transformer"]["config"])
    return diffusers_dir, orig


def test_i2v_original_names_are_the_official_modules(handle):
    from helpers.wan_original_layout import OFFICIAL, original_state, shapes

    state = original_state(handle.pipe)
    assert shapes(state["transformer"]) == OFFICIAL["i2v_transformer"]["keys"]
    assert shapes(state["clip"]) == OFFICIAL["clip_visual"]["keys"]


def test_i2v_original_layout_loads_like_diffusers_format(i2v_dirs, png):
    from PIL import Image

    diffusers_dir, orig = i2v_dirs
    adapter = WanAdapter()
    a = adapter.build(VARIANT, weights=str(diffusers_dir), dtype=torch.float32, device=torch.device("cpu"))
    b = adapter.build(VARIANT, weights=str(orig), dtype=torch.float32, device=torch.device("cpu"))
    assert type(b).__name__ == "WanImageToVideoPipeline"
    for name in ("transformer", "image_encoder", "text_encoder", "vae"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
    call = dict(VARIANT.call_defaults, prompt="a corgi surfing", image=Image.open(png).convert("RGB"), output_type="np")
    fa = a(generator=torch.Generator().manual_seed(0), **call).frames
    fb = b(generator=torch.Generator().manual_seed(0), **call).frames
    assert np.abs(fa).max() > 0 and np.array_equal(fa, fb)
