"""Audio and image prompts for Qwen3-Omni: files -> the tensors its encoders take.

What the official processor (`Qwen3OmniMoeProcessor`) does for one audio clip and one image,
done with its own parts: transformers' `WhisperFeatureExtractor` (128 log-mel bins, 16 kHz)
and Qwen2-VL image processor (patches of the vision config's size, merged 2x2), the
placeholder arithmetic of the processor (audio: transformers' `_get_feat_extract_output_lengths`
of the mel frames; image: grid t*h*w / merge_size^2 tokens), and the published chat template's
`<|audio_start|><|audio_pad|><|audio_end|>` / `<|vision_start|><|image_pad|><|vision_end|>`
markers. The processor class itself is not used: it requires a video processor, which
requires torchvision (not a dependency, absent on the CPU machines). A published checkpoint
directory's own preprocessor config is used when it has one.

Files: `.wav` through the standard library's `wave` (PCM 8/16/24/32-bit; soundfile, when
installed, reads any format it knows); images through PIL, transparency composited on white
as the official `qwen-omni-utils` does.
"""

from __future__ import annotations

import dataclasses
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...engine.compat.transformers import qwen3_omni_audio_output_lengths
from ..images import open_image

AUDIO_RATE = 16000  # the audio encoder's input rate (WhisperFeatureExtractor, published config)
AUDIO_MARK = "<|audio_start|><|audio_pad|><|audio_end|>"
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
# Published Qwen3-Omni image processor (preprocessor_config.json): pixels normalised to
# [-1, 1]; min_pixels 3136 (56*56) and max_pixels 12845056 (3584*3584), not Qwen2-VL's default
# cap of 28*28*1280 = 1,003,520 pixels: a 1024 x 1280 image keeps its 1280 tokens (a 64 x 80
# grid merged 2x2) where that cap would shrink it to 980 (tests/data/qwen3_omni_processor_oracle.json).
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 3584 * 3584


