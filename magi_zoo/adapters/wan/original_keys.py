"""The key maps no library ships for Wan's original-layout checkpoints: Wan's T5 module onto
transformers' UMT5EncoderModel, Wan's open-clip vision tower onto transformers'
CLIPVisionModel (what `original.py` loads; its docstring says how they were checked).
"""

from __future__ import annotations

from typing import Any


# Wan's T5 (wan/modules/t5.py: T5Encoder with shared_pos=False) -> transformers' UMT5EncoderModel.
# No library ships this mapping (see the module docstring); each entry is one module renamed.
_T5_BLOCK = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",  # the GELU-gated branch
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",  # the linear branch
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}


def t5_key(key: str) -> list[str]:
    """The UMT5EncoderModel key(s) of one key of Wan's T5 encoder (the token embedding is
    both `shared` and `encoder.embed_tokens`, one tied tensor); [] for an unknown key."""
    if key == "token_embedding.weight":
        return ["shared.weight", "encoder.embed_tokens.weight"]
    if key == "norm.weight":
        return ["encoder.final_layer_norm.weight"]
    parts = key.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in _T5_BLOCK:
        return [f"encoder.block.{parts[1]}.{_T5_BLOCK[parts[2]]}"]
    return []



# Wan's open-clip XLM-RoBERTa ViT-H/14 (wan/modules/clip.py) -> transformers' CLIPVisionModel,
# the image encoder of diffusers' WanImageToVideoPipeline. Only the vision tower (`visual.*`)
# is used by I2V; the text tower (`textual.*`) and `log_scale` are left out on purpose. Wan
# takes the output of the first 31 of 32 blocks (`use_31_block=True`), which is
# CLIPVisionModel's `hidden_states[-2]`, what the pipeline reads. No library ships this map.
_CLIP_LAYER = {
    "norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
    "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2",
}


def clip_vision_key_names(original_keys: list[str]) -> dict[str, Any]:
    """CLIPVisionModel key -> original key, or (original key, transform) where the layouts
    differ: the fused `to_qkv` splits into q / k / v (rows in that order: WanModel views its
    output as (..., 3, heads, head_dim)); the class and position embeddings drop their
    leading batch axes."""
    out: dict[str, Any] = {}
    for k in original_keys:
        if not k.startswith("visual."):
            continue
        rest = k[len("visual."):]
        if rest == "patch_embedding.weight":
            out["vision_model.embeddings.patch_embedding.weight"] = k
        elif rest == "cls_embedding":
            out["vision_model.embeddings.class_embedding"] = (k, lambda t: t.reshape(-1))
        elif rest == "pos_embedding":
            out["vision_model.embeddings.position_embedding.weight"] = (k, lambda t: t.reshape(t.shape[-2:]))
        elif rest.startswith(("pre_norm.", "post_norm.")):
            name, leaf = rest.split(".")
            out[f"vision_model.{'pre_layrnorm' if name == 'pre_norm' else 'post_layernorm'}.{leaf}"] = k
        elif rest.startswith("transformer."):
            _, i, sub = rest.split(".", 2)
            mod, leaf = sub.rsplit(".", 1)
            prefix = f"vision_model.encoder.layers.{i}."
            if mod == "attn.to_qkv":
                for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    out[f"{prefix}self_attn.{proj}.{leaf}"] = (k, lambda t, j=j: t.chunk(3, dim=0)[j])
            else:
                out[prefix + _CLIP_LAYER.get(mod, f"<no CLIP counterpart for {mod}>") + "." + leaf] = k
        elif rest != "head":  # `head` projects the pooled token; hidden_states[-2] never reaches it
            out[f"<no CLIP counterpart for {k}>"] = k
    return out

