"""Parity of our tiny BAGEL with the official implementation, through values our own model
produces (the official code is not a dependency, so its outputs cannot be recomputed here).

How the expected values were checked (tests/data/bagel_tiny_parity.json, "note"): bagel-tiny
was saved in the official layout (`save_pretrained`: llm_config.json, vit_config.json,
ema.safetensors, ae.safetensors, tokenizer), the official repository (ByteDance-Seed/Bagel
@056b5fd: modeling/bagel, modeling/autoencoder.py at bagel-tiny's sizes, inferencer.py
InterleaveInferencer, data/transforms.py ImageTransform with bagel-tiny's rules) loaded it with
strict=True in a scratch directory (transformers 4.49; flash_attn_varlen_func replaced by
per-segment SDPA on CPU and its bf16 casts by fp32, for an fp32 comparison), and both ran the
inputs below with the same seeds (global torch RNG there, a CPU generator here: the same
stream). Result: every text (understanding, understanding + think, the plans of think +
generate and think + edit) identical; PNGs identical for editing (RGB and RGBA input) and
think mode, and for text-to-image 1 pixel value of 4,608 off by one (truncation at a
boundary); the float images before uint8 agree to 4.5e-7 (text-to-image) and 5.2e-7 (edit)
relative, max 1.9e-6 absolute.

Regenerate the expected values (only after re-checking against the official code):
    python tests/test_bagel_parity.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from helpers import DATA as DATA_DIR

DATA = DATA_DIR / "bagel_tiny_parity.json"
T2I = dict(num_inference_steps=4, timestep_shift=3.0, cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=(0.0, 1.0),
           cfg_renorm_type="global", cfg_renorm_min=0.0)
EDIT = dict(num_inference_steps=4)  # the variant's editing defaults otherwise (cfg_img 2.0, text_channel, (0, 1])
QUESTION = "what is in the picture?"


def _inputs():
    from PIL import Image

    rs = np.random.RandomState(0)
    img = Image.fromarray((rs.rand(50, 70, 3) * 255).astype("uint8"))
    rgba = Image.fromarray((rs.rand(40, 60, 4) * 255).astype("uint8"), "RGBA")
    return img, rgba


def _pooled(t: torch.Tensor) -> list:
    """[3, H, W] in [0, 1] -> 8x8-pixel means, rounded (a compact fingerprint of the image)."""
    return torch.nn.functional.avg_pool2d(t[None].float(), 8)[0].round(decimals=6).tolist()


def produce(pipe) -> dict:
    """Every task on the fixed inputs; what the JSON stores."""
    img, rgba = _inputs()
    out = {"prompt_ids": pipe.text_ids("a red fox").tolist()}
    ctx = pipe.contexts([img, QUESTION], vae=False).full
    out["understand_tokens"] = pipe.generate_tokens(ctx, 12)
    out["understand"] = pipe.understand(img, QUESTION, max_new_tokens=12)
    out["understand_think"] = pipe.understand(img, QUESTION, max_new_tokens=12, think=True)
    out["t2i"] = _pooled(pipe("a red fox", height=48, width=32, seed=3, output_type="pt", **T2I))
    out["edit"] = _pooled(pipe("make the sky purple", image=img, seed=5, output_type="pt", **EDIT))
    out["edit_rgba"] = _pooled(pipe("make the sky purple", image=rgba, seed=6, output_type="pt", **EDIT))
    r = pipe("a red fox", think=True, height=32, width=32, seed=7, max_think_tokens=6, output_type="pt", **T2I)
    out["t2i_think"] = {"text": r.text, "image": _pooled(r.image)}
    r = pipe("make it blue", image=img, think=True, seed=8, max_think_tokens=6, output_type="pt", **EDIT)
    out["edit_think"] = {"text": r.text, "image": _pooled(r.image)}
    return out


def _tiny():
    import magi_zoo

    return magi_zoo.load("bagel-tiny", gpu="cpu", compile=False).pipe


def test_tiny_bagel_matches_the_values_checked_against_the_official_code():
    want = json.loads(DATA.read_text())
    got = produce(_tiny())
    for key in ("prompt_ids", "understand_tokens", "understand", "understand_think"):
        assert got[key] == want[key], key
    for key in ("t2i_think", "edit_think"):
        assert got[key]["text"] == want[key]["text"], key
    for key, g, w in (("t2i", got["t2i"], want["t2i"]), ("edit", got["edit"], want["edit"]),
                      ("edit_rgba", got["edit_rgba"], want["edit_rgba"]),
                      ("t2i_think", got["t2i_think"]["image"], want["t2i_think"]["image"]),
                      ("edit_think", got["edit_think"]["image"], want["edit_think"]["image"])):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=2e-5, rtol=1e-4, msg=key)


if __name__ == "__main__" and "--write" in sys.argv:
    old = json.loads(DATA.read_text()) if DATA.is_file() else {}
    data = {"note": old.get("note", "see tests/test_bagel_parity.py"), **produce(_tiny())}
    DATA.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {DATA}")
