"""Flux's single-stream blocks, prepared: identical input layouts for every block (one compile
per block class) and the MLP fused where the precision step allows it.

Two preparations the adapter installs on `FluxTransformer2DModel.single_transformer_blocks`:
`single_stream_preparation` (block 0 gets its streams as views of one tensor, like the later
blocks) and `fused_mlp_preparation` (`_single_block_forward`: diffusers' block forward with its
MLP as one fp8 kernel or a GEMM with a GELU epilogue).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine import GELU_EPILOGUE_MARK, Preparation, apply_gelu_linear, instance_forwards
from ...engine.compat.torch import module_has_forward_hooks


def _single_stream_views(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook on the FIRST FluxSingleTransformerBlock: hand it its two streams as
    views of one (B, text + image, D) tensor, exactly as every later single block receives
    them (each returns `hidden[:, :T], hidden[:, T:]` of its concatenated state).

    Without it, block 0 sees two contiguous tensors and blocks 1..37 see strided views, so a
    compiled block class guards on strides and compiles twice. The cat is the one the block
    does first anyway; the copy is one (B, 4608, 3072) tensor per forward (~28 MB in bf16, ~10
    us on an H100), values unchanged bit for bit.
    """
    enc, hid = kwargs.get("encoder_hidden_states"), kwargs.get("hidden_states")
    if enc is None or hid is None or not (enc.is_contiguous() and hid.is_contiguous()):
        return None
    joint = torch.cat([enc, hid], dim=1)
    t = enc.shape[1]
    return args, dict(kwargs, encoder_hidden_states=joint[:, :t], hidden_states=joint[:, t:])


def single_stream_preparation(transformer: nn.Module) -> Preparation:
    """Give the repeated single-stream blocks identical input layouts (see `_single_stream_views`)."""

    def install(root: nn.Module):
        blocks = getattr(transformer, "single_transformer_blocks", None)
        if blocks is None or not len(blocks):
            return lambda: None
        return blocks[0].register_forward_pre_hook(_single_stream_views, with_kwargs=True).remove

    return Preparation("single-stream views",
                       "single block 0 gets its streams as views of one tensor, like blocks 1..N-1 "
                       "(one compile per block class instead of two)", install)


def _fused_mlp(block: nn.Module) -> str | None:
    """How this single block's MLP runs fused: "fp8" when `proj_out` is an fp8 linear that may take
    its input in parts (the precision step's `fuse_gelu`) and the activation is the tanh GELU the
    kernel computes; "epilogue" when the precision step marked the activation (`gelu_epilogue`)
    and `proj_mlp` is a plain linear with a bias; None: the class forward."""
    act, up = block.act_mlp, block.proj_mlp
    if not (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return None
    if getattr(block.proj_out, "fuse_gelu", False):
        return "fp8"
    if getattr(act, GELU_EPILOGUE_MARK, False) and type(up) is nn.Linear and up.bias is not None:
        return "epilogue"
    return None


def _single_block_forward(block: nn.Module, class_forward, hidden_states, encoder_hidden_states, temb,
                          image_rotary_emb=None, joint_attention_kwargs=None):
    """diffusers' FluxSingleTransformerBlock.forward (0.42) with its MLP fused (`_fused_mlp`):
    - "fp8": the attention output and the MLP's *pre-activation* go to `proj_out.forward_parts`:
      one kernel applies the GELU, takes each row's amax over both and writes the fp8 input,
      instead of a materialized GELU + concat and inductor's two-pass quantization of the
      15,360-wide rows (~220 us per call at 1024^2 on an H100);
    - "epilogue": `proj_mlp` and the GELU are one cuBLASLt GEMM (`magi_zoo::linear_gelu_tanh`):
      the 12,288-wide MLP output is written once, activated; and a plain `proj_out` takes the
      attention output and the MLP output as two GEMMs, summed (`_split_linear`), instead of
      reading their concatenation.
    Otherwise: the class forward."""
    mode = _fused_mlp(block)
    if mode is None:
        return class_forward(block, hidden_states, encoder_hidden_states, temb,
                             image_rotary_emb=image_rotary_emb, joint_attention_kwargs=joint_attention_kwargs)
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = block.norm(hidden_states, emb=temb)
    up = block.proj_mlp  # fp8 too in fp8 mode: its raw output, the bias added in the kernel
    if mode == "fp8":
        raw = callable(getattr(up, "raw", None))
        mlp = up.raw(norm_hidden_states) if raw else up(norm_hidden_states)
    else:
        mlp = apply_gelu_linear(norm_hidden_states, up)
    attn_output = block.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                             **(joint_attention_kwargs or {}))
    if mode == "fp8":
        out = block.proj_out.forward_parts(attn_output, mlp, up.bias if raw else None, False, True)
    elif _plain_linear(block.proj_out):
        out = _split_linear(block.proj_out, attn_output, mlp)
    else:
        out = block.proj_out(torch.cat([attn_output, mlp], dim=2))
    hidden_states = residual + gate.unsqueeze(1) * out
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def _plain_linear(m: nn.Module) -> bool:
    """An nn.Linear whose forward nothing wraps (no hooks of its own): its weight may be used directly."""
    return type(m) is nn.Linear and not module_has_forward_hooks(m)


def _split_linear(linear: nn.Linear, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """linear(cat([a, b], -1)) as two GEMMs over the weight's column blocks, summed: the
    concatenation (a (tokens, 15,360) bf16 copy per single block at Flux's widths) is never
    written. The sum rounds the two partial products to the input dtype once each before adding."""
    w = linear.weight
    k = a.shape[-1]
    return F.linear(a, w[:, :k], linear.bias) + F.linear(b, w[:, k:])


def fused_mlp_preparation(transformer: nn.Module) -> Preparation:
    """Install `_single_block_forward` on every single-stream block (it falls back to the class
    forward unless the precision step fused the block's MLP: `_fused_mlp`)."""

    def install(root: nn.Module):
        blocks = list(getattr(transformer, "single_transformer_blocks", None) or [])
        # a plain function and a partial: what dynamo traces (not type(b).forward)
        return instance_forwards(blocks, lambda b: functools.partial(_single_block_forward, b, type(b).forward))

    return Preparation("fused single-block MLP",
                       "each single block's MLP runs fused when the precision step allows it: with fp8 matmuls "
                       "proj_out quantizes the attention output and the MLP's GELU in one kernel (no "
                       "concatenation materialized); in bf16 proj_mlp's GEMM applies the GELU in its epilogue and "
                       "proj_out reads its two inputs as two GEMMs (no concatenation either)",
                       install)
