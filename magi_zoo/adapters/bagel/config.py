"""BAGEL configurations: the published BAGEL-7B-MoT sizes and a tiny offline variant.

One dict per component: `llm` (transformers `Qwen2Config` kwargs), `vit` (`SiglipVisionConfig`
kwargs, with the number of layers BAGEL *uses*), `vae` (diffusers `AutoencoderKL` kwargs for
the FLUX.1 autoencoder), plus the BAGEL-specific glue sizes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Qwen2.5-7B-Instruct, the base LLM of BAGEL-7B-MoT. BAGEL forces qk_norm=True and
# tie_word_embeddings=False on top of the shipped llm_config.json.
LLM_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              hidden_act="silu", max_position_embeddings=32768, tie_word_embeddings=False)

# SigLIP so400m/14 (vit_config.json: 27 layers, image 980). BAGEL drops the last layer
# (`num_hidden_layers -= 1`), so 26 layers exist in the checkpoint and run.
VIT_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
                  patch_size=14, image_size=980, num_channels=3, hidden_act="gelu_pytorch_tanh",
                  layer_norm_eps=1e-6)

# FLUX.1 autoencoder (z=16, 8x down) as diffusers' AutoencoderKL: no quant convs.
VAE_FLUX = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, norm_num_groups=32,
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                use_quant_conv=False, use_post_quant_conv=False,
                scaling_factor=0.3611, shift_factor=0.1159)

# BAGEL glue. latent_patch_size 2 over a 16-channel, 8x-down latent -> one 64-d token per
# 16x16 pixels. max_latent_size 64 is the release value (latent_pos_embed has 64*64 rows),
# not BagelConfig's default of 32. The ViT position table is 70x70 (980/14).
GLUE_7B = dict(latent_patch_size=2, max_latent_size=64, vit_max_num_patch_per_side=70,
               # ImageTransform(1024, 512, 16): the VAE side keeps ImageTransform's default pixel cap.
               vae_image=dict(max_size=1024, min_size=512, stride=16, max_pixels=14 * 14 * 9 * 1024),
               vit_image=dict(max_size=980, min_size=224, stride=14, max_pixels=14 * 14 * 9 * 1024))

# Qwen2.5 ids of the special tokens BAGEL uses (bos/eos/start/end of image).
QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                    "<|vision_start|>": 151652, "<|vision_end|>": 151653}

TINY = dict(
    llm=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, rope_theta=1_000_000.0, rms_norm_eps=1e-6, hidden_act="silu",
             max_position_embeddings=1024, tie_word_embeddings=False),
    vit=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
             image_size=112, num_channels=3, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
    # 4 blocks = 8x down like FLUX; channel changes (32 -> 64) so shortcut convs exist.
    vae=dict(VAE_FLUX, block_out_channels=[32, 64, 64, 64], layers_per_block=1),
    latent_patch_size=2, max_latent_size=8, vit_max_num_patch_per_side=8,
    vae_image=dict(max_size=64, min_size=32, stride=16, max_pixels=14 * 14 * 9 * 1024),
    vit_image=dict(max_size=112, min_size=28, stride=14, max_pixels=112 * 112),
    # The tiny tokenizer pins the Qwen-style specials just above its 400-token BPE vocab.
    special_ids={"<|endoftext|>": 500, "<|im_start|>": 501, "<|im_end|>": 502,
                 "<|vision_start|>": 503, "<|vision_end|>": 504},
    tokenizer_vocab=400,
)

BAGEL_7B_MOT = dict(llm=LLM_7B, vit=VIT_SO400M, vae=VAE_FLUX, special_ids=QWEN_SPECIAL_IDS,
                    tokenizer_vocab=4096, **GLUE_7B)

# Text-to-image, the official demo's settings (app.py text_to_image and its sliders). The app
# passes no image guidance, so the inferencer's gen_image default 1.5 applies (the notebook
# passes 1.0; pass cfg_img_scale=1.0 for its images): with no input image the no-image context
# is the full one, so 1.5 is a third model evaluation per guided step.
# max_new_tokens: the answer budget of understanding (the demo's 512); max_think_tokens: the
# reasoning budget before an image in think mode (the demo's 1024).
T2I_DEFAULTS = dict(num_inference_steps=50, timestep_shift=3.0, cfg_text_scale=4.0, cfg_img_scale=1.5,
                    cfg_interval=(0.4, 1.0), cfg_renorm_type="global", cfg_renorm_min=0.0,
                    height=1024, width=1024, max_new_tokens=512, max_think_tokens=1024)

# Image editing, the official demo's settings (app.py edit_image): image guidance 2.0 over
# the whole schedule (interval start 0.0) with per-token renorm of the text-guided velocity.
# The output has the size of the input image after the VAE-side resize.
EDIT_DEFAULTS = dict(num_inference_steps=50, timestep_shift=3.0, cfg_text_scale=4.0, cfg_img_scale=2.0,
                     cfg_interval=(0.0, 1.0), cfg_renorm_type="text_channel", cfg_renorm_min=0.0)


def head_dim(llm: dict[str, Any]) -> int:
    """Qwen2 computes head_dim as hidden / heads (128 for the 7B)."""
    return llm["hidden_size"] // llm["num_attention_heads"]


_LLM_CHECK = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size")
_VIT_CHECK = ("hidden_size", "intermediate_size", "num_attention_heads", "patch_size")


def config_from_dir(path: str | Path, expected: dict[str, Any]) -> dict[str, Any]:
    """Read `llm_config.json` / `vit_config.json` of an official checkpoint directory and
    return the variant config with their values; sizes that disagree with `expected` are an
    error naming the field (a wrong variant for the weights)."""
    path = Path(path)
    cfg = dict(expected)
    for fname, key, check in (("llm_config.json", "llm", _LLM_CHECK), ("vit_config.json", "vit", _VIT_CHECK)):
        f = path / fname
        if not f.is_file():
            raise FileNotFoundError(f"{path} is not a BAGEL checkpoint directory: {fname} is missing "
                                    "(expected llm_config.json, vit_config.json, ema.safetensors, ae.safetensors)")
        data = json.loads(f.read_text())
        data = data.get("vision_config", data) if key == "vit" else data
        bad = {k: (data.get(k), expected[key][k]) for k in check if k in data and data[k] != expected[key][k]}
        if bad:
            raise ValueError(f"{f}: sizes {bad} (file, variant) do not match the variant; pick the variant "
                             "that matches these weights")
        sub = dict(expected[key])
        if key == "vit" and "num_hidden_layers" in data:
            # BAGEL uses all but the last SigLIP layer (vit_select_layer = -2).
            sub["num_hidden_layers"] = int(data["num_hidden_layers"]) - 1
        if key == "llm":
            for k in ("rope_theta", "rms_norm_eps", "max_position_embeddings"):
                if k in data:
                    sub[k] = data[k]
        cfg[key] = sub
    return cfg
