"""Writing a generation's output: video (.mp4, .gif), image, text, and speech (.wav).

Each file is written to a temporary name and renamed into place (`magi_zoo.io`): a failure
mid-write never leaves a torn file, and an existing file is replaced whole or not at all.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from ..io import atomic_write, atomic_write_text


def write_wav(path: str | Path, audio, sample_rate: int) -> Path:
    """16-bit PCM mono WAV with the standard library's `wave`, written atomically."""
    pcm = (np.clip(np.nan_to_num(np.asarray(audio, dtype=np.float32)), -1.0, 1.0) * 32767.0).astype("<i2")

    def write(tmp: Path) -> None:
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm.tobytes())

    atomic_write(Path(path), write)
    return Path(path)


def write_gif(frames, path: str | Path, fps: int) -> None:
    """Frames (H x W x 3 floats in [0, 1]) as an animated GIF with Pillow alone (no ffmpeg),
    through diffusers' own `numpy_to_pil` and `export_to_gif`."""
    from diffusers.utils import export_to_gif, numpy_to_pil  # lazy: diffusers takes seconds to import

    if len(frames) == 0:
        raise ValueError("no frames to write")
    export_to_gif(numpy_to_pil(np.clip(np.stack([np.asarray(f) for f in frames]), 0.0, 1.0)), str(path), fps=fps)


def write_output(output, out: str | Path, audio_out: str | Path | None = None) -> list[Path]:
    """Write an adapter's `Output` to `out` (and its speech to `audio_out`); returns the paths."""
    out = Path(out)
    if audio_out is not None and output.audio is None:
        raise ValueError("--audio-out given but the model returned no speech")
    if output.kind == "video" and out.suffix.lower() == ".gif":
        atomic_write(out, lambda tmp: write_gif(list(output.value), tmp, fps=output.fps or 16))
    elif output.kind == "video":
        from diffusers.utils import export_to_video  # lazy: diffusers takes seconds to import

        def mp4(tmp):
            try:
                export_to_video(list(output.value), str(tmp), fps=output.fps or 16)
            except (AttributeError, ImportError, RuntimeError) as e:
                if "ffmpeg" not in str(e):
                    raise
                raise RuntimeError(f"writing {out.name} needs ffmpeg (pip install imageio-ffmpeg); or write "
                                   f"{out.with_suffix('.gif').name}, which needs only Pillow") from e

        atomic_write(out, mp4)
    elif output.kind == "image":
        atomic_write(out, lambda tmp: output.value.save(tmp))
    elif output.kind == "text":
        atomic_write_text(out, output.value + "\n")
    else:
        raise ValueError(f"unknown output kind {output.kind!r}")
    written = [out]
    if audio_out is not None:
        written.append(write_wav(audio_out, output.audio, output.sample_rate))
    return written
