"""CPU stand-ins for the FA3 kernel (the `fa3-fwd` wheel, CUDA only), so the engine's fa3 and
fp8-attention paths run in CPU tests with the real dispatch, quantization and registration
around them. Each is a `torch.library` custom op with a fake, like the real op, so a compiled
region records it as one opaque node; the bf16 one counts its eager calls (`CALLS`): a count
that grows on every compiled call proves the op sits in the graph (a Python side effect traced
into a graph would run once, at trace time).

- `fa3_forward`: the wheel's `_flash_attn_forward` -- SDPA, and the softmax's natural-log LSE
  per (batch, head, query) as FA3 returns it; ``seqused_k`` uses only each batch element's
  first keys, as FA3 does.
- `fa3_fp8_forward`: its fp8 call (q, k, v in e4m3 with per-(batch, head) descales) --
  dequantize, then SDPA.
- `install_fa3(monkeypatch)`: `import fa3_fwd_interface` finds a module whose forward is
  `fa3_forward`, and the engine's kernel state starts empty (both put back by monkeypatch).
"""

from __future__ import annotations

import sys
import types
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from magi_zoo.engine.kernels import fa3

CALLS = {"eager": 0}


@torch.library.custom_op("magi_zoo_test::fa3_fwd_standin", mutates_args=(), device_types="cpu")
def fa3_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None,
                causal: bool = False, seqused_k: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    CALLS["eager"] += 1
    gqa = k.shape[2] != q.shape[2]  # FA3 takes fewer key/value heads natively
    # seqused_k: only the first seqused_k[b] keys of batch element b are used (FA3's meaning)
    used = None if seqused_k is None else (torch.arange(k.shape[1]) < seqused_k[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=used,
                                         scale=softmax_scale, is_causal=causal, enable_gqa=gqa).transpose(1, 2).contiguous()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kr = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    logits = scale * q.transpose(1, 2).float() @ kr.transpose(1, 2).float().transpose(-1, -2)
    if causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if used is not None:
        logits = logits.masked_fill(~used, float("-inf"))
    return out, torch.logsumexp(logits, dim=-1), q.new_empty(0), q.new_empty(0)


@fa3_forward.register_fake
def _(q, k, v, softmax_scale=None, causal=False, seqused_k=None):
    b, s, h, _ = q.shape
    return (q.new_empty(b, s, h, v.shape[-1]), q.new_empty(b, h, s, dtype=torch.float32),
            q.new_empty(0), q.new_empty(0))


@torch.library.custom_op("magi_zoo_test::fa3_fp8_standin", mutates_args=(), device_types="cpu")
def fa3_fp8_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor,
                    k_descale: torch.Tensor, v_descale: torch.Tensor, softmax_scale: float,
                    causal: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    deq = lambda t, s: (t.float() * s[:, None, :, None]).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(deq(q, q_descale), deq(k, k_descale), deq(v, v_descale),
                                         scale=softmax_scale, is_causal=causal).transpose(1, 2)
    return out.to(torch.bfloat16).contiguous(), q.new_empty(0, dtype=torch.float32), q.new_empty(0), q.new_empty(0)


@fa3_fp8_forward.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal=False):
    return (q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty(0, dtype=torch.float32),
            q.new_empty(0), q.new_empty(0))


def install_fa3(monkeypatch) -> types.ModuleType:
    """The wheel 'installed' as the stand-in, the engine's loaded op reset, the call count zeroed."""
    mod = types.ModuleType(fa3.MODULE)
    mod._flash_attn_forward = fa3_forward
    monkeypatch.setitem(sys.modules, fa3.MODULE, mod)
    monkeypatch.setattr(fa3, "_forward", None)
    CALLS["eager"] = 0
    return mod
