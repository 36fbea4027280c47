"""Writing a generation's output: video (.mp4, .gif), image, text, and speech (.wav).

Each file is written to a temporary name and renamed into place (`magi_zoo.io`): a failure
mid-write never leaves a torn file, and an existing file is replaced whole or not at all.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from ..adapters.base import AV_HINT, can_mux_audio
from ..io import atomic_write, atomic_write_text


def write_wav(path: str | Path, audio, sample_rate: int) -> Path:
    """16-bit PCM WAV with the standard library's `wave`, written atomically: a 1-D waveform as
    mono, a (channels, samples) one (LTX-2's stereo track) with its channels interleaved."""
    wave_ = np.nan_to_num(np.asarray(audio, dtype=np.float32))
    channels = 1 if wave_.ndim == 1 else wave_.shape[0]
    pcm = (np.clip(wave_.reshape(channels, -1).T, -1.0, 1.0) * 32767.0).astype("<i2")  # (samples, channels)

    def write(tmp: Path) -> None:
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(channels)
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


def write_video_with_audio(frames, path: str | Path, fps: int, audio, sample_rate: int | None) -> None:
    """An .mp4 with its sound track (H.264 video, AAC audio), through diffusers' `encode_video`
    (PyAV; the `av` extra): the writer diffusers documents for LTX-2's video + audio output.
    `audio=None`: the video alone (the .mp4 writer where imageio finds no ffmpeg)."""
    if not can_mux_audio():
        raise RuntimeError(f"writing {Path(path).name} with its sound track needs PyAV: {AV_HINT}")
    import torch  # lazy: torch and diffusers take seconds to import; only this writer needs them
    from diffusers.utils import encode_video  # lazy: as torch

    # (F, H, W, 3) uint8, as encode_video takes it. In torch, in place: one multi-threaded pass
    # per op instead of numpy's single-threaded copies (81 frames at 480 x 832: 0.50 s against
    # 2.01 s on 2 cores, the same bytes), a cost every served video request pays.
    video = frames if isinstance(frames, np.ndarray) else np.stack([np.asarray(f) for f in frames])
    pixels = torch.from_numpy(np.ascontiguousarray(video, dtype=np.float32))
    pixels = torch.nan_to_num(pixels, nan=0.0).clamp_(0.0, 1.0).mul_(255.0).round_().to(torch.uint8)
    sound = None if audio is None else torch.as_tensor(np.nan_to_num(np.asarray(audio, dtype=np.float32)))
    encode_video(pixels, fps=fps, output_path=str(path), audio_sample_rate=sample_rate if sound is not None else None,
                 audio=sound)


def write_output(output, out: str | Path, audio_out: str | Path | None = None) -> list[Path]:
    """Write an adapter's `Output` to `out` (and its audio to `audio_out`); returns the paths.
    A video with `audio` (LTX-2) written as .mp4 carries it as its sound track; a .gif cannot,
    so there the sound is only in `audio_out`."""
    out = Path(out)
    if audio_out is not None and output.audio is None:
        raise ValueError("--audio-out given but the model returned no speech")
    if output.kind == "video" and output.audio is not None and out.suffix.lower() == ".mp4":
        atomic_write(out, lambda tmp: write_video_with_audio(output.value, tmp, output.fps or 24,
                                                             output.audio, output.sample_rate))
    elif output.kind == "video" and out.suffix.lower() == ".gif":
        atomic_write(out, lambda tmp: write_gif(list(output.value), tmp, fps=output.fps or 16))
    elif output.kind == "video":
        from diffusers.utils import export_to_video  # lazy: diffusers takes seconds to import

        def mp4(tmp):
            try:
                export_to_video(list(output.value), str(tmp), fps=output.fps or 16)
            except (AttributeError, ImportError, RuntimeError) as e:
                if "ffmpeg" not in str(e):
                    raise
                if can_mux_audio():  # PyAV ships its own FFmpeg: H.264 through diffusers' encode_video
                    write_video_with_audio(output.value, tmp, output.fps or 16, None, None)
                    return
                raise RuntimeError(f"writing {out.name} needs ffmpeg (pip install imageio-ffmpeg, or the `av` "
                                   f"extra); or write {out.with_suffix('.gif').name}, which needs only Pillow") from e

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
