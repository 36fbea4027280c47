"""The full deltas of a LoRA file: what some files carry besides their low-rank layers.

LoRA files in Wan's original layout (LightX2V's distill LoRAs) also carry deltas for parameters
that are not linears -- a block's modulation (``blocks.N.diff_m``) and its norms' weights and
biases (``.diff`` / ``.diff_b`` under a norm) -- which the LoRA's authors' loader adds to the
parameter at the LoRA's strength (parameter + strength x delta). diffusers' converter leaves
them out, with a debug log line only, so a LoRA loaded through diffusers alone is not the LoRA
its authors ran. Here they are read from the file: the all-zero ones (the published norm deltas
are zeros) are counted, the others added to the fused weights at the LoRA's scale, and the
report says how many of each. A hot-swappable LoRA cannot carry them (peft swaps only its
low-rank layers): an error before the build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn


class ConvertedLora(dict):
    """A LoRA's state dict in diffusers' names (what `load_lora_weights` takes), plus the full
    deltas the conversion left out (module docstring): `deltas`, the non-zero ones by the
    denoiser's parameter name; `zero_deltas`, how many were all zeros; `unmapped`, the non-zero
    ones in a layout other than Wan's original (not applied: no map to the model's parameters
    here); `inspected`, whether the file could be opened here to look (a hub id not in the
    local cache: no)."""

    deltas: dict[str, torch.Tensor]
    zero_deltas: int = 0
    unmapped: int = 0
    inspected: bool = True


# Wan's original layout: a delta entry's suffix -> the suffix of the parameter it is added to.
_DELTA_SUFFIXES = {".diff_m": ".modulation", ".diff_b": ".bias", ".diff": ".weight"}


def _delta_keys(keys: Iterable[str]) -> dict[str, str | None]:
    """raw key -> the original-layout parameter it is a delta of, for a file's delta entries
    (Wan's original names, ``diffusion_model.`` prefix optional); None for a delta entry in
    another layout (Kohya's ``lora_unet_*`` names: no map here)."""
    out: dict[str, str | None] = {}
    for key in keys:
        suffix = next((x for x in _DELTA_SUFFIXES if key.endswith(x)), None)
        if suffix is None:
            continue
        bare = key.removeprefix("diffusion_model.")
        out[key] = bare[: -len(suffix)] + _DELTA_SUFFIXES[suffix] if bare.startswith(("blocks.", "head.")) else None
    return out


def left_out_deltas(raw: Mapping[str, torch.Tensor], converted: Mapping[str, torch.Tensor],
                    ) -> dict[str, tuple[str, torch.Tensor]]:
    """raw key -> (the denoiser's parameter in diffusers' names, the delta) for each delta entry
    diffusers' conversion did not turn into a LoRA tensor (a linear's ``diff_b`` becomes its
    ``lora_B.bias``: that one is in)."""
    originals = {k: v for k, v in _delta_keys(raw).items() if v is not None}
    if not originals:
        return {}
    # lazy: diffusers costs seconds; its Wan converter renames original keys to diffusers' own
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    names = {v: k for k, v in convert_wan_transformer_to_diffusers({o: o for o in set(originals.values())}).items()}
    out = {}
    for key, original in originals.items():
        param = names.get(original, original)
        module = param.rpartition(".")[0]
        if not any(k.startswith(f"transformer.{module}.lora_") for k in converted):
            out[key] = (param, raw[key])
    return out


def _local_file(source: str, kw: Mapping[str, Any]) -> str | None:
    """The local .safetensors file diffusers reads for `source` (a hub id: from the local hub
    cache), or None where it cannot be found here."""
    if Path(source).is_file():
        return source
    try:
        # lazy: huggingface_hub comes with diffusers; only a hub-id LoRA needs it
        from huggingface_hub import hf_hub_download, snapshot_download

        if "weight_name" in kw:
            return hf_hub_download(source, kw["weight_name"], subfolder=kw.get("subfolder"), local_files_only=True)
        files = sorted(Path(snapshot_download(source, local_files_only=True)).rglob("*.safetensors"))
        return str(files[0]) if len(files) == 1 else None
    except Exception:  # not in the local cache (offline): the caller records "not inspected"
        return None


def check_deltas(source: str, state: ConvertedLora, model: nn.Module, model_name: str) -> None:
    """Each non-zero full delta of the LoRA `source` names a parameter of `model` at its shape;
    else a ValueError naming both (a LoRA for another model or size)."""
    params = dict(model.named_parameters())
    for name, delta in state.deltas.items():
        have = params.get(name)
        if have is None or tuple(have.shape) != tuple(delta.shape):
            what = "which it does not have" if have is None else f"of shape {tuple(have.shape)}"
            raise ValueError(f"lora {source!r} does not fit {model_name}: a delta of shape "
                             f"{tuple(delta.shape)} for {name}, {what} -- a LoRA for another model or size of it. "
                             f"Pass a LoRA made for {model_name}")


def refuse_deltas_for_hotswap(sources: list[str], states: list[ConvertedLora]) -> None:
    """A hot-swappable LoRA keeps peft's low-rank layers, which cannot carry full deltas: an
    error naming them (before the build), to load the LoRA fused instead."""
    for source, state in zip(sources, states):
        if getattr(state, "deltas", None):
            first = next(iter(state.deltas))
            raise ValueError(f"lora {source!r} carries {len(state.deltas)} full delta(s) besides its low-rank "
                             f"layers (e.g. {first}), which hot-swapping cannot replace (peft swaps only its "
                             "low-rank layers); load it fused (without lora_hotswap)")


def describe_deltas(state: Mapping[str, torch.Tensor]) -> str:
    """What the report says of a LoRA's full deltas ("" where it has none)."""
    if not getattr(state, "inspected", True):
        return "; full deltas not inspected (the file is not in the local hub cache)"
    added, zeros = len(getattr(state, "deltas", {})), getattr(state, "zero_deltas", 0)
    unmapped = getattr(state, "unmapped", 0)
    parts = ([f"{added} full deltas added (modulation / norms)"] if added else []) + \
        ([f"{zeros} all-zero full deltas skipped"] if zeros else []) + \
        ([f"{unmapped} non-zero full deltas NOT applied (a layout with no parameter map here; diffusers drops "
          "them too)"] if unmapped else [])
    return "; " + ", ".join(parts) if parts else ""


@torch.no_grad()
def add_deltas(module: nn.Module, state: ConvertedLora, scale: float) -> None:
    """Add a LoRA's full deltas to `module`'s parameters at `scale` (as its authors' loader
    does: parameter + scale x delta), in fp32, then back to each parameter's dtype."""
    params = dict(module.named_parameters())
    for name, delta in state.deltas.items():
        p = params[name]
        p.copy_((p.float() + scale * delta.to(p.device, torch.float32)).to(p.dtype))


def with_deltas(state: ConvertedLora, source: str, kw: Mapping[str, Any]) -> ConvertedLora:
    """`state` (diffusers' conversion of the file `source` names) with the full deltas the
    conversion left out, read from the file: non-zero ones in `deltas`, zeros counted."""
    state.deltas = {}
    local = _local_file(source, kw)
    if local is None:
        state.inspected = False
        return state
    from safetensors import safe_open  # lazy: only a LoRA file is opened here

    with safe_open(local, framework="pt") as f:
        found = _delta_keys(f.keys())
        raw = {k: f.get_tensor(k) for k in found}
    for param, delta in left_out_deltas(raw, state).values():
        if bool(delta.count_nonzero()):
            state.deltas[param] = delta
        else:
            state.zero_deltas += 1
    for key in (k for k, v in found.items() if v is None):  # no map here; diffusers' converters drop these too
        if bool(raw[key].count_nonzero()):
            state.unmapped += 1
        else:
            state.zero_deltas += 1
    return state
