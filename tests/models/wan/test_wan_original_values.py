"""Wan's original-layout files load to the official modules' outputs, value for value.

tests/data/wan21_original_keys.json holds, besides the official modules' key names and shapes,
the forwards of the official `T5Encoder` and CLIP `VisionTransformer` (github.com/Wan-Video/Wan2.1,
the commit in the file) at tiny configs on seeded weights and inputs, and those of its T2V
`WanModel` and `WanVAE_` (loaded here through diffusers' single-file converters), written by
benchmarks/oracles/wan_original_layout.py. Here the same weights (`seeded_state`, rebuilt from
the recorded names and shapes, no official code needed) are saved as the original-layout `.pth`
files and loaded through our key maps (`original_keys.t5_key`, `clip_vision_key_names`) into
transformers' UMT5EncoderModel / CLIPVisionModel at the shipped tiny configs; their outputs
must equal the official ones. A name-only check passes when two same-shape tensors trade
places (q / k / v / o, wi_0 / wi_1); this one fails, as the swap tests show.
"""

import math

import pytest
import torch

from benchmarks.oracles.wan_original_layout import checksum, seeded_inputs, seeded_state
from helpers.wan_original_layout import OFFICIAL
from magi_zoo.adapters.wan import config as wan
from magi_zoo.adapters.wan import original, original_keys

T5, CLIP, DIT, VAE = OFFICIAL["t5"], OFFICIAL["clip_visual"], OFFICIAL["transformer"], OFFICIAL["vae"]
RTOL = 1e-5  # fp32, CPU, the same operations in another order


def _weights(keys: dict, recorded: float) -> dict[str, torch.Tensor]:
    w = seeded_state(keys)
    assert math.isclose(checksum(w), recorded, rel_tol=1e-9), (
        "this torch draws other random numbers than the one that wrote tests/data/wan21_original_keys.json: "
        "regenerate it with benchmarks/oracles/wan_original_layout.py (docs/testing.md)")
    return w


@pytest.fixture(scope="module")
def t5_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("wan-t5") / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save(_weights(T5["keys"], T5["values"]["weights_checksum"]), f)
    return f


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("wan-clip") / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    torch.save(_weights(CLIP["keys"], CLIP["values"]["weights_checksum"]), f)
    return f


def _t5_error(t5_file) -> float:
    enc = original.load_text_encoder(t5_file, wan.TINY["text_encoder"], dtype=torch.float32)
    ids, mask = torch.tensor(T5["values"]["ids"]), torch.tensor(T5["values"]["mask"])
    with torch.no_grad():
        got = enc(input_ids=ids, attention_mask=mask).last_hidden_state
    want = torch.tensor(T5["values"]["output"])
    return float((got - want).norm() / want.norm())


def _clip_error(clip_file) -> float:
    enc = original.load_image_encoder(clip_file, wan.TINY_I2V["image_encoder"], dtype=torch.float32)
    image = seeded_inputs()["clip_image"]
    with torch.no_grad():
        # what diffusers' Wan I2V pipeline reads: the output before the last block, Wan's use_31_block
        got = enc(pixel_values=image, output_hidden_states=True).hidden_states[-2]
    v = CLIP["values"]
    assert list(got.shape) == v["shape"]
    a, b = v["stride"]
    want = torch.tensor(v["output"])
    return float((got[0, ::a, ::b] - want).norm() / want.norm())


def test_the_tiny_configs_are_the_recorded_official_ones():
    """The shipped tiny configs are the official modules' configs the file was written at."""
    t, o = wan.TINY["text_encoder"], T5["config"]
    assert (t["vocab_size"], t["d_model"], t["d_kv"] * t["num_heads"], t["d_ff"], t["num_heads"], t["num_layers"],
            t["relative_attention_num_buckets"]) == (o["vocab"], o["dim"], o["dim_attn"], o["dim_ffn"], o["num_heads"],
                                                     o["num_layers"], o["num_buckets"])
    c, o = wan.TINY_I2V["image_encoder"], CLIP["config"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_hidden_layers"], c["image_size"],
            c["patch_size"], c["hidden_act"]) == (o["dim"], int(o["dim"] * o["mlp_ratio"]), o["num_heads"],
                                                  o["num_layers"], o["image_size"], o["patch_size"], o["activation"])
    assert math.isclose(checksum({"i": seeded_inputs()["clip_image"]}), CLIP["values"]["inputs_checksum"], rel_tol=1e-9)


def test_t5_loads_to_the_official_output(t5_file):
    assert _t5_error(t5_file) < RTOL


def test_clip_loads_to_the_official_output(clip_file):
    assert _clip_error(clip_file) < RTOL


@pytest.mark.parametrize("a,b", [("attn.q.weight", "attn.k.weight"), ("attn.v.weight", "attn.o.weight"),
                                 ("ffn.gate.0.weight", "ffn.fc1.weight")])
def test_a_t5_map_with_two_same_shape_tensors_swapped_fails(t5_file, monkeypatch, a, b):
    block = original_keys._T5_BLOCK
    monkeypatch.setitem(block, a, _T5_NAMES[b])
    monkeypatch.setitem(block, b, _T5_NAMES[a])
    assert _t5_error(t5_file) > 1e-2


_T5_NAMES = dict(original_keys._T5_BLOCK)  # the map as shipped, before any test swaps two entries


@pytest.mark.parametrize("a,b", [("q_proj", "k_proj"), ("k_proj", "v_proj")])
def test_a_clip_map_with_q_k_v_swapped_fails(clip_file, monkeypatch, a, b):
    real = original.clip_vision_key_names

    def swapped(keys):
        names = real(keys)
        for k in [k for k in names if f"self_attn.{a}." in k]:
            other = k.replace(f".{a}.", f".{b}.")
            names[k], names[other] = names[other], names[k]
        return names

    monkeypatch.setattr(original, "clip_vision_key_names", swapped)
    assert _clip_error(clip_file) > 1e-2


def test_dit_loads_to_the_official_output():
    w = _weights(DIT["keys"], DIT["values"]["weights_checksum"])
    model = original.transformer_from_state_dict(w, DIT["config"], dtype=torch.float32)
    x = seeded_inputs()
    with torch.no_grad():
        got = model(hidden_states=x["dit_x"][None], timestep=torch.tensor(DIT["values"]["t"]),
                    encoder_hidden_states=x["dit_context"][None], return_dict=False)[0][0]
    want = torch.tensor(DIT["values"]["output"]).reshape(DIT["values"]["shape"])
    assert float((got - want).norm() / want.norm()) < RTOL


def test_vae_loads_to_the_official_output(tmp_path):
    f = tmp_path / "Wan2.1_VAE.pth"
    torch.save(_weights(VAE["keys"], VAE["values"]["weights_checksum"]), f)
    vae = original.load_vae(f)
    v = VAE["values"]
    with torch.no_grad():
        mu = vae.encode(seeded_inputs()["vae_video"]).latent_dist.mean
        video = vae.decode(mu).sample
    for got, name in ((mu, "latent"), (video, "decoded")):
        want = torch.tensor(v[name]).reshape(v[f"{name}_shape"])
        assert float((got - want).norm() / want.norm()) < RTOL, name
