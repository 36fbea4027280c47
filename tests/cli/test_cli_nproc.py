"""`magi-zoo run --nproc N`: the CLI re-launching itself under torchrun (the launch plumbing;
the parallel step itself, on 2 gloo processes, is tests/engine/test_parallel.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import magi_zoo


def test_cli_nproc_2_writes_what_one_process_writes(tmp_path):
    """`magi-zoo run --nproc 2` re-runs itself under torchrun (CFG parallel by default for
    Wan): rank 0 writes a file byte-identical to one process's, and only rank 0 prints."""
    from magi_zoo.cli import write_output

    args = ["run", "wan2.1-tiny", "--gpu", "cpu", "--prompt", "a corgi", "--steps", "2", "--seed", "5",
            "--no-compile"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "magi_zoo.cli", *args, "--nproc", "2", "--out",
                           str(tmp_path / "two.mp4")], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1 and proc.stdout.count("| region") == 1, proc.stdout
    assert "[rank" not in proc.stderr
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    one = h.adapter.generate(h, prompt="a corgi", progress=False, num_inference_steps=2, seed=5)
    write_output(one, tmp_path / "one.mp4")
    assert (tmp_path / "two.mp4").read_bytes() == (tmp_path / "one.mp4").read_bytes()
