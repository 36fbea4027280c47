"""HunyuanVideo-1.5: sizes checked against the config before any work, and the preparation
that gives the first block the layout of the others (one compile for the 54 blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from magi_zoo.adapters import lookup
from magi_zoo.adapters.diffusers_pipeline import same_layout_preparation
from magi_zoo.engine.prepare import prepare


@pytest.mark.parametrize("name", ["hunyuanvideo-1.5-tiny", "hunyuanvideo-1.5-480p-t2v"])
def test_sizes_are_checked_against_the_config_before_any_work(name, tmp_path):
    adapter, variant = lookup(name)
    with pytest.raises(ValueError, match="--frames"):  # 1 + 4k: the VAE's temporal factor
        adapter.check_run(variant, {"num_frames": 6}, tmp_path / "v.mp4")
    with pytest.raises(ValueError, match="--height.*16"):  # the VAE's 16x times the 1x1 patch
        adapter.check_run(variant, {"height": 72}, tmp_path / "v.mp4")
    adapter.check_run(variant, {"num_frames": 9, "height": 64, "width": 96}, tmp_path / "v.mp4")


class _Seen(nn.Module):
    def __init__(self):
        super().__init__()
        self.got = []

    def forward(self, hidden_states, encoder_hidden_states=None):
        self.got.append((hidden_states, encoder_hidden_states))
        return hidden_states + 1


def test_first_block_gets_fresh_contiguous_inputs_and_remove_undoes_it():
    blocks = nn.ModuleList([_Seen(), _Seen()])
    x = torch.randn(1, 4, 3).transpose(1, 2)  # a patch embedding's transposed view
    ctx = torch.randn(1, 2, 3)
    rec = prepare(nn.ModuleDict({"blocks": blocks}), [same_layout_preparation(blocks, (0, "hidden_states"), "test")])
    blocks[1](blocks[0](x, encoder_hidden_states=ctx))
    got, enc = blocks[0].got[0]
    assert got.is_contiguous() and got.data_ptr() != x.data_ptr() and torch.equal(got, x)
    assert enc is ctx  # inputs not named are passed as they are
    rec.undo()
    blocks[0](x)
    assert blocks[0].got[1][0] is x


def test_image_to_video_needs_an_image_and_takes_its_size_from_it(tmp_path):
    adapter, variant = lookup("hunyuanvideo-1.5-480p-i2v")
    with pytest.raises(ValueError, match="image-to-video: pass --image"):
        adapter.check_run(variant, {}, tmp_path / "v.mp4")
    img = tmp_path / "in.png"
    from PIL import Image

    Image.new("RGB", (80, 48)).save(img)
    with pytest.raises(ValueError, match="drop --height"):
        adapter.check_run(variant, {"image": str(img), "height": 480}, tmp_path / "v.mp4")
    assert adapter.check_run(variant, {"image": str(img), "num_frames": 9}, tmp_path / "v.mp4")["image"] == str(img)
    t2v, v = lookup("hunyuanvideo-1.5-480p-t2v")
    with pytest.raises(ValueError, match="--image"):
        t2v.check_run(v, {"image": str(img)}, tmp_path / "v.mp4")


def test_image_to_video_runs_at_the_images_aspect(tmp_path):
    """The image-to-video pipeline (SigLIP tokens, the image's VAE latents as the condition) in
    small: the tiny config with the tiny SigLIP; the video takes the image's 5:3 aspect."""
    import dataclasses

    from PIL import Image

    from magi_zoo.adapters.hunyuan_video15 import config as C

    adapter, tiny = lookup("hunyuanvideo-1.5-tiny")
    variant = dataclasses.replace(tiny, name="hunyuanvideo-1.5-i2v-tiny", config=dict(tiny.config,
                                  image_encoder=C.TINY_SIGLIP), call_defaults=dict(num_frames=5, num_inference_steps=1))
    pipe = adapter.build(variant, weights=None, dtype=torch.float32, device=torch.device("cpu"))
    img = tmp_path / "in.png"
    Image.new("RGB", (80, 48), (200, 40, 40)).save(img)

    class Handle:
        def __init__(self):
            self.pipe, self.variant, self.plan = pipe, variant, None  # nothing applied: eager

        def __call__(self, **kw):
            return pipe(**{**variant.call_defaults, **kw})

        def call_defaults(self):
            return dict(variant.call_defaults)

    out = adapter.generate(Handle(), prompt="a red square", progress=False, image=str(img))
    assert out.kind == "video" and len(out.value) == 5 and out.value[0].shape == (48, 80, 3)


def test_guidance_held_by_the_guider_decides_cfg():
    """The guider's scale lives in the variant config (`cfg_config_key`): CFG (and CFG parallel)
    where it is above 1, whatever the call says."""
    import dataclasses

    adapter, variant = lookup("hunyuanvideo-1.5-480p-t2v")
    assert adapter.runs_cfg(dict(variant.call_defaults), variant)
    unguided = dataclasses.replace(variant, config=dict(variant.config, guidance_scale=1.0))
    assert not adapter.runs_cfg(dict(variant.call_defaults, guidance_scale=7.0), unguided)
    assert not adapter.runs_cfg(dict(variant.call_defaults))  # no variant named: no CFG claimed
