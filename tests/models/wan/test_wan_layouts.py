"""Wan2.1 weights in the original release layout load like the diffusers-format directory.

The test writes one tiny random model twice: as `save_pretrained` writes it (diffusers
format) and in the original Wan layout (config.json with WanModel's names,
diffusion_pytorch_model.safetensors, models_t5_umt5-xxl-enc-bf16.pth, Wan2.1_VAE.pth,
google/umt5-xxl/). The original-layout keys come from inverting diffusers' own converters
(tests/helpers/wan_original_layout.py); two checks make sure the inversion is right and not
circular: diffusers' converters map the written keys back to exactly the model's keys,
and the written names and shapes equal those of the official Wan modules at the same tiny
configs (tests/data/wan21_original_keys.json, written from github.com/Wan-Video/Wan2.1 by
benchmarks/oracles/wan_original_layout.py; test_wan_original_values.py checks the T5 / CLIP
maps value by value against the official forwards recorded there).
Then `magi_zoo.load("wan2.1-tiny", weights=DIR)` must give the same video from both.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import magi_zoo
from helpers.wan_original_layout import OFFICIAL, original_state as _original_state, shapes as _shapes, write_original_layout

TINY = "wan2.1-tiny"


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """wan2.1-tiny with the published VAE structure at width 4: diffusers' VAE converter
    hard-codes the published block layout (dim_mult [1, 2, 4, 4], 2 res blocks), and the
    tiny variant's own VAE (1 res block) is not a layout any Wan release has."""
    from diffusers import AutoencoderKLWan

    pipe = magi_zoo.load(TINY, gpu="cpu", compile=False).pipe
    torch.manual_seed(1)
    pipe.register_modules(vae=AutoencoderKLWan(base_dim=4, z_dim=16).eval())
    return pipe


@pytest.fixture(scope="module")
def original_state(reference):
    return _original_state(reference)


@pytest.fixture(scope="module")
def dirs(reference, tmp_path_factory):
    diffusers_dir = tmp_path_factory.mktemp("wan21-diffusers")
    reference.save_pretrained(diffusers_dir)
    orig = write_original_layout(reference, tmp_path_factory.mktemp("wan21-original"), OFFICIAL["transformer"]["config"])
    return diffusers_dir, orig


# -- the inversion is right ---------------------------------------------------------------
def test_written_keys_are_the_official_modules_keys(original_state):
    for part in ("transformer", "vae", "t5"):
        assert _shapes(original_state[part]) == OFFICIAL[part]["keys"], part


def test_diffusers_converters_map_the_written_keys_back(reference, original_state):
    from diffusers.loaders.single_file_utils import (convert_wan_transformer_to_diffusers,
                                                     convert_wan_vae_to_diffusers)

    dit = convert_wan_transformer_to_diffusers(dict(original_state["transformer"]))
    assert dit.keys() == reference.transformer.state_dict().keys()
    assert all(torch.equal(dit[k], v) for k, v in reference.transformer.state_dict().items())
    vae = convert_wan_vae_to_diffusers(dict(original_state["vae"]))
    assert vae.keys() == reference.vae.state_dict().keys()


# -- loading ------------------------------------------------------------------------------
def test_layout_is_detected(dirs, tmp_path):
    from magi_zoo.adapters.wan.original import detect_layout

    diffusers_dir, orig = dirs
    assert (detect_layout(diffusers_dir), detect_layout(orig)) == ("diffusers", "original")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"not a Wan checkpoint directory in a known layout .*weights\.bin.*"
                                         r"model_index\.json.*Wan2\.1_VAE\.pth"):
        magi_zoo.load(TINY, gpu="cpu", weights=str(tmp_path), compile=False)


def test_original_layout_loads_like_diffusers_format(dirs):
    diffusers_dir, orig = dirs
    a = magi_zoo.load(TINY, gpu="cpu", weights=str(diffusers_dir), compile=False)
    b = magi_zoo.load(TINY, gpu="cpu", weights=str(orig), compile=False)
    for name in ("transformer", "text_encoder", "vae"):
        sa, sb = a.modules[name].state_dict(), b.modules[name].state_dict()
        assert sa.keys() == sb.keys(), name
        assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa), name
    call = dict(prompt="a corgi surfing", output_type="np")
    fa = a(generator=torch.Generator().manual_seed(0), **call).frames
    fb = b(generator=torch.Generator().manual_seed(0), **call).frames
    assert np.abs(fa).max() > 0 and np.array_equal(fa, fb)


def test_bf16_load_keeps_diffusers_fp32_modules(dirs):
    """diffusers' from_pretrained keeps `_keep_in_fp32_modules` (norms, time embedder,
    scale_shift_table) in fp32 for a bf16 load; the original-layout load does the same."""
    diffusers_dir, orig = dirs
    a = magi_zoo.load(TINY, gpu="cpu", weights=str(diffusers_dir), dtype="bfloat16", compile=False)
    b = magi_zoo.load(TINY, gpu="cpu", weights=str(orig), dtype="bfloat16", compile=False)
    da = {k: v.dtype for k, v in a.pipe.transformer.state_dict().items()}
    assert da == {k: v.dtype for k, v in b.pipe.transformer.state_dict().items()}
    assert {torch.float32, torch.bfloat16} <= set(da.values())


