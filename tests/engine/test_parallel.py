"""Multi-process inference (issue 14): the parallel section, the parallel step and the launch
plumbing, on CPU with 2 gloo processes.

What runs where: CFG parallel runs on gloo/CPU end to end. Diffusers' context parallelism
(Ulysses / ring) places ranks on accelerators and is refused on a CPU-only build with a
clear error (checked); `parallel_worker.py` then stands in one device for diffusers' device
pick so its Ulysses path (all-to-all over gloo) runs on CPU too, compiled, with counters.
Ring attention needs an attention backend that returns the log-sum-exp (none on CPU) and
uneven shards need uneven all-gathers (NCCL only): both are in the GPU test
(tests/test_parallel_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import magi_zoo
from magi_zoo import distributed
from magi_zoo.cli import main
from magi_zoo.cli.launch import without_option
from magi_zoo.overrides import with_parallel
from magi_zoo.specs.parallel_spec import ParallelSpec, default_parallel

from helpers import HELPERS, REPO


def _torchrun(script_and_args: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *script_and_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


# -- the section: validated before anything runs ---------------------------------------------------
def test_spec_degrees_and_world_size():
    s = ParallelSpec(cfg=True, ulysses_degree=2)
    assert (s.degree, s.sequence_degree, s.describe()) == (4, 2, "ulysses 2 x cfg 2")
    assert s.check_world(4) == 1 and s.check_world(8) == 2  # 8 processes: 2 replicas
    with pytest.raises(ValueError, match=r"= 4 processes, but the job has 2; launch with --nproc 4"):
        s.check_world(2)
    with pytest.raises(ValueError, match=r"does not divide the world size 6"):
        s.check_world(6)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ParallelSpec(ulysses_degree=0)
    with pytest.raises(ValueError, match="one sequence split only"):
        ParallelSpec(ulysses_degree=2, ring_degree=2, uneven=True)
    with pytest.raises(ValueError, match="needs ulysses_degree > 1 or ring_degree > 1"):
        ParallelSpec(uneven=True, cfg=True)
    assert not ParallelSpec().active


def test_default_degrees_per_process_count():
    # CFG first (one all-gather per step), the rest Ulysses; no CFG: all Ulysses.
    assert default_parallel(1, True) == {}
    assert default_parallel(2, True) == {"cfg": True}
    assert default_parallel(4, True) == {"cfg": True, "ulysses_degree": 2}
    assert default_parallel(3, True) == {"ulysses_degree": 3}
    assert default_parallel(4, False) == {"ulysses_degree": 4}


def test_default_degrees_keep_ulysses_within_the_head_count():
    # Ulysses hands each rank whole heads: its degree divides the head count, ring takes the rest.
    assert default_parallel(8, False, heads=12) == {"ulysses_degree": 4, "ring_degree": 2}  # Wan2.1-1.3B
    assert default_parallel(8, True, heads=12) == {"cfg": True, "ulysses_degree": 4}
    assert default_parallel(8, False, heads=40) == {"ulysses_degree": 8}  # Wan2.1-14B
    assert default_parallel(4, False, heads=7) == {"ring_degree": 4}  # nothing divides: ring alone
    assert default_parallel(6, True, heads=24) == {"cfg": True, "ulysses_degree": 3}
    for world, cfg, heads in [(8, False, 12), (8, True, 40), (6, False, 10), (4, True, 3)]:
        d = default_parallel(world, cfg, heads=heads)
        assert (2 if d.get("cfg") else 1) * d.get("ulysses_degree", 1) * d.get("ring_degree", 1) == world
        assert heads % d.get("ulysses_degree", 1) == 0


def test_run_picks_degrees_from_the_model_heads():
    from magi_zoo.cli.commands.run_options import run_parallel_fields

    fields = run_parallel_fields(8, ulysses=None, ring=None, cfg=None, uneven=False, runs_cfg=False, heads=12)
    assert fields == {"ulysses_degree": 4, "ring_degree": 2}


def test_spec_files_declare_the_denoisers():
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    layers = with_parallel(list(h.layers), {"ulysses_degree": 2})
    # the user layer (which also holds the offload reserve load sized for the call shape) gains the degrees
    assert layers[-1][1].to_dict()["parallel"] == {"WanTransformer3DModel": {"ulysses_degree": 2}}
    with pytest.raises(ValueError, match=r"declares no \[\*\.parallel\] region"):
        with_parallel([], {"cfg": True})
    # Without a process group the step says how to launch, and leaves the tree untouched.
    with pytest.raises(ValueError, match=r"needs 2 processes under torch.distributed; launch with `magi-zoo run "
                                         r"\.\.\. --nproc 2`"):
        magi_zoo.apply(h.modules, {"compile": {"": {"enabled": False}},
                                   "parallel": {"transformer": {"cfg": True}}}, gpu="cpu")
    assert "forward" not in h.pipe.transformer.__dict__


@pytest.mark.parametrize("argv, message", [
    (["--ulysses", "2"], "add --nproc N"),
    (["--nproc", "3", "--ulysses", "2"], "does not divide the world size 3"),
    (["--nproc", "2", "--ulysses", "4"], "= 4 processes, but the job has 2"),
    (["--nproc", "2", "--ring", "2", "--uneven", "--ulysses", "2"], "one sequence split only"),
])
def test_cli_refuses_before_launching(argv, message, capsys, tmp_path):
    code = main(["run", "wan2.1-tiny", "--gpu", "cpu", "--prompt", "x", "--out", str(tmp_path / "o.mp4"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o.mp4").exists()


def test_digest_is_stable():
    assert distributed.digest({"a": 1, "b": [1, 2]}) == distributed.digest({"b": [1, 2], "a": 1})
    assert without_option(["run", "m", "--nproc", "2", "--seed", "1", "--nproc=4"], "--nproc") == \
        ["run", "m", "--seed", "1"]


# -- two gloo processes ------------------------------------------------------------------------
def test_two_processes_equal_one(tmp_path):
    """tests/parallel_worker.py on 2 gloo ranks: CFG parallel equals one process exactly (each
    rank ran only its branch); Ulysses is refused on CPU, and with one stand-in device equals
    one process, inside fullgraph-compiled blocks with one compile for all blocks and no
    graph break or recompile (Wan and Flux); a token count that does not divide is refused
    clearly; every apply is undone exactly; ranks that disagree are told so."""
    out = tmp_path / "result.json"
    proc = _torchrun([str(HELPERS / "parallel_worker.py"), str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world"] == 2
    cfg = r["cfg"]
    assert cfg["did"] == "cfg 2 over 2 processes on transformer (transformer); this rank runs the cond branch"
    assert cfg["max_diff"] == 0.0 and cfg["undo_exact"]
    assert cfg["block0_calls"] == cfg["steps"]  # rank 0 ran the cond forward only: one per step, not two
    assert "runs on accelerators" in r["cpu_refusal"] and "cfg=true alone" in r["cpu_refusal"]
    assert r["cpu_refusal_undo_exact"]
    u = r["ulysses"]
    assert u["did"].startswith("ulysses 2 over 2 processes on transformer (transformer); attention backend native")
    assert u["fwd_max_diff"] < 1e-5 and u["frames_max_diff"] < 1e-5, u
    # 4 blocks, one compiled frame and graph: the split's view is made fresh, so block 0
    # compiles like blocks 1..3; the all-to-alls are functional collectives inside the graph.
    assert (u["compiled_frames"], u["graphs"], u["breaks"], u["recompiles"]) == (1, 1, {}, []), u
    # the same under inference_mode, where the split's views record no base (found on 2 GPUs:
    # block 0 compiled for the view's strides, blocks 1.. for fresh tensors)
    ui = r["ulysses_inference"]
    assert ui["fwd_max_diff"] < 1e-5 and (ui["compiled_frames"], ui["graphs"], ui["breaks"], ui["recompiles"]) \
        == (1, 1, {}, []), ui
    assert u["undo_exact"]
    assert "does not divide by the sequence-parallel degree 2" in r["uneven_refusal"]
    assert "or set uneven=true" in r["uneven_refusal"]
    assert "uneven=true runs only in eager regions" in r["uneven_compiled_refusal"]
    fa3 = r["fa3"]  # the engine's fa3 kernel (a stand-in on CPU) served to Ulysses, and put back on undo
    assert fa3["cp_entry"] == "fa3_context_parallel_attention" and fa3["fwd_max_diff"] < 1e-5, fa3
    assert "attention backend _flash_3" in fa3["did"] and fa3["entry_restored"], fa3
    assert r["uneven_compiled_undo_exact"]
    assert "different command lines" in r["mismatch"] and "ranks [0]" in r["mismatch"]
    fl = r["flux"]  # Ulysses over the joint sequence: 2 block classes, one compile each; true-CFG parallel
    assert fl["fwd_max_diff"] < 1e-5 and (fl["frames"], fl["breaks"], fl["recompiles"]) == (2, {}, []), fl
    assert fl["cfg_max_diff"] == 0.0, fl
    hv = r["hunyuan"]  # HunyuanVideo-1.5's guider ("pred_cond" / "pred_uncond"): the same video
    assert hv["runs_cfg"] and hv["max_diff"] == 0.0 and hv["block0_calls"] == hv["steps"], hv
    kl = r["klein"]  # FLUX.2 [klein] base's CFG: one branch per rank, the same image as one process
    assert kl["runs_cfg"] and kl["max_diff"] == 0.0 and kl["block0_calls"] == kl["steps"], kl  # one branch a step


def test_a_dead_rank_ends_the_job(tmp_path):
    """Rank 1 dies while rank 0 waits in a collective: torchrun ends the job, non-zero, in
    seconds (not the collective timeout), naming the rank."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, torch\nfrom magi_zoo import distributed\ndistributed.init('cpu')\n"
        "if distributed.rank() == 1:\n    os._exit(7)\n"
        "torch.distributed.all_reduce(torch.ones(1))\ntorch.distributed.barrier()\n")
    t0 = time.monotonic()
    proc = _torchrun([str(script)], timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "exitcode  : 7" in proc.stderr and "rank      : 1" in proc.stderr, proc.stderr[-2000:]
    assert took < 60, took
