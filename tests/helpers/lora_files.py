"""Tiny LoRA files in the key layouts published LoRAs use, for a Wan transformer of `dim`
width, `ffn` FFN width and `blocks` blocks (wan2.1-tiny: 32, 64, 4).

Layouts (names as diffusers' `lora_conversion_utils` reads them):
- diffusers / peft: ``transformer.blocks.N.attn1.to_q.lora_A.weight`` / ``lora_B``;
- Kohya / musubi-tuner: ``lora_unet_blocks_N_self_attn_q.lora_down.weight`` / ``lora_up`` /
  ``.alpha``, every projection of every block (the converter reads them all);
- original Wan, as LightX2V's step-distill LoRAs ship
  (Wan21_I2V_14B_lightx2v_cfg_step_distill_lora_rank64.safetensors and the Wan2.2 ones):
  ``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` / ``lora_up`` with ``diff_b`` (a
  bias delta), ``alpha``, per-block ``diff_m`` (modulation) and norm ``diff`` entries, the I2V
  image projections ``cross_attn.k_img`` / ``v_img`` and the ``head.head`` projection.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

ATTN = ("q", "k", "v", "o")
DIFFUSERS_ATTN = ("to_q", "to_k", "to_v", "to_out.0")


def _pair(g, r, out_f, in_f, std=0.1):
    return torch.randn(r, in_f, generator=g) * std, torch.randn(out_f, r, generator=g) * std


def diffusers_lora(path, *, dim=32, blocks=4, rank=4, seed=0, attn=("attn1",)):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(blocks):
        for a in attn:
            for o in DIFFUSERS_ATTN:
                sd[f"transformer.blocks.{i}.{a}.{o}.lora_A.weight"], sd[f"transformer.blocks.{i}.{a}.{o}.lora_B.weight"] = \
                    _pair(g, rank, dim, dim)
    save_file(sd, str(path))
    return path


def kohya_lora(path, *, dim=32, ffn=64, blocks=4, rank=4, alpha=2.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    sd = {}

    def put(name, out_f, in_f):
        sd[f"lora_unet_{name}.lora_down.weight"], sd[f"lora_unet_{name}.lora_up.weight"] = _pair(g, rank, out_f, in_f)
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)

    for i in range(blocks):
        for attn in ("self_attn", "cross_attn"):
            for o in ATTN:
                put(f"blocks_{i}_{attn}_{o}", dim, dim)
        put(f"blocks_{i}_ffn_0", ffn, dim)
        put(f"blocks_{i}_ffn_2", dim, ffn)
    save_file(sd, str(path))
    return path


def original_wan_lora(path, *, dim=32, ffn=64, blocks=4, rank=4, seed=2, i2v=False, out_dim=64, alpha=None,
                      modulation=0.0):
    """LightX2V's distill-LoRA layout (original Wan names). `alpha`: add ``.alpha`` entries
    (rank-relative scaling) to the self-attention projections; `modulation`: the std of the
    blocks' ``diff_m`` modulation deltas (0: zeros)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    p = "diffusion_model."

    def put(name, out_f, in_f):
        sd[f"{p}{name}.lora_down.weight"], sd[f"{p}{name}.lora_up.weight"] = _pair(g, rank, out_f, in_f)
        sd[f"{p}{name}.diff_b"] = torch.randn(out_f, generator=g) * 0.05

    for i in range(blocks):
        for o in ATTN:
            put(f"blocks.{i}.self_attn.{o}", dim, dim)
            if alpha is not None:
                sd[f"{p}blocks.{i}.self_attn.{o}.alpha"] = torch.tensor(float(alpha))
            put(f"blocks.{i}.cross_attn.{o}", dim, dim)
        if i2v:
            put(f"blocks.{i}.cross_attn.k_img", dim, dim)
            put(f"blocks.{i}.cross_attn.v_img", dim, dim)
        put(f"blocks.{i}.ffn.0", ffn, dim)
        put(f"blocks.{i}.ffn.2", dim, ffn)
        sd[f"{p}blocks.{i}.diff_m"] = torch.randn(1, 6, dim, generator=g) * modulation  # diffusers skips it
        sd[f"{p}blocks.{i}.norm3.diff"] = torch.zeros(dim)  # norm deltas: zeros in the published files
        sd[f"{p}blocks.{i}.norm3.diff_b"] = torch.zeros(dim)
    put("head.head", out_dim, dim)
    save_file(sd, str(path))
    return path


def flux_lora(path, *, kohya=False, rank=4, seed=3):
    """A Flux LoRA (another family): diffusers names, or Kohya's ``lora_unet_double_blocks_*``."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    if kohya:
        sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"], \
            sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"] = _pair(g, rank, 96, 32)
        sd["lora_unet_double_blocks_0_img_attn_qkv.alpha"] = torch.tensor(4.0)
    else:
        sd["transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight"], \
            sd["transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight"] = _pair(g, rank, 32, 32)
    save_file(sd, str(path))
    return path
