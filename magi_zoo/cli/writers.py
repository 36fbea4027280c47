"""Writing a generation's output: video (.mp4, .gif), image, text, and speech (.wav).

Each file is written to a temporary name and renamed into place (`magi_zoo.io`): a failure
mid-write never leaves a torn file, and an existing file is replaced whole or not at all.
"""

from __future__ import annotations

import importlib.util
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


# x264's preset sets how hard the encoder searches, not the quality: that is the rate factor,
# left at each writer's default. A served video request pays the encode on every call, after the
# generation (on an H100 a 10-step Wan-1.3B call takes ~14 s). Measured by benchmarks/video_write
# on a 16-core host (benchmarks/results/serve/video_write_16cores.md), 81 frames of 480x832
# through PyAV: uniform noise (the worst case; random weights decode to noise) encodes in 3.80 s
# at x264's default "medium" against 1.36 s at "veryfast" (15.3 vs 14.5 MiB), a smooth moving
# gradient in 1.03 s against 0.68 s (173 vs 191 KiB: 10% larger). "ultrafast" would halve
# veryfast's time again but more than double a smooth clip's file (428 KiB).
VIDEO_PRESET = "veryfast"
# How FFmpeg threads the x264 encoder in PyAV. PyAV's default is slice threads (each frame cut
# into slices); frame threads encode several frames at once: on the same host and frames, noise
# at veryfast 0.74 s against 1.36 s and the smooth clip 0.34 s against 0.68 s, files no larger.
# A file needs no per-frame latency, which is what slice threads are for. (imageio's ffmpeg
# command line threads x264 by frames already.)
VIDEO_THREADS = "FRAME"


def uint8_frames(frames):
    """(F, H, W, 3) floats in [0, 1] (an array or a list of frames) as a uint8 torch tensor. In
    torch, in place: one multi-threaded pass per op instead of numpy's single-threaded copies
    (81 frames at 480 x 832: 0.50 s against 2.01 s on 2 cores, the same bytes)."""
    import torch  # lazy: torch takes seconds to import; only the video writers need it

    video = frames if isinstance(frames, np.ndarray) else np.stack([np.asarray(f) for f in frames])
    pixels = torch.from_numpy(np.ascontiguousarray(video, dtype=np.float32))
    return torch.nan_to_num(pixels, nan=0.0).clamp_(0.0, 1.0).mul_(255.0).round_().to(torch.uint8)


def write_mp4_imageio(frames, path: str | Path, fps: int) -> None:
    """H.264 through imageio's ffmpeg (the imageio-ffmpeg wheel ships the binary), at
    `VIDEO_PRESET`; imageio's default quality (5: x264's rate factor 25, as diffusers'
    `export_to_video` writes) and its 16-pixel macro-block padding."""
    import imageio  # lazy: only the .mp4 writer needs it

    with imageio.get_writer(str(path), format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=5,
                            macro_block_size=16, ffmpeg_params=["-preset", VIDEO_PRESET]) as writer:
        for frame in uint8_frames(frames).numpy():
            writer.append_data(frame)


def write_mp4_pyav(frames, path: str | Path, fps: int, *, preset: str = VIDEO_PRESET,
                   thread_type: str = VIDEO_THREADS) -> None:
    """H.264 (yuv420p: even width and height) through PyAV's own FFmpeg, at `preset`;
    `thread_type` ("SLICE", "FRAME"): how FFmpeg threads the encoder.
    `frames`: floats in [0, 1], or uint8 pixels, which are encoded as they are."""
    import av  # lazy: the `av` extra

    pixels = frames if isinstance(frames, np.ndarray) and frames.dtype == np.uint8 else uint8_frames(frames).numpy()
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps), options={"preset": preset})
        stream.height, stream.width = pixels.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_type = thread_type
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames


def write_video_with_audio(frames, path: str | Path, fps: int, audio, sample_rate: int) -> None:
    """An .mp4 with its sound track (H.264 video, AAC audio), through diffusers' `encode_video`
    (PyAV; the `av` extra): the writer diffusers documents for LTX-2's video + audio output (its
    video at x264's default preset: diffusers sets none)."""
    if not can_mux_audio():
        raise RuntimeError(f"writing {Path(path).name} with its sound track needs PyAV: {AV_HINT}")
    import torch  # lazy: torch and diffusers take seconds to import; only this writer needs them
    from diffusers.utils import encode_video  # lazy: as torch

    sound = torch.as_tensor(np.nan_to_num(np.asarray(audio, dtype=np.float32)))
    encode_video(uint8_frames(frames), fps=fps, output_path=str(path), audio_sample_rate=sample_rate, audio=sound)


def mp4_writer_missing() -> str | None:
    """Why `write_mp4` cannot write here (neither imageio's ffmpeg wheel nor PyAV is
    installed), else None: asked before work whose output is an .mp4."""
    if can_mux_audio() or importlib.util.find_spec("imageio_ffmpeg") is not None:
        return None
    return "needs ffmpeg: pip install imageio-ffmpeg, or the `av` extra"


def write_mp4(frames, path: str | Path, fps: int, *, name: str | None = None) -> None:
    """A silent .mp4: imageio's ffmpeg where it runs, else PyAV (which ships its own FFmpeg);
    neither: an error naming what to install (and `name`, the file the user asked for, where
    `path` is its temporary twin), or the .gif that needs only Pillow."""
    try:
        write_mp4_imageio(frames, path, fps)
        return
    except (AttributeError, ImportError, RuntimeError, OSError) as e:
        if not isinstance(e, ImportError) and "ffmpeg" not in str(e).lower():
            raise
        reason = e
    if not can_mux_audio():
        name = name or Path(path).name
        raise RuntimeError(f"writing {name} needs ffmpeg (pip install imageio-ffmpeg, or the `av` extra); or write "
                           f"{Path(name).with_suffix('.gif')}, which needs only Pillow") from reason
    write_mp4_pyav(frames, path, fps)


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
        atomic_write(out, lambda tmp: write_mp4(output.value, tmp, output.fps or 16, name=out.name))
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
