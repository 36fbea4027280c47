"""fp8 checkpoints, the reading side: a component whose linears were saved quantized
(`magi_zoo.checkpoints.save_pretrained(..., precision="fp8")`) is built empty on the meta
device, those linears become `Fp8Linear` shells, and the file's tensors are assigned in place:
the fp8 weights (1 byte each) and their per-row fp32 scales go from disk to the model as they
are, so the host never holds a bf16 copy of them, and the precision step (which swaps only
plain linears) leaves them as loaded.

Layout: the library's own directory (`save_pretrained`), plus ``magi_zoo_fp8.json`` at its
root naming, per component, the linears stored as ``<path>.weight_fp8`` (float8_e4m3fn,
(out, in)) and ``<path>.weight_scale`` (float32, (1, out)), the buffers of `Fp8Linear`. The
fp8 components are listed as ``[null, null]`` in model_index.json, so diffusers' loader skips
them (it would otherwise build them in bf16 and fill the fp8 weights' slots at random); they
are read here and handed to the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..engine import Fp8Linear

MANIFEST = "magi_zoo_fp8.json"
FORMAT = "float8_e4m3fn weights, one float32 scale per output row (magi_zoo Fp8Linear: rowwise, amax / 448)"


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    """The fp8 manifest of a checkpoint directory; None when it is not an fp8 checkpoint."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        return None
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(f)!r}: not readable JSON ({e}); it names the fp8 linears of the checkpoint") from None
    if not isinstance(m, dict) or not isinstance(m.get("components"), dict):
        raise ValueError(f"{str(f)!r}: no 'components' table; write it with save_pretrained(..., precision='fp8')")
    return m


def shell(root: nn.Module, paths: list[str]) -> None:
    """Replace the named linears under `root` (on the meta device) by empty Fp8Linears."""
    for p in paths:
        parent_path, _, name = p.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        lin = getattr(parent, name, None)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"fp8 checkpoint: {p!r} is not a linear of {type(root).__name__} "
                             f"(found {type(lin).__name__}); the checkpoint was written for another model")
        setattr(parent, name, Fp8Linear(lin))  # on meta: shapes and dtypes only, no arithmetic


def load_component(cls: type, directory: Path, paths: list[str], device: torch.device) -> nn.Module:
    """A diffusers model class's component from `directory` (config.json + safetensors), the
    linears in `paths` as Fp8Linear read straight from the file. Strict: a missing or extra
    tensor is an error naming it."""
    from safetensors.torch import load_file  # lazy: only an fp8 checkpoint's load reads this way

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(directory)!r}: no .safetensors files (an fp8 checkpoint's component)")
    from accelerate import init_empty_weights  # lazy: as above (accelerate is a dependency of diffusers' loads)

    with init_empty_weights(include_buffers=False):  # parameters on meta; computed buffers (RoPE tables) real
        model = cls.from_config(cls.load_config(str(directory)))
    shell(model, paths)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"fp8 checkpoint {str(directory)!r} does not match {cls.__name__}: missing "
                         f"{result.missing_keys[:4]}, unexpected {result.unexpected_keys[:4]}")
    return model.eval()


def components_from(path: str | Path, device: torch.device) -> dict[str, nn.Module]:
    """The fp8 components of a checkpoint directory, loaded (nothing for a plain checkpoint):
    what a diffusers family's `load_pretrained` hands `from_pretrained` instead of its own load."""
    manifest = read_manifest(path)
    if manifest is None:
        return {}
    import diffusers  # lazy: diffusers costs seconds

    out = {}
    for comp, paths in manifest["components"].items():
        d = Path(path) / comp
        try:
            name = json.loads((d / "config.json").read_text())["_class_name"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"fp8 checkpoint {str(d)!r}: no readable config.json with _class_name ({e})") from None
        cls = getattr(diffusers, name, None)
        if cls is None:
            raise ValueError(f"fp8 checkpoint {str(d)!r}: {name} is not a diffusers model class")
        out[comp] = load_component(cls, d, list(paths), device)
    return out
