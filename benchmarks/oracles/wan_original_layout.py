"""Oracle: the official Wan2.1 modules' key names and shapes, and the T5 / CLIP outputs.

Usage::

    python benchmarks/oracles/wan_original_layout.py PATH/TO/Wan-Video/Wan2.1 [OUT.json] [COMMIT]

writes (default) tests/data/wan21_original_keys.json, which tests/models/wan/test_wan_layouts.py
(names and shapes) and tests/models/wan/test_wan_original_values.py (values) read.

What it does, with the official code on the CPU in float32:
- builds each official module at the tiny configs below (`wan/modules/model.py` WanModel t2v
  and i2v, `vae.py` WanVAE_, `t5.py` T5Encoder, `clip.py` VisionTransformer: the I2V image
  encoder's vision tower, keys under `visual.`) and records every state-dict key and shape;
- for the UMT5 and CLIP maps (the two no library ships) and the DiT / VAE (diffusers'
  converters): fills the official T5Encoder, VisionTransformer, WanModel (t2v) and WanVAE_
  with `seeded_state` (deterministic weights from the recorded names and
  shapes; the value test rebuilds the same tensors without the official code), runs their
  forwards on seeded inputs (T5: token ids with a padding mask; CLIP: one image through the
  first blocks, `use_31_block=True`, what the I2V pipeline reads; DiT: one latent, timestep and
  text; VAE: a 5-frame clip encoded to its latent mean and decoded, clamped as WanVAE.decode
  clamps) and records the outputs.
  The value test loads the same weights through our key maps into transformers' modules and
  compares: a swap of two same-shape tensors (q/k/v/o, wi_0/wi_1) changes the output.

Imports, the only things replaced: the modules are imported from `wan/modules/` directly
(a bare `wan` / `wan.modules` package, so `wan/__init__.py`'s pipeline imports and their
dependencies are not needed); `torch.cuda.current_device` answers "cpu" while t5.py is imported
(a default argument of its T5EncoderModel wrapper, unused here, calls it at import); without
torchvision installed, an empty `torchvision.transforms` stands in (clip.py imports it for the
preprocessing of its `_clip` factory, which is not called here); and `flash_attention` in clip.py / model.py (flash-attn, CUDA and
bf16 / fp16 only: it asserts both) is replaced by `scaled_dot_product_attention` in the inputs'
dtype, the same softmax(q k^T / sqrt(d)) v without masks, as the official calls use it here.
No other official line is changed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import torch

T5_PY = "wan/modules/t5.py"
CONFIGS = {  # part -> (module file, class, kwargs): the tiny configs of the tests
    "transformer": ("model", "WanModel", dict(model_type="t2v", text_len=16, in_dim=16, dim=32, ffn_dim=64,
                                              freq_dim=32, text_dim=32, out_dim=16, num_heads=2, num_layers=4)),
    # the published VAE's structure (vae.py _video_vae) at width 4
    "vae": ("vae", "WanVAE_", dict(dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                   temperal_downsample=[False, True, True], dropout=0.0)),
    "t5": ("t5", "T5Encoder", dict(vocab=512, dim=32, dim_attn=32, dim_ffn=64, num_heads=4, num_layers=2,
                                   num_buckets=8, shared_pos=False)),
    "i2v_transformer": ("model", "WanModel", dict(model_type="i2v", text_len=16, in_dim=36, dim=32, ffn_dim=64,
                                                  freq_dim=32, text_dim=32, out_dim=16, num_heads=2, num_layers=4)),
    # the tiny I2V variant's image encoder: CLIP-H's width (the I2V DiT reads 1280-d tokens),
    # 2 blocks of a narrow MLP (mlp_ratio 0.1: 128), CLIP-H's gelu
    "clip_visual": ("clip", "VisionTransformer", dict(image_size=224, patch_size=14, dim=1280, mlp_ratio=0.1,
                                                      out_dim=1024, num_heads=16, num_layers=2, pool_type="token",
                                                      pre_norm=True, post_norm=False, activation="gelu")),
}
SEED = 0
T5_BATCH, T5_LEN, T5_VALID = 2, 16, (16, 11)  # the second prompt padded after 11 tokens
CLIP_STRIDE = (8, 32)  # recorded CLIP output: every 8th token, every 32nd channel (33 x 40 values)


def seeded_state(shapes: dict[str, list[int]], seed: int = SEED) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights for the given names and shapes (sorted-name order, one
    generator): matrices ~ N(0, 1 / fan_in), norm weights ~ 1 + N(0, 0.1^2), other vectors
    ~ N(0, 0.1^2). Scaled so a two-block forward stays in range and every tensor matters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in sorted(shapes):
        shape = shapes[k]
        t = torch.randn(shape, generator=g)
        if len(shape) >= 2:
            out[k] = t / math.sqrt(math.prod(shape[1:]))
        else:
            out[k] = 0.1 * t + (1.0 if "norm" in k and k.endswith("weight") else 0.0)
    return out


def seeded_inputs(seed: int = SEED) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, CONFIGS["t5"][2]["vocab"], (T5_BATCH, T5_LEN), generator=g)
    mask = torch.stack([torch.arange(T5_LEN) < n for n in T5_VALID]).long()
    image = torch.randn(1, 3, 224, 224, generator=g)
    # the T2V DiT: a 2 x 4 x 4 latent (8 tokens after 1 x 2 x 2 patches), 16 text tokens (its text_len)
    dit = dict(dit_x=torch.randn(16, 2, 4, 4, generator=g), dit_t=torch.tensor([731.0]),
               dit_context=torch.randn(16, 32, generator=g))
    # the VAE: 5 frames (1 + 4k) of 16 x 16 pixels -> a 2 x 2 x 2 latent
    return dict(t5_ids=ids, t5_mask=mask, clip_image=image, vae_video=torch.randn(1, 3, 5, 16, 16, generator=g), **dit)


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    """A float64 sum over all values: says when a torch release draws other random numbers."""
    return float(sum(t.double().abs().sum() for t in tensors.values()))


def _sdpa_flash_attention(q, k, v, *args, dropout_p=0.0, causal=False, **kw):
    """[B, L, N, D] in, [B, L, N, D] out: flash_attention's math without its CUDA kernel."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, is_causal=causal)
    return o.transpose(1, 2).contiguous()


