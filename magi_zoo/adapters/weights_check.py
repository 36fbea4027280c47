"""What `weights=` names, decided before anything is built: 'random', a local path or a hub id
(by the shape of the string), and for a local directory which model's checkpoint it holds
(read off the files the published layouts declare), so weights of another family are
refused by name instead of failing later inside the plan or the loader.

The rule (docs/cli.md, "Errors"): an existing directory is a local directory. Otherwise the
string is a local path when it cannot be a hub id -- it starts with `/`, `./`, `../` or `~`,
is `.` or `..`, holds a backslash or more than one `/`, ends with a checkpoint file's
suffix (`.safetensors`, `.pt`, ...), or holds characters a hub id cannot (a space, `--`,
`..`); a missing local path is an error about the path. What is left -- `name` or
`org/name` -- is a hub id (a missing local directory `org/name` reads the same, so a hub
id that cannot be fetched says that no such directory exists either).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

# Suffixes of checkpoint and config files: a string ending in one names a file, not a hub id.
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".gguf", ".json", ".pkl", ".pickle", ".h5",
                 ".onnx", ".npz", ".tar", ".gz", ".zip", ".msgpack")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def path_reason(text: str) -> str | None:
    """Why `text` reads as a local path rather than a hub id; None when it is hub-id shaped."""
    if text in (".", ".."):
        return f"{text!r} is a directory name"
    lead = next((lead for lead in ("../", "./", "/", "~") if text.startswith(lead)), None)
    if lead is not None:
        return f"it starts with {lead!r}"
    if "\\" in text:
        return "it holds a backslash"
    if text.count("/") > 1:
        return "it holds more than one '/'"
    if text.lower().endswith(FILE_SUFFIXES):
        return f"it ends with the file suffix {Path(text).suffix!r}"
    if not _HUB_ID.match(text) or "--" in text or ".." in text or len(text) > 96:
        return "a hub id is 'name' or 'org/name' of letters, digits, '-', '_' and '.'"
    return None


@dataclasses.dataclass(frozen=True)
class Identity:
    """Which model a checkpoint directory holds, and what said so."""

    family: str  # "Wan", "Flux", "BAGEL", "Qwen3-Omni", or the declared class of anything else
    layout: str  # e.g. "the diffusers layout"
    found: str  # the evidence, e.g. "model_index.json's _class_name 'WanPipeline'"


# Declared class-name prefixes (diffusers `_class_name`, transformers `architectures`) -> family.
_PREFIXES = (("CausalWan", "Wan"), ("Wan", "Wan"), ("Flux2", "FLUX.2"), ("Flux", "Flux"),
             ("HunyuanVideo15", "HunyuanVideo-1.5"), ("LTX2", "LTX-2"), ("Qwen3OmniMoe", "Qwen3-Omni"),
             ("QwenImage", "Qwen-Image"), ("Bagel", "BAGEL"), ("ZImage", "Z-Image"))


def _family_of(name: str) -> str:
    return next((fam for prefix, fam in _PREFIXES if name.startswith(prefix)), name)


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable: the family's loader names the file
    return data if isinstance(data, dict) else None


def identify(directory: str | Path) -> Identity | None:
    """The checkpoint a directory holds, from the files each published layout declares
    (None: nothing recognisable; the family's loader then says what it expected)."""
    d = Path(directory)
    index = _json(d / "model_index.json") if (d / "model_index.json").is_file() else None
    if index and isinstance(index.get("_class_name"), str):
        name = index["_class_name"]
        return Identity(_family_of(name), "the diffusers layout", f"model_index.json's _class_name {name!r}")
    if (d / "llm_config.json").is_file() and ((d / "vit_config.json").is_file() or (d / "ae.safetensors").is_file()):
        return Identity("BAGEL", "the official BAGEL layout", "llm_config.json with vit_config.json / ae.safetensors")
    if (d / "high_noise_model").is_dir() or (d / "low_noise_model").is_dir():
        return Identity("Wan", "the original Wan2.2 layout", "high_noise_model/ / low_noise_model/")
    cfg = _json(d / "config.json") if (d / "config.json").is_file() else None
    if cfg:
        if isinstance(cfg.get("_class_name"), str):
            name = cfg["_class_name"]
            return Identity(_family_of(name), "a diffusers model", f"config.json's _class_name {name!r}")
        archs = cfg.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return Identity(_family_of(archs[0]), "a transformers model", f"config.json's architectures {archs[0]!r}")
        model_type = cfg.get("model_type")
        if isinstance(model_type, str) and model_type.startswith("qwen3_omni"):
            return Identity("Qwen3-Omni", "a transformers model", f"config.json's model_type {model_type!r}")
        if {"dim", "num_heads"} <= set(cfg):
            return Identity("Wan", "the original Wan release layout", "config.json with WanModel's dim / num_heads")
    sub = _json(d / "transformer" / "config.json") if (d / "transformer" / "config.json").is_file() else None
    if sub and isinstance(sub.get("_class_name"), str):
        name = sub["_class_name"]
        return Identity(_family_of(name), "the diffusers layout", f"transformer/config.json's _class_name {name!r}")
    return None


def identify_hub(repo_id: str) -> Identity | None:
    """`identify` for a hub id whose files are already in the local hub cache (offline: it
    reads the cache, never the network); None when nothing of it is cached."""
    try:
        from huggingface_hub import try_to_load_from_cache  # lazy: huggingface_hub costs ~0.1 s; hub ids only
    except ImportError:  # pragma: no cover - diffusers and transformers depend on it
        return None
    for name in ("model_index.json", "llm_config.json", "config.json"):
        try:
            cached = try_to_load_from_cache(repo_id, name)
        except (ValueError, OSError):  # not a valid repo id for the cache: nothing to read
            return None
        if isinstance(cached, str):
            found = identify(Path(cached).parent)
            if found is not None:
                return dataclasses.replace(found, layout=f"{found.layout}, in the local hub cache")
    return None


# The checkpoint families each shipped adapter family loads (an adapter may set
# `weights_families` itself; a family in neither is not checked).
FAMILY_WEIGHTS = {"wan": ("Wan",), "wan22": ("Wan",), "self-forcing": ("Wan",), "flux": ("Flux",),
                  "bagel": ("BAGEL",), "qwen3_omni": ("Qwen3-Omni",), "qwen_image": ("Qwen-Image",),
                  "flux2": ("FLUX.2",), "hunyuanvideo15": ("HunyuanVideo-1.5",), "ltx2": ("LTX-2",),
                  "z_image": ("Z-Image",)}
