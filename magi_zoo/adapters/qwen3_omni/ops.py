"""Qwen3-Omni's registered custom op and the prefill / decode-step split of the thinker.

MoE expert dispatch
-------------------
transformers' reference ("eager") experts forward finds the experts a batch hits with
``nonzero()``, loops over them in Python and gathers tokens with ``torch.where``: a
data-dependent output shape and a tensor-driven loop, so dynamo breaks the graph at every
MoE layer (the thinker's prefill splits into ~10 graphs at 2 layers). The same loop,
registered as ``magi_zoo::qwen3_omni_moe_experts`` with a fake that returns a tensor
like the input, is opaque to dynamo: 0 breaks, and the region can be ``fullgraph=True``.
It is offered to transformers as the experts implementation ``"magi_zoo_op"`` (its
``ExpertsInterface``, present in 5.17 and 5.24), so choosing it is one config switch.

The library default ``"grouped_mm"`` also traces with 0 breaks (on CPU its fallback is
itself a custom op) and runs every expert in one grouped GEMM on Hopper, so the shipped
spec keeps it; ``"magi_zoo_op"`` is the fix for models/configs that use the eager loop.

Prefill vs decode step
----------------------
The thinker's text model runs the prompt (variable length: dynamic shapes) and then one
token per step against a static KV cache (fixed shapes: CUDA graphs on GPU) through the
same ``forward``. `install_prefill_decode` gives the module two methods, ``prefill``
and ``decode_step`` (each the unchanged forward), and a ``forward`` that dispatches by
sequence length, so the spec can key them separately. The dispatch lives here, in the
adapter: the engine only sees two methods.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine import register_custom_op
from ...engine.compat.transformers import (config_experts_implementation, has_experts_implementation,
                                           set_config_experts_implementation)

EXPERTS_OP_IMPL = "magi_zoo_op"  # the name registered in transformers' ExpertsInterface
EXPERTS_CHOICES = ("grouped_mm", "batched_mm", "eager", EXPERTS_OP_IMPL)


def _experts_fake(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return torch.empty_like(hidden_states)


@register_custom_op("qwen3_omni_moe_experts", is_compute_sensitive=True, fake=_experts_fake)
def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over fused weights (gate_up [E, 2I, H], down [E, H, I]): the reference
    loop of transformers' eager experts, same order of accumulation, hence the same numbers."""
    out = torch.zeros_like(hidden_states)
    num_experts = gate_up_proj.shape[0]
    # num_experts + 1 classes, the last one skipped, as transformers does: under expert
    # parallelism a token routed to an expert held by another rank carries the sentinel
    # index num_experts (one_hot with num_experts classes would raise on it).
    mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)  # [E + 1, top_k, tokens]
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
        if e == num_experts:
            continue
        top_k_pos, token_idx = torch.where(mask[e])
        gate, up = F.linear(hidden_states[token_idx], gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def _op_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # The op hard-codes SwiGLU; every published Qwen3-Omni MoE uses silu.
    if getattr(self.config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"{EXPERTS_OP_IMPL} experts implement silu only, not {self.config.hidden_act!r}")
    return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def register_experts_impl() -> None:
    """Offer the op to transformers as `experts_implementation="magi_zoo_op"` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # lazy: transformers costs seconds

    if EXPERTS_OP_IMPL not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_OP_IMPL, _op_experts_forward)


def set_experts_implementation(model: nn.Module, impl: str) -> None:
    """Switch every MoE experts module under `model` to `impl` (one of EXPERTS_CHOICES)."""
    if impl not in EXPERTS_CHOICES:
        raise ValueError(f"unknown experts implementation {impl!r}; choose one of {', '.join(EXPERTS_CHOICES)}")
    register_experts_impl()
    n = 0
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        # Experts modules hold the config they dispatch on (use_experts_implementation).
        if cfg is not None and hasattr(mod, "gate_up_proj") and has_experts_implementation(cfg):
            set_config_experts_implementation(cfg, impl)
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no MoE experts modules to switch")


def experts_implementation(model: nn.Module) -> set[str]:
    """The experts implementations in use under `model`."""
    return {config_experts_implementation(mod.config) for mod in model.modules()
            if hasattr(mod, "gate_up_proj") and has_experts_implementation(getattr(mod, "config", None))}


# -- prefill / decode_step ---------------------------------------------------------------------
def _seq_len(args, kwargs) -> int:
    emb = kwargs.get("inputs_embeds")
    if emb is not None:
        return emb.shape[1]
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError("thinker text model called without input_ids or inputs_embeds")
    return ids.shape[-1]


class PrefillDecodeMixin:
    """`prefill` and `decode_step` methods plus a `forward` that picks one by sequence length.

    One new token (sequence length 1) is a decode step; anything longer is a prefill. A
    one-token prompt therefore runs as a decode step -- the same computation, only under
    the decode spec. Both call the library class's forward unchanged, so numerics are too.
    """

    def prefill(self, *args, **kwargs):
        """The prompt pass: variable length (compiled with dynamic shapes)."""
        return super().forward(*args, **kwargs)

    def decode_step(self, *args, **kwargs):
        """One token against the KV cache: fixed shapes with a static cache (CUDA graphs)."""
        return super().forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if _seq_len(args, kwargs) != 1:
            return self.prefill(*args, **kwargs)
        out = self.decode_step(*args, **kwargs)
        # Under CUDA graphs (the decode spec on GPU) the next replay overwrites this step's
        # output buffers; generate() keeps per-step hidden states (the talker reads them),
        # so those are copied out. last_hidden_state is consumed at once by the LM head.
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h.clone() for h in out.hidden_states)
        return out


_SPLIT_CLASSES: dict[type, type] = {}


def install_prefill_decode(text_model: nn.Module) -> nn.Module:
    """Re-class `text_model` in place as a subclass with `PrefillDecodeMixin`.

    The subclass keeps the library class's name, so class-name spec keys match it in every
    transformers version, and its methods show in `dir()`, so a misspelt method in a spec
    gets the real ones suggested. Weights, config and state-dict keys are untouched.
    """
    cls = type(text_model)
    if issubclass(cls, PrefillDecodeMixin):
        return text_model
    if cls not in _SPLIT_CLASSES:
        _SPLIT_CLASSES[cls] = type(cls.__name__, (PrefillDecodeMixin, cls),
                                   {"__module__": cls.__module__, "__doc__": cls.__doc__})
    text_model.__class__ = _SPLIT_CLASSES[cls]
    return text_model
