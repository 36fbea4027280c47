"""`magi-zoo serve --nproc 2`: a worker that is a group of two processes (gloo on the CPU, CFG
parallel for wan2.1-tiny), one server for the module: a cancel ends a job on every rank at
the same step and the group keeps serving; a request answers what one process makes; a kill
-9 of the follower rank mid-job fails that job clearly and the restarted group serves the
next; bad command lines are refused before any worker starts."""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np
import pytest

from helpers import serve_server
from helpers.serve_server import Server, call

pytest.importorskip("fastapi")
av = pytest.importorskip("av")

MODEL = "wan2.1-tiny"  # runs CFG at its defaults: two processes split it on the CPU (one branch each)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(MODEL, "--nproc", "2", "--output-dir", str(tmp_path_factory.mktemp("group-out")), "--grace", "0")
    yield s
    s.stop()


def submit(server, **options) -> str:
    status, job = call(server, "POST", "/v1/jobs", {"model": MODEL, "prompt": "a corgi", **options})
    assert status == 200, job
    return job["id"]


def wait_job(server, job_id: str, timeout: float = 120.0, until=None) -> dict:
    return serve_server.wait_job(server, job_id, timeout, until, poll=0.02)


def started(job: dict) -> bool:
    return job["progress"]["done"] >= 1 or job["status"] != "in_progress" and job["status"] != "queued"


def frames(data: bytes) -> np.ndarray:
    import io

    with av.open(io.BytesIO(data)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]).astype(np.int16)


def model_health(server) -> dict:
    return server.health()["models"][0]


def test_cancel_reaches_every_rank_and_a_request_answers_what_one_process_makes(server, tmp_path):
    health = model_health(server)
    assert (health["workers"], health["nproc"], len(health["group_pids"][0])) == (1, 2, 2), health
    job = submit(server, num_inference_steps=400, num_frames=1)
    wait_job(server, job, until=started)
    assert call(server, "POST", f"/v1/jobs/{job}/cancel")[0] == 200
    assert wait_job(server, job)["status"] == "cancelled"

    # the same group serves on: both ranks left the cancelled job at the same step
    job = submit(server, num_inference_steps=3, num_frames=1, seed=7)
    ended = wait_job(server, job)
    assert ended["status"] == "completed", ended
    assert ended["progress"]["done"] == 3  # progress from rank 0
    served = frames(call(server, "GET", f"/v1/jobs/{job}/content")[1])
    assert model_health(server)["restarts"] == 0

    import magi_zoo
    from magi_zoo.cli.commands.run import generate_to

    handle = magi_zoo.load(MODEL, gpu="cpu", compile=False)  # what the one-process server runs for this request
    generate_to(handle, prompt="a corgi", out=tmp_path / "one.mp4", progress=False, num_inference_steps=3,
                num_frames=1, seed=7)
    one = frames((tmp_path / "one.mp4").read_bytes())
    assert served.shape == one.shape == (1, 32, 32, 3)
    assert np.abs(served - one).max() <= 2  # the encoder's rounding at most: CFG parallel computes the same


def test_kill_9_of_a_follower_rank_fails_the_job_and_the_group_restarts(server):
    job = submit(server, num_inference_steps=400, num_frames=1)
    wait_job(server, job, until=started)
    pids = model_health(server)["group_pids"][0]
    os.kill(pids[1], signal.SIGKILL)
    ended = wait_job(server, job)
    error = ended["error"]
    assert ended["status"] == "failed" and error["code"] == "worker_died", ended
    assert f"rank 1 of the 2-process group (pid {pids[1]})" in error["message"], error
    assert "SIGKILL" in error["message"] and "submit the job again" in error["message"], error
    job = submit(server, num_inference_steps=1, num_frames=1)  # waits for the restarted group
    assert wait_job(server, job, timeout=180)["status"] == "completed"
    health = model_health(server)
    assert health["restarts"] == 1 and not set(health["group_pids"][0]) & set(pids), health
    assert not alive(pids[0])  # the old group's rank 0 was stopped with it, not left behind


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has ended (its parent, gone too, never reaped it)
    except FileNotFoundError:
        return False


def serve_args(*argv: str) -> argparse.Namespace:
    from magi_zoo.cli.parser import build_parser

    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, message", [
    (["qwen3-omni-tiny", "--gpu", "cpu", "--nproc", "2"], "spec declares no parallel region"),
    (["flux-tiny", "--gpu", "cpu", "--nproc", "2"], "on the CPU only CFG parallel splits the work"),
    (["wan2.1-tiny", "--gpu", "cpu", "--nproc", "4"], "would run ulysses 2 x cfg 2"),
    (["wan2.1-tiny", "--gpu", "cpu", "--nproc", "0"], "expected a positive number"),
])
def test_bad_nproc_is_refused_before_any_worker_starts(argv, message, capsys, monkeypatch):
    from magi_zoo.cli import main
    from magi_zoo.serve import pool

    monkeypatch.setattr(pool, "Worker", None)  # a worker started would fail loudly
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("magi-zoo: error: --nproc") and message in err and err.count("\n") == 1, err


def test_groups_split_the_cards_and_nproc_must_divide_them():
    from magi_zoo.serve.app import split_groups

    assert split_groups([0, 1, 2, 3], 2) == [(0, 1), (2, 3)]
    assert split_groups([None], 2) == [(None, None)]  # the CPU: one group of two processes
    with pytest.raises(ValueError, match=r"--nproc 2 does not divide the 3 device\(s\) \[0, 1, 2\].*--devices 0,1"):
        split_groups([0, 1, 2], 2)


def test_a_group_plan_is_the_one_run_nproc_picks():
    from magi_zoo.cli.commands.serve import serve_config

    config = serve_config(serve_args(MODEL, "--gpu", "cpu", "--nproc", "2", "--no-compile"))
    load = config.model_load[MODEL]
    assert load["parallel"] == {"cfg": True} and config.groups() == [(None, None)]
    # --no-compile: the plan applies (its split) with every region eager, as `run --nproc --no-compile`
    assert load["compile"] and all(m == {"enabled": False} for key in load["compile"].values() for m in key.values())


def test_a_group_job_ends_with_the_first_error_of_any_rank():
    from magi_zoo.serve.group import CANCELLED, FAILED, OK, verdict

    assert verdict([(OK, ""), (OK, "")]) == (OK, "")
    assert verdict([(OK, ""), (FAILED, "ValueError: bad shape")]) == (FAILED, "[rank 1/2] ValueError: bad shape")
    assert verdict([(FAILED, "OSError: disk full"), (FAILED, "x")]) == (FAILED, "OSError: disk full")
    assert verdict([(CANCELLED, "c"), (CANCELLED, "c")])[0] == CANCELLED
    assert verdict([(CANCELLED, "c"), (OK, "")])[0] == CANCELLED  # rank 0 saw the cancel after the last step


def test_sigterm_stops_every_rank_of_a_busy_group(server):
    """Last in the module: SIGTERM while the group runs a job (--grace 0: it is failed at once):
    every rank is ended, no traceback."""
    job = submit(server, num_inference_steps=400, num_frames=1)
    wait_job(server, job, until=started)
    pids = model_health(server)["group_pids"][0]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == -signal.SIGTERM, server.output()[-2000:]  # uvicorn ends by the signal it got
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)]
    assert "Traceback" not in server.output(), server.output()[-3000:]
