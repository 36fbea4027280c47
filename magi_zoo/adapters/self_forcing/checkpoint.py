"""Weights of the self-forcing family: the official generator checkpoint, and our own layout.

Official checkpoint (guandeh17/Self-Forcing, e.g. `checkpoints/self_forcing_dmd.pt`): a
`torch.save` dict whose `generator` and `generator_ema` entries are state dicts of the
training wrapper `WanDiffusionWrapper`, so every key is `model.` + a `CausalWanModel` key
in the original Wan layout (`model.blocks.0.self_attn.q.weight`, `model.head.modulation`,
...; `inference.py` loads one of them with `pipeline.generator.load_state_dict`). It is
read with `torch.load(weights_only=True)` -- tensors and plain containers only, a file
from the internet cannot run code -- and mapped to diffusers names by diffusers' own
`convert_wan_transformer_to_diffusers` (the single-file loader's table: self_attn ->
attn1, q -> to_q, ffn.0 -> ffn.net.0.proj, the norm2/norm3 swap, ...). EMA weights are the
default, as the published samples use them (`--use_ema`).

A directory the family loads (`weights=DIR`):
- the diffusers layout of Wan2.1-T2V-1.3B (`tokenizer/`, `text_encoder/`, `vae/`, and
  `transformer/` with at least its config.json), e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers;
- plus, optionally, one Self-Forcing checkpoint `*.pt` in DIR or DIR/checkpoints/: its
  generator replaces the transformer's weights (the bidirectional Wan weights in
  `transformer/` are then not read).
`save_pretrained` writes that layout (without a .pt: the transformer's weights are in
`transformer/`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

ENTRIES = ("generator_ema", "generator")
_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def find_checkpoint(directory: Path) -> Path | None:
    """The one Self-Forcing `.pt` in `directory` or `directory/checkpoints`, if any."""
    found = sorted(p for d in (directory, directory / "checkpoints") if d.is_dir() for p in d.glob("*.pt"))
    if len(found) > 1:
        raise ValueError(f"{directory}: more than one checkpoint ({', '.join(p.name for p in found)}); "
                         "keep the one Self-Forcing generator checkpoint to load")
    return found[0] if found else None


def read_generator(path: str | Path, use_ema: bool | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict in the original layout without the wrapper prefix, entry used).
    use_ema: True = `generator_ema` (an error if absent), False = `generator`, None = EMA
    when present, else `generator` with a warning."""
    path = Path(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise ValueError(f"{path}: not a readable torch checkpoint ({' '.join(str(e).split())[:200]})") from e
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as e:  # weights_only refuses pickled code: say so, do not retry unsafely
        raise ValueError(f"{path}: cannot be read as weights only ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}); a Self-Forcing checkpoint holds tensors only") from e
    if not isinstance(ckpt, dict) or not any(k in ckpt for k in ENTRIES):
        keys = list(ckpt)[:5] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path}: expected a dict with {' / '.join(ENTRIES)} (a Self-Forcing checkpoint), "
                         f"found {keys}")
    if use_ema is None:
        entry = "generator_ema" if "generator_ema" in ckpt else "generator"
        if entry != "generator_ema":
            warnings.warn(f"{path.name} has no generator_ema; loading its generator weights", stacklevel=2)
    else:
        entry = "generator_ema" if use_ema else "generator"
        if entry not in ckpt:
            raise ValueError(f"{path}: no {entry!r} entry (it has {', '.join(k for k in ENTRIES if k in ckpt)})")
    return {_strip(k): v for k, v in ckpt[entry].items()}, entry


def _strip(key: str) -> str:
    for p in _PREFIXES:
        key = key.replace(p, "")
    return key[len("model."):] if key.startswith("model.") else key


def to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original Wan layout -> diffusers names (diffusers' single-file conversion)."""
    # lazy: diffusers costs seconds; the adapter imports this module to list models
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(state))


# The inverse of diffusers' table for a T2V model, for writing official-layout files (tests).
_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"), ("attn1", "self_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"), ("norm3", "norm2"), ("norm__swap", "norm3"),
]


def to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers names -> the original Wan layout of `CausalWanModel` (what the official
    checkpoint holds, without the `model.` prefix)."""
    out = {}
    for key, value in state.items():
        if key == "scale_shift_table":
            new = "head.modulation"
        elif key.startswith("proj_out."):
            new = key.replace("proj_out.", "head.head.")
        else:
            new = key.replace("scale_shift_table", "modulation")
            for a, b in _TO_ORIGINAL:
                new = new.replace(a, b)
        out[new] = value
    return out


def load_generator(model: torch.nn.Module, path: str | Path, use_ema: bool | None = None) -> str:
    """Load a Self-Forcing checkpoint into a CausalWanTransformer3DModel; every parameter
    must be covered and every checkpoint key used (the error names the first few that are
    not). Returns the entry loaded ("generator_ema" or "generator")."""
    original, entry = read_generator(path, use_ema)
    state = to_diffusers(original)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{Path(path).name}[{entry}] does not fit the causal Wan model: "
                         f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                         f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}; "
                         "is it a Wan2.1-T2V-1.3B Self-Forcing checkpoint?")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        k = bad[0]
        raise ValueError(f"{Path(path).name}[{entry}]: {k} has shape {tuple(state[k].shape)}, the model "
                         f"{tuple(own[k].shape)} ({len(bad)} tensors differ); wrong model size?")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(state[k])  # copy_ keeps each parameter's dtype (fp32 norms, bf16 rest) and device
    return entry
