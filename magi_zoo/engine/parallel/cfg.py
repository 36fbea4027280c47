"""CFG parallelism: the two branches of classifier-free guidance on two ranks.

diffusers does not have it for these pipelines, so it is a small hook here (`CfgParallelHook`):
pipelines mark each denoiser call with ``model.cache_context("cond" | "uncond")`` (a diffusers
guider's, with "pred_cond" | "pred_uncond"); the rank of
the cond branch computes the cond call and skips the uncond one, the other rank the reverse, and
at the uncond call the two outputs are all-gathered (outside any compiled region). The cond
call's result on the uncond rank is a placeholder tensor the hook fills in place at the exchange,
before the pipeline combines the two (it may slice the cond output before the uncond call, as
Flux2KleinPipeline does: the slice is a view of the placeholder, so it sees the values too).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ..compat import diffusers as diffusers_compat
from .hooks import drop_empty_registry, forwards, has_registry, hook_classes, registry, restore_forwards

CFG_HOOK = "magi_zoo_cfg_parallel"
# The cache_context names pipelines give their guidance calls -> the branch: "cond" / "uncond"
# (Wan's, Flux's, FLUX.2 [klein]'s pipelines), "pred_cond" / "pred_uncond" (a pipeline whose
# diffusers `ClassifierFreeGuidance` guider names the calls: HunyuanVideo-1.5's).
BRANCHES = {"cond": "cond", "uncond": "uncond", "pred_cond": "cond", "pred_uncond": "uncond"}


def _sample(out: Any) -> torch.Tensor:
    """The tensor of a diffusers transformer output: ``(sample,)`` or an output with `.sample`."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    raise TypeError(f"cfg parallel: the denoiser returned {type(out).__name__}; expected a diffusers transformer "
                    "output ((sample,) or an object with .sample)")


def _wrap(sample: torch.Tensor, like: Any, return_dict: bool) -> Any:
    """`sample` in the structure a diffusers transformer returns (`like` if known)."""
    if like is not None and not isinstance(like, (tuple, list, torch.Tensor)):
        return type(like)(sample=sample)
    if isinstance(like, torch.Tensor):
        return sample
    if like is not None or not return_dict:
        return (sample,)
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


def _make_cfg_hook(group, branch: int):
    BaseState, _, ModelHook, StateManager = hook_classes()

    @diffusers_compat.stateful  # so diffusers' cache_context tells it which branch a call is
    class CfgParallelHook(ModelHook):
        """Runs one branch of classifier-free guidance on this rank (`branch` 0 = cond,
        1 = uncond) and exchanges the outputs with the other rank of its cfg pair."""

        def __init__(self):
            super().__init__()
            self.state = StateManager(BaseState)
            self.group, self.branch = group, branch
            self.pending: torch.Tensor | None = None  # branch 0: the cond output; 1: the placeholder
            self.like: Any = None

        def reset_state(self, module):
            self.pending = None
            self.state.reset()
            return module

        def new_forward(self, module, *args, **kwargs):
            forward = self.fn_ref.original_forward
            name = BRANCHES.get(diffusers_compat.cache_context_name(self.state))
            if name is None:
                # Not inside a guidance pipeline's cond/uncond call (a direct call, a benchmark):
                # every rank computes it, which is what a single process would return.
                return forward(*args, **kwargs)
            return_dict = kwargs.get("return_dict", True)
            if name == "cond":
                if self.pending is not None:
                    self.pending = None
                    raise RuntimeError("cfg parallel: a 'cond' denoiser call came after a 'cond' call with no "
                                       "'uncond' call between; CFG parallel needs a pipeline that runs guidance "
                                       "(Wan: guidance_scale > 1; Flux: true_cfg_scale > 1 with a negative_prompt)")
                if self.branch == 0:
                    out = forward(*args, **kwargs)
                    self.pending, self.like = _sample(out), out
                    return out
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                # Filled in place at the uncond call's exchange. Most denoisers predict a tensor of
                # their input's shape, and a pipeline may take a view of the cond output before the
                # uncond call (Flux2KleinPipeline slices off the conditioning image's tokens): the
                # values are copied into this buffer, so such a view sees them once they arrive. An
                # output of another shape (Wan I2V: 36 input channels, 16 predicted) is swapped in
                # instead (set_), for a pipeline that reads the cond output only after the uncond
                # call. NaN until then: a pipeline that computed with it earlier gets NaN, never
                # plausible values.
                self.pending = torch.full_like(hidden, float("nan"))
                return _wrap(self.pending, None, return_dict)
            if self.pending is None:
                raise RuntimeError("cfg parallel: an 'uncond' denoiser call without a 'cond' call before it; "
                                   "CFG parallel expects the cond forward first, as diffusers' pipelines call it")
            if self.branch == 1:
                out = forward(*args, **kwargs)
                mine = _sample(out).contiguous()
            else:
                out, mine = None, self.pending.contiguous()
            both = [torch.empty_like(mine) for _ in range(2)]
            torch.distributed.all_gather(both, mine, group=self.group)
            cond, uncond = both
            placeholder, self.pending = self.pending, None
            if self.branch == 1:
                if placeholder.dtype != cond.dtype:
                    raise RuntimeError(f"cfg parallel: the denoiser returns {cond.dtype} for {placeholder.dtype} "
                                       "inputs; run it in one dtype")
                if placeholder.shape == cond.shape:
                    placeholder.copy_(cond)
                else:
                    placeholder.set_(cond)
                return out
            return _wrap(uncond, self.like, return_dict)

    return CfgParallelHook()


def cfg_parallel(model: nn.Module, group, branch: int, key: str) -> Callable[[], None]:
    """Install the CFG hook on `model` (this rank runs `branch`); returns the exact undo."""
    if not hasattr(model, "cache_context"):
        raise ValueError(f"parallel {key!r}: cfg=true needs a diffusers model whose pipeline marks its cond/uncond "
                         f"calls with cache_context; {type(model).__name__} has none")
    had = has_registry(model)
    saved = forwards([model])
    reg = registry(model)
    reg.register_hook(_make_cfg_hook(group, branch), CFG_HOOK)

    def undo() -> None:
        reg.remove_hook(CFG_HOOK, recurse=False)
        restore_forwards(saved)
        if not had:
            drop_empty_registry(model)

    return undo