def read_wav(path: str | Path) -> np.ndarray:
    """A sound file as float32 mono in [-1, 1] at AUDIO_RATE (channels averaged, resampled)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--audio {str(path)!r}: no such file")
    try:
        import soundfile  # lazy: optional dependency; any format libsndfile reads

        try:
            data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        except (RuntimeError, TypeError) as e:  # libsndfile's error is a RuntimeError subclass
            raise ValueError(f"--audio {str(path)!r}: not a sound file libsndfile reads ({' '.join(str(e).split())}); "
                             "convert it, e.g. ffmpeg -i in.mp3 -ar 16000 in.wav") from None
    except ImportError:
        if path.suffix.lower() != ".wav":
            raise ValueError(f"--audio {str(path)!r}: without the soundfile package only .wav is read; "
                             "convert it (e.g. ffmpeg -i in.mp3 -ar 16000 in.wav) or pip install soundfile") from None
        data, rate = _read_pcm_wav(path)
    return resample(data.mean(axis=1), rate, AUDIO_RATE)


def _read_pcm_wav(path: Path) -> tuple[np.ndarray, int]:
    try:
        with wave.open(str(path)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise ValueError(f"--audio {str(path)!r}: not a PCM .wav file ({str(e) or type(e).__name__}); convert it, e.g. "
                         "ffmpeg -i in.wav -acodec pcm_s16le out.wav") from e
    if width == 1:  # 8-bit PCM is unsigned
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif width == 3:  # 24-bit: little-endian triplets -> int32 with the sign in the top byte
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        x = (b[:, 0].astype(np.int32) << 8 | b[:, 1].astype(np.int32) << 16
             | b[:, 2].astype(np.int8).astype(np.int32) << 24).astype(np.float32) / 2**31
    elif width in (2, 4):
        x = np.frombuffer(raw, f"<i{width}").astype(np.float32) / 2 ** (8 * width - 1)
    else:
        raise ValueError(f"--audio {str(path)!r}: {8 * width}-bit samples are not PCM 8/16/24/32-bit")
    return x.reshape(-1, channels), rate


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling by FFT (what `scipy.signal.resample` does): the spectrum is
    cut (or zero-padded) at the lower Nyquist frequency, so downsampling does not alias."""
    x = np.asarray(x, np.float32)
    if rate == target or x.size == 0:
        return x
    n = max(1, round(x.size * target / rate))
    spec = np.fft.rfft(x)
    keep = min(spec.size, n // 2 + 1)
    out = np.zeros(n // 2 + 1, spec.dtype)
    out[:keep] = spec[:keep]
    return (np.fft.irfft(out, n) * (n / x.size)).astype(np.float32)


def read_image(path: str | Path):
    """An image file as an RGB PIL image (transparency composited on white)."""
    return to_rgb(open_image(path))


def to_rgb(img):
    """RGB, with any alpha channel composited onto white (not dropped)."""
    from PIL import Image  # lazy: PIL costs ~15 ms; only image prompts need it

    if img.mode in ("RGBA", "LA", "P") and ("A" in img.getbands() or "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


@dataclasses.dataclass
class MediaProcessor:
    """Audio -> mel features, image -> patches, and the number of placeholder tokens each
    becomes (one processor per model, built from its config or its checkpoint)."""

    feature_extractor: Any
    image_processor: Any
    n_window: int = 50  # the audio encoder's window (config.audio_config.n_window)

    @classmethod
    def for_model(cls, model, source: str | Path | None = None) -> "MediaProcessor":
        """From a checkpoint directory's preprocessor config when it has one, else from the
        model config (patch / merge sizes of the vision encoder, mel bins of the audio one)."""
        from transformers import WhisperFeatureExtractor  # lazy: transformers costs seconds

        thinker = model.config.thinker_config
        audio, vision = thinker.audio_config, thinker.vision_config
        fe = ip = None
        if source is not None and (Path(source) / "preprocessor_config.json").is_file():
            from transformers import AutoImageProcessor  # lazy: transformers costs seconds

            fe = WhisperFeatureExtractor.from_pretrained(source)
            ip = AutoImageProcessor.from_pretrained(source)
        fe = fe or WhisperFeatureExtractor(feature_size=audio.num_mel_bins, sampling_rate=AUDIO_RATE)
        ip = ip or _image_processor(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                    temporal_patch_size=vision.temporal_patch_size)
        return cls(fe, ip, n_window=getattr(audio, "n_window", 50))

    def audio(self, wav: np.ndarray) -> tuple[dict[str, torch.Tensor], int]:
        """Mel features of one clip at AUDIO_RATE and its number of audio tokens."""
        feats = self.feature_extractor([wav], sampling_rate=AUDIO_RATE, padding=True, truncation=False,
                                       return_attention_mask=True, return_tensors="pt")
        mask = feats["attention_mask"]
        lengths = qwen3_omni_audio_output_lengths()
        try:
            n = lengths(mask.sum(-1), self.n_window)
        except TypeError:  # releases whose helper takes the lengths only (window 50), or none
            n = lengths(mask.sum(-1)) if lengths is not None else _audio_tokens(mask.sum(-1), self.n_window)
        return {"input_features": feats["input_features"], "feature_attention_mask": mask}, int(n[0])

    def image(self, img) -> tuple[dict[str, torch.Tensor], int]:
        """Patches of one image, its grid, and its number of image tokens."""
        out = self.image_processor(images=[img], return_tensors="pt")
        grid = out["image_grid_thw"]
        merge = getattr(self.image_processor, "merge_size", 2)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, int(grid[0].prod()) // merge**2


def _audio_tokens(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """The audio encoder's output length for `frames` mel frames (transformers'
    `_get_feat_extract_output_lengths`: three stride-2 convolutions per 2*n_window chunk,
    13 tokens per full chunk of 100)."""
    chunk = n_window * 2
    rest = (frames % chunk - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13


def _image_processor(**sizes):
    """transformers' Qwen2-VL image processor: the PIL one when it exists (no torchvision)."""
    import transformers  # lazy: transformers costs seconds

    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    return cls(image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD),
               size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, **sizes)


def expand_placeholders(text: str, n_audio: int | None, n_image: int | None) -> str:
    """Repeat each single pad token as many times as its encoder output has tokens (what
    the official processor does before tokenizing)."""
    if n_audio is not None:
        text = text.replace("<|audio_pad|>", "<|audio_pad|>" * n_audio, 1)
    if n_image is not None:
        text = text.replace("<|image_pad|>", "<|image_pad|>" * n_image, 1)
    return text
