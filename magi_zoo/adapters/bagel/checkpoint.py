"""The official BAGEL checkpoint layout, read and written with safetensors.

A checkpoint directory holds `llm_config.json` (Qwen2), `vit_config.json` (SigLIP, with
the layer BAGEL drops still counted), `ema.safetensors` (the Bagel module) and
`ae.safetensors` (the FLUX autoencoder), plus the tokenizer files.

`ema.safetensors` uses our module names as is (the modules mirror the official tree).
`ae.safetensors` holds the FLUX autoencoder under its original (BFL) names; they are
mapped to diffusers' `AutoencoderKL` names here, as diffusers' own LDM converter does, and
back when saving.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

# BFL FLUX AE name <-> diffusers AutoencoderKL name, as templates: {i} {j} are indices,
# {part} encoder|decoder, {qkv} q|k|v. Each pair compiles to a rule for either direction.
_AE_NAMES = [
    ("encoder.down.{i}.block.{j}.", "encoder.down_blocks.{i}.resnets.{j}."),
    ("encoder.down.{i}.downsample.conv.", "encoder.down_blocks.{i}.downsamplers.0.conv."),
    ("{part}.mid.block_1.", "{part}.mid_block.resnets.0."),
    ("{part}.mid.block_2.", "{part}.mid_block.resnets.1."),
    ("{part}.mid.attn_1.norm.", "{part}.mid_block.attentions.0.group_norm."),
    ("{part}.mid.attn_1.{qkv}.", "{part}.mid_block.attentions.0.to_{qkv}."),
    ("{part}.mid.attn_1.proj_out.", "{part}.mid_block.attentions.0.to_out.0."),
    ("{part}.norm_out.", "{part}.conv_norm_out."),
]
_SLOTS = {"i": r"\d+", "j": r"\d+", "part": "encoder|decoder", "qkv": "q|k|v"}


def _rule(src: str, dst: str) -> tuple[re.Pattern, str]:
    """A prefix regex for template `src` and the replacement that writes template `dst`."""
    rx = "^" + "".join(f"(?P<{tok[1:-1]}>{_SLOTS[tok[1:-1]]})" if tok.startswith("{") else re.escape(tok)
                       for tok in re.split(r"(\{\w+\})", src) if tok)
    return re.compile(rx), re.sub(r"\{(\w+)\}", r"\\g<\1>", dst)


# One naming per direction: the decoder up-block prefix regex, how to write an up block's
# resnet / upsampler prefix, the template rules, and the shortcut-conv rename. The up-block
# index is reversed both ways (BFL counts from the highest resolution, diffusers from the lowest).
_TO_DIFFUSERS = (re.compile(r"^decoder\.up\.(\d+)\.(block\.(\d+)|upsample\.conv)\."),
                 "decoder.up_blocks.{i}.", "resnets.{j}.", "upsamplers.0.conv.",
                 [_rule(bfl, hf) for bfl, hf in _AE_NAMES], (".nin_shortcut.", ".conv_shortcut."))
_TO_BFL = (re.compile(r"^decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0\.conv)\."),
           "decoder.up.{i}.", "block.{j}.", "upsample.conv.",
           [_rule(hf, bfl) for bfl, hf in _AE_NAMES], (".conv_shortcut.", ".nin_shortcut."))


def _map_ae_key(key: str, num_up_blocks: int, naming) -> str:
    up_rx, up_prefix, block, upsample, rules, (old, new) = naming
    m = up_rx.match(key)
    if m:
        inner = block.format(j=m.group(3)) if m.group(3) is not None else upsample
        key = up_prefix.format(i=num_up_blocks - 1 - int(m.group(1))) + inner + key[m.end():]
    for rx, rep in rules:
        key = rx.sub(rep, key)
    return key.replace(old, new)


def flux_ae_key(key: str, num_up_blocks: int) -> str:
    """One BFL FLUX AE key -> the diffusers AutoencoderKL key."""
    return _map_ae_key(key, num_up_blocks, _TO_DIFFUSERS)


def convert_flux_ae(state: dict[str, torch.Tensor], num_up_blocks: int) -> dict[str, torch.Tensor]:
    """Map a whole FLUX AE state dict; the mid-attention 1x1 conv weights become Linear."""
    out = {}
    for k, v in state.items():
        nk = flux_ae_key(k, num_up_blocks)
        if ".mid_block.attentions.0." in nk and nk.endswith(".weight") and v.ndim == 4:
            v = v[:, :, 0, 0]
        out[nk] = v
    return out


def flux_ae_key_back(key: str, num_up_blocks: int) -> str:
    """One diffusers AutoencoderKL key -> the BFL FLUX AE key (the inverse of `flux_ae_key`)."""
    return _map_ae_key(key, num_up_blocks, _TO_BFL)


def flux_ae_state(vae: nn.Module) -> dict[str, torch.Tensor]:
    """The diffusers AutoencoderKL's weights under BFL names, as `ae.safetensors` holds
    them (the mid-attention Linear weights as the original 1x1 convs)."""
    n_up = len(vae.decoder.up_blocks)
    out = {}
    for k, v in vae.state_dict().items():
        ok = flux_ae_key_back(k, n_up)
        if flux_ae_key(ok, n_up) != k:  # the two mappings must stay inverse: fail at save, not at load
            raise ValueError(f"AE key {k!r} has no BFL name (mapped to {ok!r}, which loads as {flux_ae_key(ok, n_up)!r})")
        if ".mid.attn_1." in ok and ok.endswith(".weight") and ".norm." not in ok:
            v = v[:, :, None, None]
        out[ok] = v.detach().contiguous()
    return out


def save_bagel_checkpoint(model: nn.Module, vae: nn.Module, cfg: dict[str, Any], path: str | Path) -> Path:
    """Write `model` (Bagel) and `vae` (diffusers AutoencoderKL) at the variant config `cfg`
    in the official layout that `load_bagel_checkpoint` / `config_from_dir` read back:
    llm_config.json, vit_config.json, ema.safetensors, ae.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    llm = dict(cfg["llm"], model_type="qwen2")
    # The official vit_config.json counts SigLIP's last layer, which BAGEL drops on load.
    vit = dict(cfg["vit"], num_hidden_layers=cfg["vit"]["num_hidden_layers"] + 1, model_type="siglip_vision_model")
    (path / "llm_config.json").write_text(json.dumps(llm, indent=2))
    (path / "vit_config.json").write_text(json.dumps(vit, indent=2))
    ema = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(ema, str(path / "ema.safetensors"))
    save_file(flux_ae_state(vae), str(path / "ae.safetensors"))
    return path


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read, from its own header (format: an 8-byte
    little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then
    the data section): which tensor is the first one the file does not hold whole. None if
    the header and sizes look right (the library's own message then stands)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"the file is {size} bytes, shorter than a safetensors header (truncated)"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"its header says {n} bytes but the file is {size} bytes (truncated inside the header)"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "its header is not valid JSON (corrupt file)"
    if not isinstance(header, dict):
        return "its header is not a table of tensors (corrupt file)"
    data = size - 8 - n
    tensors = sorted(((name, info) for name, info in header.items() if name != "__metadata__"),
                     key=lambda item: tuple(item[1].get("data_offsets", (0, 0))))
    for i, (name, info) in enumerate(tensors):
        begin, end = info.get("data_offsets", (0, 0))
        if end > data:
            return (f"truncated: tensor {name!r} (the first incomplete one, {i} of {len(tensors)} tensors "
                    f"are whole) needs bytes {begin}..{end} of the data section, which has {data}")
    return None


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """`safetensors.torch.load_file` (never pickle) with an error that names the file and,
    for a truncated file, the first tensor it does not hold whole."""
    path = Path(path)
    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError: torn download, wrong file, disk corruption
        why = _safetensors_problem(path) or f"{type(e).__name__}: {e}"
        raise ValueError(f"{path} cannot be read as safetensors: {why} -- download or save the checkpoint "
                         "again") from e


def _load_exact(module: nn.Module, state: dict[str, torch.Tensor], file: str | Path, *,
                optional: tuple[str, ...] = (), file_name=lambda k: k) -> int:
    """Copy `state` (read from `file`) into `module`, requiring an exact match of names and
    shapes (entries in `optional` may be absent). Returns how many tensors were copied.

    Errors name the file and the first bad tensor in the module's own order (`file_name`
    maps a module key to the name the file uses, where the two differ)."""
    own = module.state_dict()
    missing = [k for k in own if k not in state and k not in optional]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"tensor {file_name(missing[0])!r} is missing (the first of {len(missing)} missing)")
        if unexpected:
            parts.append(f"tensor {file_name(unexpected[0])!r} is not in the model (the first of "
                         f"{len(unexpected)} unexpected)")
        raise ValueError(f"{file}: {'; '.join(parts)} -- is this the checkpoint of this variant?")
    bad = [k for k in own if k in state and state[k].shape != own[k].shape]
    if bad:
        k = bad[0]
        raise ValueError(f"{file}: tensor {file_name(k)!r} has shape {tuple(state[k].shape)} in the file but the "
                         f"model expects {tuple(own[k].shape)} (the first of {len(bad)} shape mismatches) -- is "
                         "this the checkpoint of this variant?")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)
    return len(state)


def load_bagel_checkpoint(model: nn.Module, vae: nn.Module, path: str | Path) -> dict[str, int]:
    """Load `ema.safetensors` into the Bagel module and `ae.safetensors` into the diffusers
    AutoencoderKL. Every tensor of both modules must be in the files (the frozen sin-cos
    position tables may be absent: the official resume code regenerates them too). A
    truncated or mismatched file is an error naming the file and its first bad tensor."""
    path = Path(path)
    for f in ("ema.safetensors", "ae.safetensors"):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path / f} is missing: a BAGEL checkpoint directory holds ema.safetensors "
                                    "and ae.safetensors")
    ema_file, ae_file = path / "ema.safetensors", path / "ae.safetensors"
    n_model = _load_exact(model, read_safetensors(ema_file), ema_file,
                          optional=("vit_pos_embed.pos_embed", "latent_pos_embed.pos_embed"))
    n_up = len(vae.decoder.up_blocks)
    ae = convert_flux_ae(read_safetensors(ae_file), n_up)
    n_vae = _load_exact(vae, ae, ae_file, file_name=lambda k: flux_ae_key_back(k, n_up))
    return {"model": n_model, "vae": n_vae}