def import_official(repo: Path) -> dict[str, types.ModuleType]:
    for name, path in (("wan", repo / "wan"), ("wan.modules", repo / "wan" / "modules")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # t5.py's T5EncoderModel default argument, evaluated at import
    try:
        # first the modules that import transformers / diffusers, which probe for torchvision
        mods = {m: importlib.import_module(f"wan.modules.{m}") for m in ("t5", "model", "vae")}
    finally:
        torch.cuda.current_device = current_device
    stub = importlib.util.find_spec("torchvision") is None  # clip.py's preprocessing (_clip) only
    if stub:
        sys.modules["torchvision"] = tv = types.ModuleType("torchvision")
        tv.transforms = sys.modules["torchvision.transforms"] = types.ModuleType("torchvision.transforms")
    try:
        mods["clip"] = importlib.import_module("wan.modules.clip")
    finally:
        if stub:
            del sys.modules["torchvision"], sys.modules["torchvision.transforms"]
    for m in ("clip", "model"):
        mods[m].flash_attention = _sdpa_flash_attention
    return mods


def run(repo: Path, commit: str = "unknown") -> dict:
    torch.set_default_dtype(torch.float32)
    mods = import_official(repo)
    out: dict = {}
    for part, (mod, cls, kw) in CONFIGS.items():
        torch.manual_seed(0)
        m = getattr(mods[mod], cls)(**kw).eval()
        out[part] = dict(config=kw, keys={k: list(v.shape) for k, v in m.state_dict().items()})
    x = seeded_inputs()
    with torch.no_grad():
        t5 = getattr(mods["t5"], "T5Encoder")(**CONFIGS["t5"][2]).eval()
        w = seeded_state(out["t5"]["keys"])
        t5.load_state_dict(w, strict=True)
        out["t5"]["values"] = dict(weights_checksum=checksum(w), inputs_checksum=checksum({k: x[k] for k in ("t5_ids",)}),
                                   ids=x["t5_ids"].tolist(), mask=x["t5_mask"].tolist(),
                                   output=t5(x["t5_ids"], x["t5_mask"]).tolist())
        clip = getattr(mods["clip"], "VisionTransformer")(**CONFIGS["clip_visual"][2]).eval()
        w = seeded_state({"visual." + k: s for k, s in out["clip_visual"]["keys"].items()})
        clip.load_state_dict({k.removeprefix("visual."): v for k, v in w.items()}, strict=True)
        y = clip(x["clip_image"], use_31_block=True)
        out["clip_visual"]["values"] = dict(
            weights_checksum=checksum(w), inputs_checksum=checksum({"i": x["clip_image"]}), use_31_block=True,
            shape=list(y.shape), stride=list(CLIP_STRIDE), norm=float(y.double().norm()),
            output=y[0, ::CLIP_STRIDE[0], ::CLIP_STRIDE[1]].tolist())
        dit = getattr(mods["model"], "WanModel")(**CONFIGS["transformer"][2]).eval()
        w = seeded_state(out["transformer"]["keys"])
        dit.load_state_dict(w, strict=True)
        y = dit([x["dit_x"]], x["dit_t"], [x["dit_context"]], seq_len=8)[0]
        out["transformer"]["values"] = dict(
            weights_checksum=checksum(w), inputs_checksum=checksum({k: x[k] for k in ("dit_x", "dit_context")}),
            t=x["dit_t"].tolist(), seq_len=8, output=y.flatten().tolist(), shape=list(y.shape))
        vae = getattr(mods["vae"], "WanVAE_")(**CONFIGS["vae"][2]).eval()
        w = seeded_state(out["vae"]["keys"])
        vae.load_state_dict(w, strict=True)
        mu = vae.encode(x["vae_video"], [0.0, 1.0])  # scale (0, 1): the raw latent mean
        # WanVAE.decode (the wrapper the pipelines call) clamps WanVAE_.decode's output to [-1, 1]
        video = vae.decode(mu, [0.0, 1.0]).clamp_(-1, 1)
        out["vae"]["values"] = dict(weights_checksum=checksum(w), inputs_checksum=checksum({"v": x["vae_video"]}),
                                    latent=mu.flatten().tolist(), latent_shape=list(mu.shape),
                                    decoded=video.flatten().tolist(), decoded_shape=list(video.shape))
    # state-dict names of the CLIP part carry the `visual.` prefix of the full open-clip model
    out["clip_visual"]["keys"] = {"visual." + k: v for k, v in out["clip_visual"]["keys"].items()}
    note = (f"Written by benchmarks/oracles/wan_original_layout.py from github.com/Wan-Video/Wan2.1 at {commit}: "
            "the official modules' state-dict names and shapes at these tiny configs, and the T5 / CLIP / "
            f"T2V DiT / VAE forwards on seeded weights and inputs (fp32, CPU, torch {torch.__version__}).")
    return {"_note": note, "_commit": commit, **out}


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    repo = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2] / "tests/data/wan21_original_keys.json"
    if not (repo / T5_PY).is_file():
        raise SystemExit(f"{str(repo)!r} has no {T5_PY}: pass a checkout of Wan-Video/Wan2.1")
    out.write_text(json.dumps(run(repo, argv[2] if len(argv) > 2 else "unknown"), indent=0) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