# -- refusals, each saying why and what to pass instead -------------------------------------
def _copy(orig: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(orig, d)
    return d


def test_missing_component_is_named(dirs, tmp_path):
    d = _copy(dirs[1], tmp_path)
    (d / "models_t5_umt5-xxl-enc-bf16.pth").unlink()
    with pytest.raises(ValueError, match=r"original Wan layout but lacks models_t5_umt5-xxl-enc-bf16\.pth"):
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)


def test_checkpoint_of_another_task_is_refused_with_the_reason(dirs, tmp_path):
    d = _copy(dirs[1], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="i2v", in_dim=36)))
    with pytest.raises(ValueError, match=r"holds an image-to-video checkpoint .* but wan2\.1-tiny is text-to-video; "
                                         r"load it with an image-to-video variant"):
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="flf2v", in_dim=36)))
    with pytest.raises(ValueError, match=r"model_type='flf2v'.*FLF2V and VACE have no diffusers pipeline here"):
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)


def test_config_that_does_not_fit_the_weights_names_the_tensor(dirs, tmp_path):
    d = _copy(dirs[1], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, ffn_dim=128)))
    with pytest.raises(ValueError, match=r"tensor 'blocks\.0\.ffn\.0\.weight' has shape \(64, 32\) but the model "
                                         r"expects \(128, 32\)"):
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)


def test_wan22_original_layout_is_refused(dirs, tmp_path):
    (tmp_path / "a14b" / "high_noise_model").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"Wan2\.2 A14B checkpoint in the original layout.*-Diffusers"):
        magi_zoo.load("wan2.2-tiny", gpu="cpu", weights=str(tmp_path / "a14b"), compile=False)
    d = _copy(dirs[1], tmp_path)  # TI2V-5B: one DiT, config.json model_type "ti2v", Wan2.2_VAE.pth
    (d / "Wan2.1_VAE.pth").rename(d / "Wan2.2_VAE.pth")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="ti2v", in_dim=48, out_dim=48)))
    with pytest.raises(ValueError, match=r"model_type='ti2v' \(Wan2\.2-TI2V-5B\).*Wan2\.2-TI2V-5B-Diffusers"):
        magi_zoo.load("wan2.2-ti2v-tiny", gpu="cpu", weights=str(d), compile=False)


# -- the 720p I2V variant -----------------------------------------------------------------------
def test_i2v_720p_is_the_published_config():
    """wan2.1-i2v-14b-720p: the I2V-14B architecture (as 480p), WanImageToVideoPipeline with the
    CLIP-H image encoder, flow shift 5.0, 720x1280 x 81 frames, 40 steps (Wan's generate.py).
    Built on the meta device: the real module tree, no memory."""
    import torch.nn as nn

    from magi_zoo import adapters
    from magi_zoo.engine.resolve import resolve
    from magi_zoo.overrides import spec_layers

    adapter, variant = adapters.lookup("wan2.1-i2v-14b-720p")
    _, p480 = adapters.lookup("wan2.1-i2v-14b-480p")
    assert variant.hub_id == "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"
    assert variant.config["transformer"] == p480.config["transformer"]
    assert (variant.config["scheduler"]["flow_shift"], p480.config["scheduler"]["flow_shift"]) == (5.0, 3.0)
    assert {k: variant.call_defaults[k] for k in ("height", "width", "num_frames", "num_inference_steps",
                                                  "guidance_scale")} == dict(height=720, width=1280, num_frames=81,
                                                                             num_inference_steps=40, guidance_scale=5.0)
    pipe = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and pipe.scheduler.config.flow_shift == 5.0
    t = pipe.transformer.config
    assert (t.num_attention_heads * t.attention_head_dim, t.num_layers, t.in_channels, t.image_dim) == (5120, 40, 36, 1280)
    kw = adapter.denoiser_inputs(pipe, variant)
    # 81 frames -> 21 latent frames; 720/8 = 90, 1280/8 = 160; 36 = 16 noise + 4 mask + 16 image latents
    assert kw["hidden_states"].shape == (1, 36, 21, 90, 160) and kw["encoder_hidden_states_image"].shape == (1, 257, 1280)
    with torch.no_grad():
        assert adapter.denoiser(pipe)(**kw)[0].shape == (1, 16, 21, 90, 160)
    regions = resolve(nn.ModuleDict(adapter.components(pipe)), spec_layers(adapter, magi_zoo.get_profile("h100"))).regions()
    assert len(regions[("WanTransformerBlock", "forward")]) == 40  # one region over all 40 blocks


def test_transformer_from_a_state_dict(reference, original_state):
    """A DiT held in a dict (a training checkpoint), original names with the
    `model.diffusion_model.` prefix some trainers write: the same model as the directory load."""
    from magi_zoo.adapters.wan.original import transformer_from_state_dict

    sd = {"model.diffusion_model." + k: v for k, v in original_state["transformer"].items()}
    model = transformer_from_state_dict(sd, OFFICIAL["transformer"]["config"], dtype=torch.float32)
    want = reference.transformer.state_dict()
    assert model.state_dict().keys() == want.keys() and all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) the model needs are not in the file \(first: 'proj_out\.bias'\)"):
        transformer_from_state_dict({k: v for k, v in sd.items() if not k.endswith("head.head.bias")},
                                    OFFICIAL["transformer"]["config"], dtype=torch.float32)


