"""`magi-zoo serve` on a card: one worker per visible GPU, the plan compiled on the first
request of a shape and never again for the same shape (read from /metrics)."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch

from helpers.serve_server import Server

pytestmark = pytest.mark.gpu


def get(server: Server, path: str) -> bytes:
    with urllib.request.urlopen(server.url + path, timeout=600) as r:
        return r.read()


def image(server: Server, size: str) -> None:
    body = json.dumps({"model": "flux-tiny", "prompt": "a corgi", "size": size, "num_inference_steps": 2}).encode()
    req = urllib.request.Request(server.url + "/v1/images/generations", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert json.loads(r.read())["data"][0]["b64_json"]


def frames(server: Server) -> float:
    text = get(server, "/metrics").decode()
    return sum(float(v) for v in re.findall(r'^magi_zoo_compile_frames\{model="flux-tiny",worker="\d+"\} (\S+)$',
                                            text, re.M))


def test_one_worker_per_card_by_default():
    from magi_zoo.cli.commands.serve import devices

    assert devices(None, "cuda") == list(range(torch.cuda.device_count()))
    assert devices("0", "cuda") == [0]


def test_no_compile_on_a_warm_request():
    for extra in ("fastapi", "uvicorn"):  # the server process needs the serve extra; the card alone is not enough
        pytest.importorskip(extra, reason="magi-zoo serve needs the serve extra: pip install 'magi-zoo[serve]'")
    server = Server("flux-tiny", "--devices", "0", gpu="auto", compile=True, timeout=600)  # one worker
    try:
        health = json.loads(get(server, "/health"))
        assert health["models"][0]["workers"] == 1
        image(server, "64x64")  # the first request of this shape compiles the plan's regions
        first = frames(server)
        assert first > 0
        for _ in range(2):
            image(server, "64x64")
        assert frames(server) == first  # the same shape again: no compile
    finally:
        server.stop()
