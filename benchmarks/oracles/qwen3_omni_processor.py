"""Oracle: what the official Qwen3-Omni processor makes of the parity test's audio clip and image.

Usage (in an environment with torchvision and a transformers release that has the processor;
docs/testing.md says how to make one)::

    python benchmarks/oracles/qwen3_omni_processor.py [OUT.json] [PREPROCESSOR_CONFIG.json]

writes (default) tests/data/qwen3_omni_processor_oracle.json, which
tests/models/qwen3_omni/test_qwen3_omni_parity.py checks our inputs against (the placeholder
counts, the image grid and the feature / pixel tensors' sizes and sums).

What runs: transformers' `Qwen3OmniMoeProcessor.__call__` (the official processor: the
placeholder expansion of `replace_multimodal_special_tokens`, transformers'
`_get_feat_extract_output_lengths`, the Qwen2-VL resize and patching, Whisper's log-mel),
built from `WhisperFeatureExtractor`, `Qwen2VLImageProcessor` and `Qwen2VLVideoProcessor`
(the processor requires one; it needs torchvision) configured by the published
preprocessor_config.json of Qwen/Qwen3-Omni-30B-A3B-Instruct: pass the file; without it the
processing fields of that file listed in PUBLISHED below are used. The tokenizer is built
in-process (a word-level vocabulary holding the published special tokens under their published
roles: image_token <|image_pad|>, audio_token <|audio_pad|>, ...): the counts depend on the
roles only, not on the vocabulary, and the token ids the model sees are the test's business.

Inputs (the test's `_inputs`, numpy RandomState(0), drawn in this order): a 40 x 56 RGB image,
then 1 s of audio at 16 kHz (randn * 0.1); and a 1024 x 1280 image (RandomState(1)) (1.3 M pixels: above
Qwen2-VL's default pixel cap of 28*28*1280, below the published 12845056).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_OUT = "tests/data/qwen3_omni_processor_oracle.json"
SOURCE = "Qwen/Qwen3-Omni-30B-A3B-Instruct preprocessor_config.json"
# The processing fields of the published preprocessor_config.json.
PUBLISHED = dict(feature_size=128, hop_length=160, n_fft=400, n_samples=4800000, sampling_rate=16000,
                 nb_max_frames=30000, patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=3136,
                 max_pixels=12845056, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
ROLES = dict(image_token="<|image_pad|>", audio_token="<|audio_pad|>", video_token="<|video_pad|>",
             vision_bos_token="<|vision_start|>", vision_eos_token="<|vision_end|>",
             audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>")
TEXT = "Describe both."
LARGE = (1024, 1280)  # (height, width) of the second image


def parity_inputs():
    """The parity test's image and audio, and the large image (numpy RandomState(0))."""
    import numpy as np  # lazy: the test imports this module's constants without numpy's cost
    from PIL import Image  # lazy: as numpy

    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(40, 56, 3) * 255).astype("uint8"))
    audio = (rng.randn(16000) * 0.1).astype("float32")
    large = Image.fromarray((np.random.RandomState(1).rand(*LARGE, 3) * 255).astype("uint8"))
    return image, audio, large


def prompt() -> str:
    """One audio and one image placeholder, as the published chat template writes them."""
    r = ROLES
    return (f"{r['audio_bos_token']}{r['audio_token']}{r['audio_eos_token']}"
            f"{r['vision_bos_token']}{r['image_token']}{r['vision_eos_token']}{TEXT}")


def processor(config: dict):
    import transformers  # lazy: the oracle's environment
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: as transformers

    specials = sorted(set(ROLES.values()))
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["[UNK]", *specials, *TEXT.split()])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tokenizer = transformers.Qwen2TokenizerFast(tokenizer_object=tok, unk_token="[UNK]", extra_special_tokens=ROLES)
    audio = {k: config[k] for k in ("feature_size", "hop_length", "n_fft", "n_samples", "sampling_rate",
                                    "nb_max_frames") if k in config}
    fe = transformers.WhisperFeatureExtractor(**audio)
    vision = {k: config[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                                     "image_mean", "image_std") if k in config}
    ip = transformers.Qwen2VLImageProcessor(**vision)
    vp = transformers.Qwen2VLVideoProcessor(**vision)
    return transformers.Qwen3OmniMoeProcessor(image_processor=ip, video_processor=vp, feature_extractor=fe,
                                              tokenizer=tokenizer)


def run(config: dict, source: str) -> dict:
    import torch  # lazy: the oracle's environment
    import torchvision  # lazy: the oracle's environment (its version is recorded)
    import transformers  # lazy: the oracle's environment

    proc = processor(config)
    image, audio, large = parity_inputs()
    ids = lambda name: proc.tokenizer.convert_tokens_to_ids(ROLES[name])  # noqa: E731
    out = {"source": {"processor": "transformers.Qwen3OmniMoeProcessor", "transformers": transformers.__version__,
                      "torch": torch.__version__, "torchvision": torchvision.__version__,
                      "preprocessor_config": source, "config": config,
                      "script": "benchmarks/oracles/qwen3_omni_processor.py"}}
    for name, img in (("small", image), ("large", large)):
        enc = proc(text=prompt(), images=[img], audio=[audio], return_tensors="pt")
        input_ids = enc["input_ids"][0]
        out[name] = {
            "image_size": list(img.size[::-1]),  # (height, width)
            "audio_tokens": int((input_ids == ids("audio_token")).sum()),
            "image_tokens": int((input_ids == ids("image_token")).sum()),
            "image_grid_thw": enc["image_grid_thw"].tolist(),
            "mel_frames": int(enc["feature_attention_mask"].sum()),
            "input_features_shape": list(enc["input_features"].shape),
            "input_features_sum": float(enc["input_features"][enc["feature_attention_mask"].bool()[:, None, :]
                                        .expand_as(enc["input_features"])].double().sum()),
            "pixel_values_shape": list(enc["pixel_values"].shape),
            "pixel_values_sum": float(enc["pixel_values"].double().sum()),
            "pixel_values_abs_sum": float(enc["pixel_values"].double().abs().sum()),
        }
    return out


def main(argv: list[str]) -> None:
    out = Path(argv[0] if argv else DEFAULT_OUT)
    if len(argv) > 1:
        config, source = json.loads(Path(argv[1]).read_text()), SOURCE
    else:
        config, source = dict(PUBLISHED), SOURCE + " (its processing fields, as this script's PUBLISHED)"
    data = run(config, source)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
