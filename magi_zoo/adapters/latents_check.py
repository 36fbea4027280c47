"""Caller-given latents checked against the ones the pipeline would draw, before any denoising step.

diffusers' pipelines take `latents=` (and LTX-2 `audio_latents=`) and use the tensor as given:
a tensor of the wrong shape failed only inside the denoiser's first forward, as a reshape's
"not enough values to unpack" or a matmul's "shapes cannot be multiplied". Which shape fits
depends on the call (size, frames, outputs per prompt) and on how each pipeline prepares
latents (Wan uses them whole; Flux and Qwen-Image take them packed; FLUX.2 packs them itself;
LTX-2 takes either form), so the rule here asks the pipeline itself: every `prepare_*latents`
method with a `latents` parameter is wrapped, and a call that passes latents first runs the
method once without them (its own noise for this call) and compares what the two return.

That dry run draws with no generator inside `torch.random.fork_rng`, so the caller's
generator and the global random state are left as they were: the call's output is the same as
without the check. It costs one more `prepare_*latents` call, only when latents are given (for
Wan's image-to-video pipeline that includes one more VAE encode of the conditioning image).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _rng_kept(device: Any):
    dev = torch.device(device) if device is not None else None
    on_cuda = dev is not None and dev.type == "cuda" and torch.cuda.is_available()
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if on_cuda else []
    return torch.random.fork_rng(devices=devices)


def guard_latents(pipe: Any) -> None:
    """Wrap each of `pipe`'s `prepare_*latents` methods that take `latents`, so a given tensor
    that does not prepare to the shape of the pipeline's own latents for the call is a
    ValueError naming both shapes (see the module docstring). Idempotent."""
    for name in dir(type(pipe)):
        if not (name.startswith("prepare") and name.endswith("latents")):
            continue
        method = getattr(pipe, name, None)
        if not callable(method) or getattr(method, "magi_zoo_latents_guard", False):
            continue
        try:
            sig = inspect.signature(method)
        except (TypeError, ValueError):
            continue
        if "latents" not in sig.parameters:
            continue
        setattr(pipe, name, _guarded(method, sig, type(pipe).__name__, name))


def _guarded(method, sig: inspect.Signature, owner: str, name: str):
    # the call argument these latents come from (LTX-2's audio latents are `audio_latents=`)
    arg = "audio_latents" if "audio" in name else "latents"

    @functools.wraps(method)
    def prepare(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        given = bound.arguments.get("latents")
        if given is None:
            return method(*args, **kwargs)
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(given).__name__}")
        dry = sig.bind(*args, **kwargs)
        dry.arguments["latents"] = None
        if "generator" in dry.arguments:
            dry.arguments["generator"] = None
        with _rng_kept(dry.arguments.get("device")), torch.no_grad():
            expected = _first_tensor(method(*dry.args, **dry.kwargs))
        try:
            out = method(*args, **kwargs)
        except (ValueError, RuntimeError, IndexError, TypeError) as e:
            raise _mismatch(owner, arg, given, expected, f"the pipeline refused them ({e})") from e
        got = _first_tensor(out)
        if expected is not None and got is not None and got.shape != expected.shape:
            raise _mismatch(owner, arg, given, expected, f"they prepare to {tuple(got.shape)}")
        return out

    prepare.magi_zoo_latents_guard = True  # type: ignore[attr-defined]  # (idempotence)
    return prepare


def _mismatch(owner: str, arg: str, given: torch.Tensor, expected: torch.Tensor | None, why: str) -> ValueError:
    want = f" prepare to {tuple(expected.shape)}" if expected is not None else " differ"
    return ValueError(f"{arg} of shape {tuple(given.shape)} do not fit this call of {owner}: {why}, and the "
                      f"pipeline's own {arg} for this size, frame count and number of outputs{want}; pass "
                      f"{arg} of the shape the pipeline draws for this call, or none to draw them from the generator")

