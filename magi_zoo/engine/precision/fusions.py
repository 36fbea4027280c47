"""Kernel fusions the precision step installs in bf16 and fp8 regions alike (same function, fewer
passes over memory): the GELU in a GEMM's epilogue (``gelu_epilogue``: `GeluLinear`, and a mark on
bare activations), the q/k RMSNorm + rotary embedding in one pass (``fuse_norm_rope``: a mark
on the norms), and a VAE's channel RMSNorm + SiLU in one pass (``fuse_norm_act``: the norm's
forward, and the activation made an identity, where an adapter declared the pairing). A mark is
a flag on a module that an adapter's forward (or processor) reads: only the adapter knows which
linear feeds a bare activation, or which norm pairs with which rope.
Every change is appended to the step's undo list as (parent, name, prior module or None: a mark).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from ..kernels import channel_norm, gelu_linear

# Set on a bare GELU(tanh) activation module (nn.GELU) by the precision step: "the linear that
# feeds you may run you in its epilogue". Only an adapter knows which linear feeds a bare
# activation (Flux's single blocks: proj_mlp -> act_mlp), so its forward reads the mark.
GELU_EPILOGUE_MARK = "gelu_epilogue"
# Set on an attention layer's q/k RMSNorms (fuse_norm_rope) that its processor names in
# FUSES_NORM_ROPE: "your output may be computed with the rotary embedding that follows in one
# pass" -- only the processor knows the pairing (Wan's, Flux's and Qwen-Image's, installed by
# their adapters).
NORM_ROPE_MARK = "norm_rope_fusion"
# Set by an adapter's preparation on a module whose forward applies an activation module only
# right after norms of its own, and to nothing else: {activation attribute: (norm attributes, ...)}
# (diffusers' WanResidualBlock: {"nonlinearity": ("norm1", "norm2")}). Only the adapter knows a
# forward it does not own; with the pairing declared, the norm may apply the activation itself
# and the activation become an identity -- the same function, one pass instead of two.
NORM_ACT_PAIRS = "norm_act_pairs"


def rms_norm_width(norm) -> int | None:
    """The width `norm` normalises over when it is an RMSNorm the fused kernels compute (x /
    sqrt(mean(x^2) + eps) over the last dim, times an optional weight; its `eps` and `weight`):
    torch's nn.RMSNorm over one dim, or diffusers' RMSNorm without a bias (the one diffusers'
    `Attention` builds for ``qk_norm="rms_norm"``: Qwen-Image's). Else None."""
    if isinstance(norm, nn.RMSNorm):
        shape = tuple(norm.normalized_shape)
    else:
        # diffusers' class can only be an instance's class once its module is imported: no import here
        normalization = sys.modules.get("diffusers.models.normalization")
        if normalization is None or not isinstance(norm, normalization.RMSNorm) or norm.bias is not None:
            return None
        shape = tuple(norm.dim)
    return shape[0] if len(shape) == 1 else None


def marked_norm(norm, width: int) -> bool:
    """Whether `norm` is an RMSNorm (`rms_norm_width`) over `width` channels that the precision step
    marked for the norm + rope fusion (NORM_ROPE_MARK): what an adapter's processor checks before fusing."""
    return bool(getattr(norm, NORM_ROPE_MARK, False)) and rms_norm_width(norm) == width


def marked_norms(norms, width: int) -> bool:
    """Whether every one of `norms` is a `marked_norm` over `width` channels and they share one eps:
    what a processor checks before it runs several norms (a joint attention's image and text q/k
    norms) in one kernel call, which takes one eps."""
    norms = list(norms)
    return all(marked_norm(n, width) for n in norms) and len({n.eps for n in norms}) == 1


class GeluLinear(nn.Module):
    """diffusers' `GELU` module (a linear `proj`, then the tanh GELU) as one
    `magi_zoo::linear_gelu_tanh` call. It holds the same `proj`, so state-dict keys do not change."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.proj = act.proj

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gelu_linear.apply(hidden_states, self.proj)


def _is_tanh_gelu_module(m: nn.Module) -> bool:
    """diffusers' GELU (proj + tanh GELU) over a plain bf16-able linear with a bias."""
    proj = getattr(m, "proj", None)
    return (type(m).__name__ == "GELU" and getattr(m, "approximate", None) == "tanh"
            and type(proj) is nn.Linear and proj.bias is not None)


def gelu_epilogues(root: nn.Module, epilogues: list) -> tuple[int, int]:
    """Under `root`: swap every diffusers GELU(tanh) module over a plain linear for a `GeluLinear`
    (an fp8 up projection is not one: `fuse_gelu` handles those), and mark every bare
    `nn.GELU(approximate="tanh")` for an adapter's forward (GELU_EPILOGUE_MARK). Appends the
    undo entries; returns (modules swapped, activations marked)."""
    swapped = 0
    marked = _mark(root, nn.GELU, GELU_EPILOGUE_MARK, epilogues, lambda m: m.approximate == "tanh")
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if _is_tanh_gelu_module(child):
                setattr(parent, name, GeluLinear(child))
                epilogues.append((parent, name, child))
                swapped += 1
    return swapped, marked


def mark_norm_rope(root: nn.Module, undo: list) -> int:
    """Mark the RMSNorms of every attention layer under `root` whose processor declares it fuses
    them with the rotary embedding (class attribute FUSES_NORM_ROPE: the names of the norms, e.g.
    ("norm_q", "norm_k"); Wan's, Flux's and Qwen-Image's processors, installed by their adapters). Returns how
    many layers."""
    n = 0
    for m in root.modules():
        names = getattr(getattr(m, "processor", None), "FUSES_NORM_ROPE", ())
        norms = [x for x in (getattr(m, name, None) for name in names) if rms_norm_width(x) is not None]
        for x in norms:
            _set_mark(x, NORM_ROPE_MARK, undo)
        n += bool(norms)
    return n


def channel_rms_norm(norm) -> bool:
    """Whether `norm` is a channel RMSNorm the fused kernel computes (kernels/channel_norm.py):
    diffusers' `WanRMS_norm` over dim 1 (channel_first), its gamma one value per channel."""
    # diffusers' class can only be an instance's class once its module is imported: no import here
    wan_vae = sys.modules.get("diffusers.models.autoencoders.autoencoder_kl_wan")
    cls = getattr(wan_vae, "WanRMS_norm", None)
    return (cls is not None and type(norm) is cls and norm.channel_first
            and isinstance(norm.gamma, torch.Tensor) and norm.gamma.shape[0] == norm.gamma.numel())


def fuse_norm_activations(root: nn.Module, undo: list) -> int:
    """Under `root`, for every module that declares NORM_ACT_PAIRS whose activation is an nn.SiLU
    and whose named norms are all `channel_rms_norm`s: give each norm a forward that applies the
    SiLU in the same pass (`magi_zoo::channel_rms_norm_act`) and make the activation an
    nn.Identity. A pairing that does not hold (another activation, another norm) is left as
    built. Appends the undo entries; returns how many norms now run fused."""
    n = 0
    for m in list(root.modules()):
        for act_name, norm_names in m.__dict__.get(NORM_ACT_PAIRS, {}).items():
            act, norms = getattr(m, act_name, None), [getattr(m, name, None) for name in norm_names]
            if type(act) is not nn.SiLU or not norms or not all(channel_rms_norm(x) for x in norms):
                continue
            for x in norms:
                # the forward it had (an instance forward someone installed, or None: the class's) comes back
                undo.append((x, "forward", x.__dict__.get("forward")))
                x.__dict__["forward"] = _fused_norm_silu(x)
            setattr(m, act_name, nn.Identity())
            undo.append((m, act_name, act))
            n += len(norms)
    return n


def _fused_norm_silu(norm: nn.Module):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return channel_norm.apply(x, norm, silu=True)
    return forward


def undo_fusions(epilogues: list) -> None:
    """Undo `gelu_epilogues`, `mark_norm_rope` and `fuse_norm_activations` (last first): marks
    and instance forwards cleared, modules and earlier instance forwards put back."""
    for parent, name, act in reversed(epilogues):
        if act is None:  # a mark
            parent.__dict__.pop(name, None)
        else:
            setattr(parent, name, act)


def _set_mark(m: nn.Module, mark: str, undo: list) -> bool:
    """Set `mark` on `m` unless it is set; record the undo entry (m, mark, None). True if set."""
    if m.__dict__.get(mark):
        return False
    m.__dict__[mark] = True
    undo.append((m, mark, None))
    return True


def _mark(root: nn.Module, cls: type, mark: str, undo: list, where=lambda m: True) -> int:
    """Set `mark` on every `cls` module under `root` (that `where` accepts); an adapter's forward reads
    it. Returns how many."""
    return sum(_set_mark(m, mark, undo) for m in root.modules() if isinstance(m, cls) and where(m))
