"""Wan2.1 weights in the original release layout, loaded into diffusers' Wan pipeline.

The original layout is what the Wan-AI/Wan2.1-T2V-* / -I2V-* repositories ship and what the Wan
repository, LightX2V and Self-Forcing read (a checkpoint directory, `--ckpt_dir`)::

    config.json                            WanModel's config, original names (dim, num_heads, in_dim, ...)
    diffusion_pytorch_model*.safetensors   the DiT, original key names (blocks.N.self_attn.q, ...);
                                           14B: shards + diffusion_pytorch_model.safetensors.index.json
                                           (a single diffusion_pytorch_model.pth is read too)
    models_t5_umt5-xxl-enc-bf16.pth        the UMT5-XXL encoder as Wan's own T5 module (wan/modules/t5.py)
    Wan2.1_VAE.pth                         the VAE as Wan's own module (wan/modules/vae.py)
    google/umt5-xxl/                       the tokenizer
    models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth   I2V: the CLIP image encoder (clip.py)
    distill_models/distill_model.safetensors   LightX2V's step-distilled DiT (the -distill variants read it)

What converts what:
- DiT: diffusers' own `convert_wan_transformer_to_diffusers` (diffusers.loaders.single_file_utils,
  the function `WanTransformer3DModel.from_single_file` uses). The config is read from
  config.json; the fields WanModel leaves out of it (`ignore_for_config`: patch_size,
  text_dim, qk_norm, cross_attn_norm) are read from the weights' shapes and names.
- VAE: diffusers' own `convert_wan_vae_to_diffusers`. That converter is written for the
  published VAE's block structure (dim_mult [1, 2, 4, 4], 2 res blocks: it hard-codes the
  decoder's block indices), so the structure is the published one and only the widths
  (base_dim, z_dim) are read from the file.
- T5: neither diffusers nor transformers ships a converter for Wan's T5 module (diffusers'
  `scripts/convert_wan_to_diffusers.py` takes google/umt5-xxl from the hub instead), so
  `t5_key` (original_keys.py) maps its names onto transformers' `UMT5EncoderModel`: a one-to-one
  rename, no tensor changes (Wan's gated FFN `fc1(x) * gelu_tanh(gate(x))` is UMT5's
  `wi_1(x) * gelu_new(wi_0(x))`; each block owns its relative position bias in both).
- CLIP image encoder (I2V, models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth):
  no library converter either; `clip_vision_key_names` (original_keys.py) maps its vision tower onto
  transformers' `CLIPVisionModel` (the fused QKV split in three; the text tower unused).
- Refused, with the reason: FLF2V / VACE checkpoints (no pipeline for them here) and
  Wan2.2 checkpoints (two-expert subfolders; the Wan2.2 VAE converter exists only as a
  diffusers script, not in the library). Use their -Diffusers directories.

The official modules' key names and shapes (github.com/Wan-Video/Wan2.1: wan/modules/t5.py,
clip.py, model.py, vae.py) and the T5 / CLIP forwards at tiny configs are recorded in
tests/data/wan21_original_keys.json by benchmarks/oracles/wan_original_layout.py;
tests/models/wan/test_wan_original_values.py loads the same weights through the UMT5 and CLIP
maps and must reproduce those outputs (fp32, CPU: within 1e-5 relative; a swap of two same-shape
tensors fails it).

Every load is strict: a missing, unexpected or misshapen tensor names itself and the file.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn
from safetensors import safe_open

from ...engine.compat.diffusers import keep_in_fp32_modules as diffusers_keep_in_fp32
from ...engine.compat.transformers import keep_in_fp32_modules as transformers_keep_in_fp32
from .original_keys import clip_vision_key_names, t5_key

TRANSFORMER_GLOB = "diffusion_pytorch_model*"
T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
VAE_FILE = "Wan2.1_VAE.pth"
TOKENIZER_DIR = "google/umt5-xxl"
CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
DISTILL_DIR = "distill_models"  # LightX2V: the step-distilled DiT beside the base model's files

_DIFFUSERS_LAYOUT = ("a diffusers-format directory (model_index.json with transformer/, vae/, text_encoder/, "
                     "... as save_pretrained and the Wan-AI/*-Diffusers repositories write)")
_ORIGINAL_LAYOUT = (f"the original Wan release layout (config.json with WanModel's dim/num_heads, "
                    f"{TRANSFORMER_GLOB}.safetensors or .pth, {T5_FILE}, {VAE_FILE}, {TOKENIZER_DIR}/)")


# -- layout detection ------------------------------------------------------------------------
def detect_layout(path: str | Path) -> str:
    """'diffusers' or 'original' for a local Wan checkpoint directory; anything else is a
    ValueError that names both layouts and what the directory holds."""
    path = Path(path)
    if (path / "model_index.json").is_file():
        return "diffusers"
    if (path / "high_noise_model").is_dir() or (path / "low_noise_model").is_dir():
        raise ValueError(f"{str(path)!r} is a Wan2.2 A14B checkpoint in the original layout (high_noise_model/, "
                         "low_noise_model/); only Wan2.1 loads from the original layout. Pass the -Diffusers "
                         "directory (Wan-AI/Wan2.2-T2V-A14B-Diffusers)")
    cfg = _read_config(path) if (path / "config.json").is_file() else None
    weights = _transformer_files(path) or _transformer_files(path, distill=True)
    if cfg is not None and {"dim", "num_heads"} <= set(cfg) and weights:
        return "original"
    held = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()) if path.is_dir() else []
    held = held[:12] + (["..."] if len(held) > 12 else [])
    why = ("config.json has no WanModel fields (dim, num_heads)" if cfg is not None and weights
           else f"no {TRANSFORMER_GLOB}.safetensors/.pth" if cfg is not None else "no model_index.json or config.json")
    raise ValueError(f"{str(path)!r} is not a Wan checkpoint directory in a known layout ({why}; it holds: "
                     f"{', '.join(held) or 'nothing'}). Wan loads {_DIFFUSERS_LAYOUT} or {_ORIGINAL_LAYOUT}")


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path / 'config.json')!r} is not readable JSON ({e}); the original Wan layout "
                         "needs WanModel's config.json") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(path / 'config.json')!r} holds {type(cfg).__name__}, not a JSON object")
    return cfg


def _transformer_files(path: Path, distill: bool = False) -> list[Path]:
    """The DiT's weight files: safetensors shards if any, else one .pth/.pt. distill: LightX2V's
    step-distilled DiT in `distill_models/` (distill_model.safetensors or .pt, or its one file)."""
    if distill:
        d = path / DISTILL_DIR
        named = [d / f"distill_model{x}" for x in (".safetensors", ".pt", ".pth")]
        files = [f for f in named if f.is_file()][:1] or sorted(d.glob("*.safetensors"))
        return files if len(files) == 1 else []
    st = sorted(path.glob(f"{TRANSFORMER_GLOB}.safetensors"))
    return st or sorted(p for p in path.glob(TRANSFORMER_GLOB) if p.suffix in (".pth", ".pt"))


# -- reading tensors --------------------------------------------------------------------------
class _TensorSource:
    """Tensors by name from safetensors shards or a torch pickle, read one at a time (a 14B
    DiT is 57 GB in fp32 on disk: reading lazily and casting each tensor keeps the peak at
    the loaded model's size)."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._where: dict[str, Any] = {}
        for f in files:
            if f.suffix == ".safetensors":
                handle = safe_open(str(f), framework="pt")
                for k in handle.keys():
                    self._where[k] = (handle, f)
            else:
                sd = self._load_pickle(f)
                if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                    raise ValueError(f"{str(f)!r} is not a flat state dict of tensors (got {type(sd).__name__}); "
                                     "save the model's state_dict() itself")
                for k, v in sd.items():
                    self._where[k] = (v, f)

    @staticmethod
    def _load_pickle(f: Path):
        """torch.load(weights_only=True), mapped where the file allows; a pickle holding other
        objects than tensors is refused in our words (torch's own message is advice about
        torch.load arguments, with terminal colour codes)."""
        try:
            try:  # mmap: the 11 GB T5 is paged in as it is read, not copied up front
                return torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # a legacy (pre-zipfile) torch.save cannot be mapped
                if "mmap" not in str(e):
                    raise
                return torch.load(str(f), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            what = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            raise ValueError(f"{str(f)!r} holds objects other than tensors"
                             f"{f' ({what.group(1)})' if what else ''}, which are not loaded (it could run code); "
                             "save the model's state_dict() of tensors alone (torch.save(model.state_dict(), ...))"
                             ) from e

    @classmethod
    def from_dict(cls, state: Mapping[str, torch.Tensor], name: str = "<state dict>") -> "_TensorSource":
        src = cls([])
        src.files = [Path(name)]
        src._where = {k: (v, Path(name)) for k, v in state.items()}
        return src

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, key: str) -> Path:
        return self._where[key][1]

    def get(self, key: str) -> torch.Tensor:
        obj, f = self._where[key]
        if isinstance(obj, torch.Tensor):
            return obj
        try:
            return obj.get_tensor(key)
        except Exception as e:  # a truncated shard raises safetensors' own error type
            raise ValueError(f"{str(f)!r}: cannot read tensor {key!r} ({e}); the file is damaged or truncated") from e


def _open(files: list[Path]) -> _TensorSource:
    try:
        return _TensorSource(files)
    except ValueError:
        raise
    except Exception as e:  # safetensors / pickle errors for a damaged file
        raise ValueError(f"cannot read {', '.join(repr(str(f)) for f in files)} ({type(e).__name__}: "
                         f"{_plain(e)}); the file is damaged, truncated or not a checkpoint") from e


def _plain(e: BaseException) -> str:
    """An error's first line without terminal colour codes (torch's messages carry some)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    return (text.splitlines() or [type(e).__name__])[0].rstrip(". ")


def load_error(variant_name: str, source: str | Path, e: BaseException) -> ValueError:
    """The error of a load from an original-layout directory: what is wrong (naming the file),
    then advice for this layout (the advice for directories save_pretrained writes does not
    fit it)."""
    return ValueError(f"{variant_name}: cannot load the original-layout Wan checkpoint in {str(source)!r}: "
                      f"{_plain(e)}. Put the file named in place as the Wan-AI Wan2.1 repository ships it (or fix "
                      "config.json to describe the files), or pass weights='random' (CLI: --weights random) "
                      "for the published config with random weights")


def _library_names_error(what: str, src: "_TensorSource", model: nn.Module, own: str, example: str) -> ValueError:
    """A file whose tensors are named as the library class we load into names them (what
    save_pretrained / state_dict() of that class write), not as the original release does."""
    cls = type(model)
    lib = cls.__module__.split(".")[0]
    files = ", ".join(repr(str(f)) for f in sorted(set(src.files)))
    return ValueError(f"{what} in {files}: the file holds {lib}' {cls.__name__} names (e.g. {own!r}), not the "
                      f"original Wan release's names (e.g. {example!r}) that this layout reads (a model saved with "
                      f"{lib}' names loads as a diffusers-format directory: model_index.json with transformer/, "
                      "text_encoder/, vae/)")


# -- strict load into an empty model ----------------------------------------------------------
def _dtype_for(name: str, dtype: torch.dtype, keep_fp32: tuple[str, ...]) -> torch.dtype:
    """diffusers' from_pretrained rule: a tensor whose dotted name contains a
    `_keep_in_fp32_modules` entry as one segment stays float32, every other float becomes
    `dtype` (diffusers.models.model_loading_utils.load_model_dict_into_meta)."""
    return torch.float32 if any(m in name.split(".") for m in keep_fp32) else dtype


def _load_strict(model: nn.Module, names: Mapping[str, Any], src: _TensorSource, what: str,
                 dtype: torch.dtype, keep_fp32: tuple[str, ...] = (), *, example: str) -> nn.Module:
    """Fill `model` (built with empty weights) from `src`: `names` maps each of the model's
    state-dict keys to the key in the file, or to (key, function of the file's tensor) where
    the layouts differ (a fused QKV split in three). Missing / unexpected / misshapen tensors
    are one error naming the first of each and the file; a file named in the model class's own
    names (not the original release's: `example` is one of those) is said to be so."""
    names = {k: v if isinstance(v, tuple) else (v, None) for k, v in names.items()}
    expected = model.state_dict()
    missing = [k for k in expected if k not in names]
    unexpected = [names[k][0] for k in names if k not in expected]
    if missing or unexpected:
        own = set(src.keys()) & set(expected)
        if 2 * len(own) > len(src.keys()):
            raise _library_names_error(what, src, model, min(own), example)
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) the model needs are not in the file (first: {missing[0]!r})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensor(s) in the file have no place in the model (first: {unexpected[0]!r})")
        files = sorted({str(f) for f in src.files})
        raise ValueError(f"{what} in {', '.join(map(repr, files))}: {'; '.join(parts)}. The file is not a "
                         "Wan2.1 checkpoint of this kind, or the config.json beside it does not describe it")
    state = {}
    for k, want in expected.items():
        key, transform = names[k]
        t = src.get(key) if transform is None else transform(src.get(key))
        if tuple(t.shape) != tuple(want.shape):
            raise ValueError(f"{what} in {str(src.file_of(key))!r}: tensor {key!r} has shape "
                             f"{tuple(t.shape)} but the model expects {tuple(want.shape)} (from config.json and "
                             "the published structure)")
        # copy=True: a tensor of its own, in freshly allocated (aligned) memory, not a view into
        # the file's buffer (a safetensors read or an mmap'd pickle).
        state[k] = t.to(dtype=_dtype_for(k, dtype, keep_fp32) if t.is_floating_point() else t.dtype, copy=True)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _empty(factory):
    """Build a module with parameters on the meta device (no memory, no init) and real
    buffers (RoPE tables are computed at construction and are not in the checkpoint)."""
    from accelerate import init_empty_weights  # lazy: accelerate costs ~1 s; only loads from files use it

    with init_empty_weights():
        return factory()


# -- the DiT ----------------------------------------------------------------------------------
def transformer_config(original: Mapping[str, Any], src: _TensorSource | None = None) -> dict[str, Any]:
    """WanTransformer3DModel kwargs from WanModel's config.json (+ the weights, for the fields
    WanModel does not write to config.json). Refuses what diffusers' Wan DiT cannot run."""
    cfg = dict(original)
    model_type = cfg.get("model_type", "t2v")
    if model_type == "ti2v":
        raise ValueError("config.json says model_type='ti2v' (Wan2.2-TI2V-5B): only Wan2.1 loads from the original "
                         "layout (the Wan2.2 VAE's converter is a diffusers script, not part of the library). Pass "
                         "the -Diffusers directory (Wan-AI/Wan2.2-TI2V-5B-Diffusers)")
    if model_type not in ("t2v", "i2v"):
        raise ValueError(f"config.json says model_type={model_type!r}: Wan2.1 text-to-video (t2v) and image-to-video "
                         "(i2v) checkpoints load from the original layout; FLF2V and VACE have no diffusers pipeline "
                         "here. Pass the -Diffusers directory")
    if tuple(cfg.get("window_size", (-1, -1))) != (-1, -1):
        raise ValueError(f"config.json sets window_size={cfg['window_size']}: local-window attention has no "
                         "counterpart in diffusers' WanTransformer3DModel")
    dim, heads = int(cfg["dim"]), int(cfg["num_heads"])
    if dim % heads:
        raise ValueError(f"config.json: dim={dim} is not divisible by num_heads={heads}")
    keys = set(src.keys()) if src is not None else set()
    strip = "model.diffusion_model." if any(k.startswith("model.diffusion_model.") for k in keys) else ""
    shape = lambda k: tuple(src.get(strip + k).shape) if strip + k in keys else None  # noqa: E731
    text_w, patch_w = shape("text_embedding.0.weight"), shape("patch_embedding.weight")
    # I2V: the CLIP tokens go through img_emb (LayerNorm(1280) first) and each block's own
    # K/V projections k_img / v_img (dim -> dim); WanModel hard-codes the 1280.
    image = dict(image_dim=1280, added_kv_proj_dim=dim) if model_type == "i2v" else {}
    has_image = any(k.startswith(strip + "img_emb.") or ".k_img." in k for k in keys)
    if keys and has_image != bool(image):
        files = ", ".join(repr(str(f)) for f in sorted(set(src.files)))
        held = ("an image-to-video DiT (img_emb.* and k_img tensors)" if has_image
                else "a text-to-video DiT (no img_emb.* or k_img tensors)")
        raise ValueError(f"config.json says model_type={model_type!r} but {files} holds {held}: put the "
                         f"{'image' if image else 'text'}-to-video DiT beside this config.json, or fix its "
                         "model_type ('t2v' or 'i2v') to describe the file")
    if image and keys:
        image = dict(image_dim=shape("img_emb.proj.0.weight")[0],
                     added_kv_proj_dim=shape("blocks.0.cross_attn.k_img.weight")[1])
    return dict(**image,
        patch_size=tuple(patch_w[2:]) if patch_w else tuple(cfg.get("patch_size", (1, 2, 2))),
        num_attention_heads=heads, attention_head_dim=dim // heads,
        in_channels=int(cfg.get("in_dim", 16)), out_channels=int(cfg.get("out_dim", 16)),
        text_dim=text_w[1] if text_w else int(cfg.get("text_dim", 4096)),
        freq_dim=int(cfg.get("freq_dim", 256)), ffn_dim=int(cfg["ffn_dim"]), num_layers=int(cfg["num_layers"]),
        # WanModel's defaults are qk_norm=True, cross_attn_norm=True; the weights say which is used.
        cross_attn_norm=(strip + "blocks.0.norm3.weight" in keys) if keys else bool(cfg.get("cross_attn_norm", True)),
        qk_norm=("rms_norm_across_heads" if ((strip + "blocks.0.self_attn.norm_q.weight" in keys) if keys
                                              else cfg.get("qk_norm", True)) else None),
        eps=float(cfg.get("eps", 1e-6)),
        # WanModel's RoPE table has 1024 positions (`rope_params(1024, ...)`).
        rope_max_seq_len=1024,
    )


def transformer_key_names(original_keys: list[str]) -> dict[str, str]:
    """diffusers key -> original key, by diffusers' own converter. It only renames (for
    Wan2.1's keys), so it is run on the names themselves: the tensors are then read one by
    one (see `_TensorSource`)."""
    # lazy: diffusers costs seconds
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers({k: k for k in original_keys})


def load_transformer(path: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                     config: Mapping[str, Any] | None = None, distill: bool = False):
    """WanTransformer3DModel from an original-layout directory (config.json + the DiT's
    weight files; distill: LightX2V's distilled DiT in distill_models/); `config` replaces
    config.json (original names)."""
    path = Path(path)
    files = _transformer_files(path, distill)
    if not files:
        raise ValueError(f"{str(path)!r}: no " + (f"{DISTILL_DIR}/distill_model.safetensors or .pt (LightX2V's "
                         "step-distilled DiT, in the original Wan names)" if distill else
                         f"{TRANSFORMER_GLOB}.safetensors or .pth (the Wan DiT's weights)"))
    return _transformer(_open(files), config if config is not None else _read_config(path), dtype, device)


def transformer_from_state_dict(state: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                                dtype: torch.dtype, device: torch.device | str = "cpu"):
    """WanTransformer3DModel from a state dict in the original key naming (e.g. a training
    checkpoint's DiT; a `model.diffusion_model.` prefix is accepted) and WanModel's config
    (original names, as in config.json). Strict, like the directory load."""
    return _transformer(_TensorSource.from_dict(state), config, dtype, device)


def _transformer(src: _TensorSource, config: Mapping[str, Any], dtype: torch.dtype, device):
    from diffusers import WanTransformer3DModel  # lazy: diffusers costs seconds

    cfg = transformer_config(config, src)
    model = _empty(lambda: WanTransformer3DModel(**cfg))
    keep = diffusers_keep_in_fp32(WanTransformer3DModel)
    _load_strict(model, transformer_key_names(src.keys()), src, "the Wan DiT", dtype, keep,
                 example="blocks.0.self_attn.q.weight")
    return model.to(device)


# -- the VAE ----------------------------------------------------------------------------------
def load_vae(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """AutoencoderKLWan from Wan2.1_VAE.pth via diffusers' `convert_wan_vae_to_diffusers`
    (the published structure; base_dim and z_dim read from the file)."""
    from diffusers import AutoencoderKLWan  # lazy: diffusers costs seconds
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers  # lazy: as above

    file = Path(path)
    src = _open([file])
    keys = src.keys()
    if "encoder.conv_in.weight" in keys:
        raise _library_names_error("the Wan VAE", src, _empty(AutoencoderKLWan), "encoder.conv_in.weight",
                                   "encoder.conv1.weight")
    if "encoder.conv1.weight" not in keys or "conv2.weight" not in keys:
        raise ValueError(f"{str(file)!r} is not a Wan2.1 VAE checkpoint (no encoder.conv1.weight / conv2.weight)")
    base_dim, z_dim = src.get("encoder.conv1.weight").shape[0], src.get("conv2.weight").shape[0]
    model = _empty(lambda: AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim))
    _load_strict(model, convert_wan_vae_to_diffusers({k: k for k in keys}), src, "the Wan VAE", dtype,
                 example="encoder.conv1.weight")
    return model.to(device)


# -- the T5 text encoder ------------------------------------------------------------------------
# The key map: `original_keys.t5_key`.


def load_text_encoder(path: str | Path, config: Mapping[str, Any], *, dtype: torch.dtype,
                      device: torch.device | str = "cpu"):
    """UMT5EncoderModel (config: UMT5Config kwargs, the variant's) from Wan's T5 .pth."""
    from transformers import UMT5Config, UMT5EncoderModel  # lazy: transformers costs seconds

    file = Path(path)
    src = _open([file])
    names: dict[str, str] = {}
    for k in src.keys():
        for new in t5_key(k) or [f"<no UMT5 counterpart for {k}>"]:
            names[new] = k
    model = _empty(lambda: UMT5EncoderModel(UMT5Config(**config)))
    # transformers keeps `_keep_in_fp32_modules` (T5's `wo`) in fp32 only for fp16 loads.
    keep = transformers_keep_in_fp32(model) if dtype == torch.float16 else ()
    _load_strict(model, names, src, "the UMT5 text encoder", dtype, keep, example="blocks.0.attn.q.weight")
    model.tie_weights()
    return model.to(device)


# -- the CLIP image encoder (I2V) -----------------------------------------------------------------
# The key map: `original_keys.clip_vision_key_names`.


def load_image_encoder(path: str | Path, config: Mapping[str, Any], *, dtype: torch.dtype,
                       device: torch.device | str = "cpu"):
    """CLIPVisionModel (config: CLIPVisionConfig kwargs, the variant's) from Wan's open-clip .pth."""
    from transformers import CLIPVisionConfig, CLIPVisionModel  # lazy: transformers costs seconds

    file = Path(path)
    src = _open([file])
    model = _empty(lambda: CLIPVisionModel(CLIPVisionConfig(**config)))
    names = clip_vision_key_names(src.keys())
    if not any(k.startswith("vision_model.") for k in model.state_dict()):
        # This transformers' CLIPVisionModel holds the tower's modules itself (older ones hold
        # them under `vision_model`, the name checkpoints use): map onto whichever it has.
        names = {k.removeprefix("vision_model."): v for k, v in names.items()}
    return _load_strict(model, names, src, "the CLIP image encoder", dtype,
                        example="visual.transformer.0.attn.to_qkv.weight").to(device)


# -- the whole pipeline -------------------------------------------------------------------------
def load_pipeline(path: str | Path, variant_config: Mapping[str, Any], *, dtype: torch.dtype,
                  device: torch.device | str, variant_name: str = "this variant", distill: bool = False):
    """WanPipeline (T2V) or WanImageToVideoPipeline (I2V) from an original-layout directory.
    `variant_config` supplies what the layout does not hold: the UMT5 config
    (`text_encoder`), the scheduler config and, for I2V, the CLIP vision config
    (`image_encoder`); the checkpoint's task must be the variant's."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline  # lazy: costs seconds
    from transformers import AutoTokenizer, CLIPImageProcessor  # lazy: as diffusers

    path = Path(path)
    # The DiT's config first: a checkpoint of another kind is refused for what it is, before
    # any file is missed or 10 GB of T5 is read.
    cfg = _read_config(path)
    transformer_config(cfg)
    i2v = cfg.get("model_type", "t2v") == "i2v"
    if i2v != ("image_encoder" in variant_config):
        task = "image-to-video" if i2v else "text-to-video"
        raise ValueError(f"{str(path)!r} holds {'an' if i2v else 'a'} {task} checkpoint (config.json model_type="
                         f"{cfg.get('model_type')!r}) "
                         f"but {variant_name} is {'text' if i2v else 'image'}-to-video; load it with "
                         f"{'an' if i2v else 'a'} {task} variant (magi-zoo list)")
    need = [n for n in (T5_FILE, VAE_FILE) + ((CLIP_FILE,) if i2v else ()) if not (path / n).is_file()]
    if not (path / TOKENIZER_DIR).is_dir():
        need.append(TOKENIZER_DIR + "/")
    if need:
        raise ValueError(f"{str(path)!r} is in the original Wan layout but lacks {', '.join(need)}; the Wan-AI "
                         "Wan2.1 repositories ship all of them beside the DiT")
    transformer = load_transformer(path, dtype=dtype, device=device, distill=distill)
    text_encoder = load_text_encoder(path / T5_FILE, variant_config["text_encoder"], dtype=dtype, device=device)
    vae = load_vae(path / VAE_FILE, device=device)  # fp32, as published
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path / TOKENIZER_DIR), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path / TOKENIZER_DIR)!r}: cannot load the tokenizer ({e})") from e
    scheduler = UniPCMultistepScheduler(**variant_config["scheduler"])
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer)
    if not i2v:
        return WanPipeline(**parts)
    image_encoder = load_image_encoder(path / CLIP_FILE, variant_config["image_encoder"], dtype=dtype, device=device)
    # The layout has no preprocessor config; CLIPImageProcessor's defaults are CLIP's 224-pixel
    # resize + center crop with OpenAI's mean / std, as the -Diffusers repositories ship.
    # (Wan's own code resizes to 224x224 without a crop; diffusers' pipeline crops.)
    processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    return WanImageToVideoPipeline(image_encoder=image_encoder, image_processor=processor, **parts)
