"""Parity of our tiny BAGEL with the official implementation, on values the official code
produced.

tests/data/bagel_tiny_parity.json is written by benchmarks/oracles/bagel_model.py: bagel-tiny
(random weights, seeded at build, as `_tiny()` builds it here) saved in the official layout and
loaded strictly by the official model code (ByteDance-Seed/Bagel, the commit in the file's
"source"), which runs every case below through its `InterleaveInferencer` on CPU in fp32 (the
oracle's docstring lists what stands in for flash-attn and the bf16 casts around it). The test
runs the same cases through our pipeline: texts and token ids must be equal, the float images
(8x8-pixel means) equal to float rounding. docs/testing.md says how to regenerate the file.
"""

from __future__ import annotations

import json

import torch

from benchmarks.oracles.bagel_model import (EDIT, PROMPTS, QUESTION, SEEDS, SIZES, T2I, THINK_TOKENS,
                                            UNDERSTAND_TOKENS, input_images, pooled)
from helpers import DATA as DATA_DIR

DATA = DATA_DIR / "bagel_tiny_parity.json"


def produce(pipe) -> dict:
    """Every case of the oracle, through our pipeline."""
    img, rgba = input_images()
    t2i = dict(T2I, cfg_interval=tuple(T2I["cfg_interval"]))
    out = {"prompt_ids": pipe.text_ids(PROMPTS["ids"]).tolist()}
    ctx = pipe.contexts([img, QUESTION], vae=False).full
    out["understand_tokens"] = pipe.generate_tokens(ctx, UNDERSTAND_TOKENS)
    out["understand"] = pipe.understand(img, QUESTION, max_new_tokens=UNDERSTAND_TOKENS)
    out["understand_think"] = pipe.understand(img, QUESTION, max_new_tokens=UNDERSTAND_TOKENS, think=True)
    h, w = SIZES["t2i"]
    out["t2i"] = pooled(pipe(PROMPTS["t2i"], height=h, width=w, seed=SEEDS["t2i"], output_type="pt", **t2i))
    out["edit"] = pooled(pipe(PROMPTS["edit"], image=img, seed=SEEDS["edit"], output_type="pt", **EDIT))
    out["edit_rgba"] = pooled(pipe(PROMPTS["edit"], image=rgba, seed=SEEDS["edit_rgba"], output_type="pt", **EDIT))
    h, w = SIZES["t2i_think"]
    r = pipe(PROMPTS["t2i"], think=True, height=h, width=w, seed=SEEDS["t2i_think"], max_think_tokens=THINK_TOKENS,
             output_type="pt", **t2i)
    out["t2i_think"] = {"text": r.text, "image": pooled(r.image)}
    r = pipe(PROMPTS["edit_think"], image=img, think=True, seed=SEEDS["edit_think"], max_think_tokens=THINK_TOKENS,
             output_type="pt", **EDIT)
    out["edit_think"] = {"text": r.text, "image": pooled(r.image)}
    return out


def _tiny():
    import magi_zoo

    return magi_zoo.load("bagel-tiny", gpu="cpu", compile=False).pipe


def test_tiny_bagel_matches_the_official_code():
    want = json.loads(DATA.read_text())
    assert "note" not in want and len(want["source"]["commit"]) == 40, "regenerate the file with the oracle"
    cases = want["source"]["cases"]
    assert (cases["t2i"], cases["seeds"], cases["prompts"]) == (T2I, SEEDS, PROMPTS), \
        "the file was written for other cases: regenerate it with benchmarks/oracles/bagel_model.py"
    got = produce(_tiny())
    for key in ("prompt_ids", "understand_tokens", "understand", "understand_think"):
        assert got[key] == want[key], key
    for key in ("t2i_think", "edit_think"):
        assert got[key]["text"] == want[key]["text"], key
    for key, g, w in (("t2i", got["t2i"], want["t2i"]), ("edit", got["edit"], want["edit"]),
                      ("edit_rgba", got["edit_rgba"], want["edit_rgba"]),
                      ("t2i_think", got["t2i_think"]["image"], want["t2i_think"]["image"]),
                      ("edit_think", got["edit_think"]["image"], want["edit_think"]["image"])):
        # 8x8 means of fp32 images in [0, 1], rounded to 6 decimals: float rounding is ~1e-6
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=2e-5, rtol=1e-4, msg=key)
