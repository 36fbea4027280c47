"""Multi-GPU checks of the parallel step (issue 14): diffusers' context parallelism (Ulysses,
ring, uneven shards) and CFG parallel on real GPUs, inside the shipped compiled plan, against
the same plan on one GPU. Needs 2 CUDA devices (4 for CFG x Ulysses); skipped otherwise.

    python -m pytest -q tests/test_parallel_gpu.py      # on a 2- or 4-GPU machine

The worker (tests/parallel_gpu_worker.py) runs under torchrun on every visible GPU; what it
checks on CPU (its Ulysses configuration over gloo) the CPU suite runs in
tests/test_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import HELPERS, REPO
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 CUDA devices, found {n}")
    n = 4 if n >= 4 else 2
    out = tmp_path_factory.mktemp("par") / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           str(HELPERS / "parallel_gpu_worker.py"), str(out)], capture_output=True, text=True,
                          timeout=1500, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    return {c["name"]: c for c in r["configs"]}, r


def _ok(row, tol, frames=1):
    assert "error" not in row, row
    assert row["rel_l2"] < tol, row
    # the shipped h100/h200 plan compiles the 30 blocks with static shapes: one frame, one graph
    assert (row["frames"], row["graphs"], row["breaks"], row["recompiles"]) == (frames, frames, {}, []), row
    assert row["undo_exact"], row


def test_ulysses_equals_one_gpu_compiled(result):
    rows, _ = result
    _ok(rows["ulysses"], 2e-2)


def test_ring_equals_one_gpu_compiled(result):
    rows, _ = result
    _ok(rows["ring"], 2e-2)


def test_ring_on_the_shipped_attention(result):
    rows, _ = result
    row = rows["ring_fa3"]
    if "error" in row and "log-sum-exp" in row["error"]:
        pytest.skip("the shipped attention resolved to 'native' here (no fa3): ring is refused, as it should be")
    _ok(row, 2e-2)


def test_uneven_shards(result):
    rows, _ = result
    _ok(rows["uneven"], 2e-2, frames=0)  # eager: the engine refuses uneven shards in compiled blocks


def test_cfg_parallel_step_equals_one_gpu(result):
    rows, _ = result
    # cfg: one rank computes the cond forward, the other the uncond, with the kernels one GPU runs
    row = rows["cfg"]
    assert "error" not in row and row["undo_exact"], row
    assert row["cond_uncond_gap"] > 0.05, row  # the two conditions really differ
    # Each branch equals its one-GPU reference at bf16 level, like Ulysses (2x H100, this worker:
    # 4.6e-3 for both branches, even the cond one on the reference's own GPU -- the parallel
    # plan is compiled afresh). Guidance 5 with cond and uncond 6% apart multiplies that: the
    # guided output 5c - 4u measured 2.8e-2. (This test used to expect 1e-3 for the guided output
    # with a negative condition identical to the positive one, so it checked rounding noise.)
    assert row["rel_l2_cond"] < 1e-2 and row["rel_l2_uncond"] < 1e-2, row
    assert row["rel_l2"] < 5e-2, row


def test_cfg_times_ulysses(result):
    rows, r = result
    if r["world"] < 4:
        pytest.skip("needs 4 GPUs")
    _ok(rows["cfg_ulysses"], 2e-2)
