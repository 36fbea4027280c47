"""What writing a generated video costs on this machine's CPU: the float-to-uint8 conversion and
the H.264 encode (PyAV, the writer a served video request runs where imageio finds no ffmpeg),
per x264 preset and FFmpeg threading, for two kinds of content at one size: noise (what random
weights decode to: the worst case for the encoder) and a smooth moving gradient (closer to real
video). Every time is the median of `--runs`; each encode's file size is recorded beside it.

    python -m benchmarks.video_write                     # 81 frames of 480 x 832
    python -m benchmarks.video_write --frames 121 --height 480 --width 848

Results: benchmarks/results/serve/video_write_<N>cores.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import add_commit_argument, env_line, environment, measured_commit, publish, results_dir, \
    results_table, time_calls


def contents(frames: int, height: int, width: int) -> dict[str, np.ndarray]:
    """(F, H, W, 3) float32 frames in [0, 1]: uniform noise, and a gradient that moves a few
    pixels a frame."""
    noise = np.random.default_rng(0).random((frames, height, width, 3), dtype=np.float32)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    smooth = np.stack([np.stack([(x + 4 * t) % 256, (y + 2 * t) % 256, ((x + y) / 2 + t) % 256], -1)
                       for t in range(frames)]).astype(np.float32) / 255.0
    return {"noise": noise, "smooth": smooth}


def median_ms(fn, runs: int) -> float:
    """The median of `runs` timed calls on the CPU, no warm-up (each call is seconds of work)."""
    return time_calls(fn, "cpu", warmup=0, runs=runs)["median_ms"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--fps", type=int, default=16)
    ap.add_argument("--presets", default="medium,veryfast,ultrafast")
    ap.add_argument("--thread-types", default="SLICE,FRAME")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=results_dir("serve"))
    add_commit_argument(ap)
    args = ap.parse_args(argv)
    measured_commit()  # before anything is measured: a result must name its commit
    from magi_zoo.cli.writers import VIDEO_PRESET, VIDEO_THREADS, uint8_frames, write_mp4_pyav

    env = environment("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.mp4"
        for name, frames in contents(args.frames, args.height, args.width).items():
            convert_ms = median_ms(lambda: uint8_frames(frames), args.runs)
            pixels = uint8_frames(frames).numpy()
            for preset in args.presets.split(","):
                for thread_type in args.thread_types.split(","):
                    ms = median_ms(lambda: write_mp4_pyav(pixels, path, args.fps, preset=preset,
                                                          thread_type=thread_type), args.runs)
                    rows.append({"content": name, "preset": preset, "thread_type": thread_type,
                                 "convert_ms": convert_ms, "encode_ms": ms, "total_ms": round(convert_ms + ms, 2),
                                 "file_kib": path.stat().st_size // 1024,
                                 "shipped": (preset, thread_type) == (VIDEO_PRESET, VIDEO_THREADS)})
                    print(rows[-1], flush=True)
    record = {"benchmark": "video_write", "env": env, "cpu_count": os.cpu_count(),
              "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    md = (f"{env_line(env)} | {os.cpu_count()} CPU cores | {args.frames} frames of {args.height} x {args.width}\n\n"
          + results_table(rows, list(rows[0])))
    publish(args.out, f"video_write_{os.cpu_count()}cores", record, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
