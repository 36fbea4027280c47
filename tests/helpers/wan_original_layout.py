"""Test helper: write a diffusers Wan pipeline in the original Wan release layout.

The names come from inverting diffusers' own single-file converters (DiT, VAE) and
magi_zoo's UMT5 / CLIP maps; tests/test_wan_layouts.py and tests/test_wan_i2v.py check the
result against the official modules' key names and shapes (tests/data/wan21_original_keys.json)
and that diffusers' converters map it back, so the inversion is not taken on trust.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

OFFICIAL = json.loads(((Path(__file__).resolve().parents[1] / "data") / "wan21_original_keys.json").read_text())

_DIT_BACK = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    # I2V: the CLIP-token MLP (LayerNorm, Linear, GELU, Linear, LayerNorm) and the image K/V.
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
    ("attn1.", "self_attn."), ("attn2.", "cross_attn."),
    (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."), (".to_out.0.", ".o."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), ("proj_out", "head.head"),
]


def dit_back(key: str) -> str:
    for new, old in _DIT_BACK:
        key = key.replace(new, old)
    if key == "scale_shift_table":
        return "head.modulation"
    key = key.replace(".scale_shift_table", ".modulation")
    # diffusers' norm2 (the affine cross-attention norm) is the original norm3, and back.
    return re.sub(r"^(blocks\.\d+)\.norm([23])\.", lambda m: f"{m.group(1)}.norm{5 - int(m.group(2))}.", key)


_RES_BACK = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
             "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
             "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}


def vae_back(key: str) -> str:
    head, rest = key.split(".", 1)
    if head in ("quant_conv", "post_quant_conv"):
        return {"quant_conv": "conv1", "post_quant_conv": "conv2"}[head] + "." + rest
    p = rest.split(".")
    if p[0] in ("conv_in", "norm_out", "conv_out"):
        return f"{head}." + {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}[p[0]] + "." + p[1]
    if p[0] == "mid_block":  # middle = [resnet, attention, resnet]
        leaf = ".".join(p[3:])
        return f"{head}.middle.1.{leaf}" if p[1] == "attentions" else f"{head}.middle.{2 * int(p[2])}.{_RES_BACK[leaf]}"
    if p[0] == "down_blocks":
        leaf = ".".join(p[2:])
        return f"{head}.downsamples.{p[1]}.{_RES_BACK.get(leaf, leaf)}"
    b = int(p[1])  # up_blocks: 3 resnets + 1 upsampler per block, one flat list in the original
    if p[2] == "resnets":
        return f"{head}.upsamples.{4 * b + int(p[3])}.{_RES_BACK['.'.join(p[4:])]}"
    assert p[2] == "upsamplers", key
    return f"{head}.upsamples.{4 * b + 3}." + ".".join(p[4:])


_T5_BACK = {"layer.0.layer_norm.weight": "norm1.weight", "layer.0.SelfAttention.q.weight": "attn.q.weight",
            "layer.0.SelfAttention.k.weight": "attn.k.weight", "layer.0.SelfAttention.v.weight": "attn.v.weight",
            "layer.0.SelfAttention.o.weight": "attn.o.weight",
            "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
            "layer.1.layer_norm.weight": "norm2.weight", "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",
            "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight", "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight"}


def t5_back(sd: dict) -> dict:
    out = {"token_embedding.weight": sd["shared.weight"], "norm.weight": sd["encoder.final_layer_norm.weight"]}
    for k, v in sd.items():
        m = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", k)
        if m:
            out[f"blocks.{m.group(1)}.{_T5_BACK[m.group(2)]}"] = v
    return out


_CLIP_BACK = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
              "mlp.fc1": "mlp.0", "mlp.fc2": "mlp.2"}


def clip_back(sd: dict, out_dim: int = 1024) -> dict:
    """CLIPVisionModel state -> Wan's open-clip `visual.*` (q / k / v fused into to_qkv), plus
    the projection `head` the official module has (unused by I2V: random here)."""
    sd = {k.removeprefix("vision_model."): v for k, v in sd.items()}
    e = "embeddings."
    out = {"visual.patch_embedding.weight": sd[e + "patch_embedding.weight"],
           "visual.cls_embedding": sd[e + "class_embedding"].reshape(1, 1, -1),
           "visual.pos_embedding": sd[e + "position_embedding.weight"][None]}
    for name, new in (("pre_layrnorm", "pre_norm"), ("post_layernorm", "post_norm")):
        for leaf in ("weight", "bias"):
            out[f"visual.{new}.{leaf}"] = sd[f"{name}.{leaf}"]
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.layers.")})
    for i in layers:
        p = f"encoder.layers.{i}."
        for leaf in ("weight", "bias"):
            out[f"visual.transformer.{i}.attn.to_qkv.{leaf}"] = torch.cat(
                [sd[f"{p}self_attn.{x}_proj.{leaf}"] for x in "qkv"])
            for mine, theirs in _CLIP_BACK.items():
                out[f"visual.transformer.{i}.{theirs}.{leaf}"] = sd[f"{p}{mine}.{leaf}"]
    dim = out["visual.pos_embedding"].shape[-1]
    out["visual.head"] = torch.randn(dim, out_dim, generator=torch.Generator().manual_seed(0))
    return out


def original_state(pipe) -> dict[str, dict]:
    """Every component's state dict in the original names."""
    state = {"transformer": {dit_back(k): v for k, v in pipe.transformer.state_dict().items()},
             "vae": {vae_back(k): v for k, v in pipe.vae.state_dict().items()},
             "t5": t5_back(pipe.text_encoder.state_dict())}
    if getattr(pipe, "image_encoder", None) is not None:
        state["clip"] = clip_back(pipe.image_encoder.state_dict())
    return state


def write_original_layout(pipe, path: Path, config: dict) -> Path:
    """The pipeline in the original layout under `path`; `config` is WanModel's config.json."""
    path.mkdir(parents=True, exist_ok=True)
    state = original_state(pipe)
    save_file({k: v.contiguous() for k, v in state["transformer"].items()},
              str(path / "diffusion_pytorch_model.safetensors"))
    torch.save(state["vae"], path / "Wan2.1_VAE.pth")
    torch.save(state["t5"], path / "models_t5_umt5-xxl-enc-bf16.pth")
    if "clip" in state:
        torch.save(state["clip"], path / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
    # WanModel's config.json as the official `save_config` writes it (no text_dim /
    # patch_size / qk_norm / cross_attn_norm: WanModel's ignore_for_config).
    (path / "config.json").write_text(json.dumps({"_class_name": "WanModel", "_diffusers_version": "0.30.0", **config}))
    pipe.tokenizer.save_pretrained(path / "google" / "umt5-xxl")
    return path


def shapes(sd: dict) -> dict:
    return {k: list(v.shape) for k, v in sd.items()}