def test_sharded_dit_loads(reference, original_state, tmp_path):
    """14B checkpoints ship the DiT in shards (diffusion_pytorch_model-0000N-of-0000M.safetensors
    + an index): every shard is read."""
    from safetensors.torch import save_file

    from magi_zoo.adapters.wan.original import load_transformer

    items = sorted(original_state["transformer"].items())
    half = len(items) // 2
    for i, part in enumerate((items[:half], items[half:]), 1):
        save_file({k: v.contiguous() for k, v in part}, str(tmp_path / f"diffusion_pytorch_model-0000{i}-of-00002.safetensors"))
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f"diffusion_pytorch_model-0000{1 + (j >= half)}-of-00002.safetensors" for j, (k, _) in enumerate(items)}}))
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL["transformer"]["config"]))
    model = load_transformer(tmp_path, dtype=torch.float32)
    want = reference.transformer.state_dict()
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


# -- layout mismatches: each a clear error naming the file and what it holds ---------------------
def _no_house_advice(e) -> str:
    """The error of a load from an original-layout directory: its advice is about that layout
    (not about directories save_pretrained writes) and it carries no terminal colour codes."""
    msg = str(e.value)
    assert "\x1b" not in msg and "saved by save_pretrained" not in msg, msg
    return msg


def test_i2v_config_beside_a_t2v_dit_names_the_file(dirs, tmp_path):
    """config.json says image-to-video, the DiT file beside it has no image tensors (a
    text-to-video DiT, or the wrong file): the file and what it holds are named."""
    from magi_zoo.adapters.wan.original import load_transformer, transformer_from_state_dict

    d = _copy(dirs[1], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="i2v", in_dim=36)))
    with pytest.raises(ValueError, match=r"config\.json says model_type='i2v' .*diffusion_pytorch_model\.safetensors"
                                         r".* holds a text-to-video DiT \(no img_emb\.\* or k_img tensors\)"):
        load_transformer(d, dtype=torch.float32)
    # the mirror case: a text-to-video config.json beside an image-to-video DiT
    from safetensors.torch import load_file

    sd = load_file(str(d / "diffusion_pytorch_model.safetensors"))
    sd["img_emb.proj.0.weight"] = torch.ones(1280)
    with pytest.raises(ValueError, match=r"config\.json says model_type='t2v' .* holds an image-to-video DiT"):
        transformer_from_state_dict(sd, cfg, dtype=torch.float32)


def test_t5_file_with_transformers_names_says_so(reference, dirs, tmp_path):
    d = _copy(dirs[1], tmp_path)
    torch.save(reference.text_encoder.state_dict(), d / "models_t5_umt5-xxl-enc-bf16.pth")
    with pytest.raises(ValueError) as e:
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)
    msg = _no_house_advice(e)
    assert "models_t5_umt5-xxl-enc-bf16.pth" in msg and "transformers' UMT5EncoderModel names" in msg, msg
    assert "not in the file" not in msg and "'blocks.0.attn.q.weight'" in msg, msg


def test_other_components_with_library_names_say_so(reference, dirs, tmp_path):
    """The same rule for the VAE (diffusers' names) and the DiT (diffusers' names)."""
    from safetensors.torch import save_file

    d = _copy(dirs[1], tmp_path)
    torch.save(reference.vae.state_dict(), d / "Wan2.1_VAE.pth")
    with pytest.raises(ValueError) as e:
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)
    assert "Wan2.1_VAE.pth" in _no_house_advice(e) and "diffusers' AutoencoderKLWan names" in str(e.value)
    d = _copy(dirs[1], tmp_path / "dit")
    save_file({k: v.contiguous() for k, v in reference.transformer.state_dict().items()},
              str(d / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ValueError) as e:
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)
    assert "diffusers' WanTransformer3DModel names" in _no_house_advice(e), str(e.value)


def test_layout_errors_end_with_advice_for_the_original_layout(dirs, tmp_path):
    d = _copy(dirs[1], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, ffn_dim=128)))
    with pytest.raises(ValueError) as e:
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)
    assert "Wan-AI Wan2.1 repository" in _no_house_advice(e)


def test_unpickling_error_has_no_colour_codes(dirs, tmp_path):
    """A pickle holding objects torch.load(weights_only=True) refuses (a path object here)."""
    from pathlib import PurePosixPath

    d = _copy(dirs[1], tmp_path)
    torch.save({"a": PurePosixPath("x")}, d / "models_t5_umt5-xxl-enc-bf16.pth")
    with pytest.raises(ValueError) as e:
        magi_zoo.load(TINY, gpu="cpu", weights=str(d), compile=False)
    msg = _no_house_advice(e)
    assert "models_t5_umt5-xxl-enc-bf16.pth" in msg and "objects other than tensors" in msg, msg
