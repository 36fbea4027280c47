"""`magi-zoo serve` against the real `openai` client, a browser, bad inputs, load, a worker
killed mid-job, and SIGTERM last: one server (three tiny models, eager, on the CPU) for the
module."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from PIL import Image

from helpers.serve_server import Server, call, png_data_url, wait_job

openai = pytest.importorskip("openai")


# a 64x64 PNG as a data: URL (a first frame or an image sent inline)
PNG_URL = png_data_url(Image.new("RGB", (64, 64), (200, 30, 30)))

KEY = "test-key-123"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-out")


@pytest.fixture(scope="module")
def server(out_dir):
    s = Server("flux-tiny", "wan2.1-tiny", "qwen3-omni-tiny", "bagel-tiny", "--max-queue", "3", "--output-dir", str(out_dir),
               "--grace", "1", key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def raw_post(server, headers: dict, body: bytes, chunked: bool = False):
    """POST /v1/jobs over a bare socket, sending until the server stops reading; (status, JSON)."""
    import socket

    head = "".join(f"{k}: {v}\r\n" for k, v in {**server.headers(), "Content-Type": "application/json",
                                                 **headers}.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
        try:
            for i in range(0, len(body), 2**20):
                piece = body[i:i + 2**20]
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        except OSError:  # the server answered and closed: what a limit does
            pass
        reply = b""
        while True:
            head, sep, rest = reply.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), None)
            if sep and length is not None and len(rest) >= length:
                break
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    return int(head.split()[1]), json.loads(rest[:length])


def test_openai_client_image_video_chat_models(server, client):
    r = client.images.generate(model="flux-tiny", prompt="a cat", size="32x32",
                               extra_body={"num_inference_steps": 2, "seed": 1})
    png = base64.b64decode(r.data[0].b64_json)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    url = client.images.generate(model="flux-tiny", prompt="a cat", response_format="url",
                                 extra_body={"num_inference_steps": 2, "seed": 1}).data[0].url
    assert call(server, "GET", url.removeprefix(server.url))[1] == png  # same seed, same image, by id

    video = client.videos.create_and_poll(model="wan2.1-tiny", prompt="a dog", poll_interval_ms=50,
                                          extra_body={"num_inference_steps": 2, "num_frames": 5})
    assert (video.status, video.progress, video.error) == ("completed", 100, None)
    assert video.size == "32x32"
    assert client.videos.download_content(video.id).content[4:8] == b"ftyp"  # an .mp4

    reply = client.chat.completions.create(model="qwen3-omni-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    assert reply.choices[0].message.role == "assistant" and isinstance(reply.choices[0].message.content, str)
    spoken = client.chat.completions.create(model="qwen3-omni-tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, modalities=["text", "audio"],
                                            audio={"voice": "Ethan", "format": "wav"})
    assert base64.b64decode(spoken.choices[0].message.audio.data)[:4] == b"RIFF"

    assert sorted(m.id for m in client.models.list()) == ["bagel-tiny", "flux-tiny", "qwen3-omni-tiny", "wan2.1-tiny"]


def test_bagel_image_edit_and_understanding(client):
    png = base64.b64decode(client.images.generate(model="bagel-tiny", prompt="a cat",
                                                  extra_body={"num_inference_steps": 2}).data[0].b64_json)
    edited = client.images.edit(model="bagel-tiny", image=("cat.png", png, "image/png"), prompt="make it blue",
                                extra_body={"num_inference_steps": 2})
    assert base64.b64decode(edited.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    reply = client.chat.completions.create(model="bagel-tiny", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert isinstance(reply.choices[0].message.content, str)
    with pytest.raises(openai.BadRequestError) as e:  # a URL to fetch: refused, nothing is fetched
        client.chat.completions.create(model="bagel-tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}]}])
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/images/generations", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/images/generations", {"model": "flux-tiny", "prompt": "x", "num_inference_steps": "abc"}, 400,
     "num_inference_steps"),
    ("/v1/images/generations", {"model": "flux-tiny", "prompt": "x", "num_inference_steps": -2}, 400,
     "num_inference_steps"),
    ("/v1/images/generations", {"model": "flux-tiny", "prompt": "x", "size": "16384x16384"}, 400, "size"),
    ("/v1/images/generations", {"model": "flux-tiny", "prompt": "x", "size": "33x33"}, 400, "size"),
    ("/v1/images/generations", {"model": "flux-tiny", "prompt": 5}, 400, "prompt"),
    ("/v1/images/generations", {"model": "flux-tiny", "prompt": "x", "guidance": 2}, 400, "guidance"),
    ("/v1/images/generations", {"model": "wan2.1-tiny", "prompt": "x"}, 400, "model"),
    ("/v1/videos", {"model": "wan2.1-tiny", "prompt": "x", "num_frames": 6}, 400, "num_frames"),
    ("/v1/chat/completions", {"model": "qwen3-omni-tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "qwen3-omni-tiny", "messages": [{"role": "user", "content": "x"}],
                              "stream": True}, 400, "stream"),
    ("/v1/jobs", {"model": "qwen3-omni-tiny", "prompt": "x", "voice": "Nobody", "speech": True}, 400, "voice"),
    # a first frame for a text-to-video model; one that is not an image
    ("/v1/videos", {"model": "wan2.1-tiny", "prompt": "x", "input_reference": PNG_URL}, 400, "input_reference"),
    ("/v1/videos", {"model": "wan2.1-tiny", "prompt": "x", "input_reference": "data:image/png;base64,AAAA"}, 400,
     "input_reference"),
])
def test_bad_inputs_are_4xx_naming_the_field(server, path, body, status, param):
    got, err = call(server, "POST", path, body)
    assert got == status, err
    assert err["error"]["param"] == param, err
    assert err["error"]["message"]


def test_key_body_limit_and_health_after(server):
    no_key = urllib.request.Request(server.url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(no_key, timeout=10)
    assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
    status, err = call(server, "GET", "/v1/models", headers={"Authorization": "Bearer test-key-12"})
    assert status == 401
    big = b"{" + b" " * (33 * 2**20) + b"}"  # over the default 32 MiB
    status, err = raw_post(server, {"Content-Length": str(len(big))}, big)  # declared: refused on the header
    assert status == 413 and err["error"]["code"] == "body_too_large"
    status, err = raw_post(server, {"Transfer-Encoding": "chunked"}, big, chunked=True)  # undeclared: on the bytes
    assert status == 413 and err["error"]["code"] == "body_too_large"
    status, err = call(server, "POST", "/v1/jobs", raw=b"{not json")
    assert status == 400 and err["error"]["code"] == "invalid_json"
    assert server.health()["status"] == "ok"
    status, job = call(server, "POST", "/v1/jobs", {"model": "flux-tiny", "prompt": "after", "num_inference_steps": 1})
    assert status == 200 and wait_job(server, job["id"])["status"] == "completed"


def test_load_each_job_answered_once_and_queue_full_is_429(server):
    """12 clients at once against one worker and a queue of 3: each gets one answer, the
    accepted jobs all complete (none lost), the rest are 429 with a JSON error."""
    body = {"model": "flux-tiny", "prompt": "load", "num_inference_steps": 4}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: call(server, "POST", "/v1/jobs", body), range(12)))
    accepted = [job["id"] for status, job in answers if status == 200]
    refused = [err for status, err in answers if status == 429]
    assert len(accepted) + len(refused) == 12 and refused and accepted
    assert len(set(accepted)) == len(accepted)
    assert all(err["error"]["code"] == "queue_full" for err in refused)
    assert [wait_job(server, j)["status"] for j in accepted] == ["completed"] * len(accepted)
    _, metrics = call(server, "GET", "/metrics")
    assert b'magi_zoo_queue_length{model="flux-tiny"} 0.0' in metrics
    assert b'magi_zoo_rejected_total{status="429"}' in metrics
    assert b'magi_zoo_phase_seconds_count{model="flux-tiny",phase="run"}' in metrics
    assert b'magi_zoo_compile_frames{model="flux-tiny",worker="0"} 0.0' in metrics  # eager: nothing compiled


def test_cancel_and_kill_9_of_a_worker_mid_job(server):
    status, job = call(server, "POST", "/v1/jobs", {"model": "flux-tiny", "prompt": "long", "num_inference_steps": 400})
    assert status == 200
    deadline = time.monotonic() + 30
    while call(server, "GET", f"/v1/jobs/{job['id']}")[1]["progress"]["done"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert call(server, "POST", f"/v1/jobs/{job['id']}/cancel")[0] == 200
    assert wait_job(server, job["id"])["status"] == "cancelled"  # between two steps, the worker alive

    status, job = call(server, "POST", "/v1/jobs", {"model": "flux-tiny", "prompt": "long", "num_inference_steps": 400})
    while call(server, "GET", f"/v1/jobs/{job['id']}")[1]["progress"]["done"] < 1:
        time.sleep(0.02)
    pid = next(m for m in server.health()["models"] if m["model"] == "flux-tiny")["pids"][0]
    os.kill(pid, signal.SIGKILL)
    ended = wait_job(server, job["id"])
    assert ended["status"] == "failed" and ended["error"]["code"] == "worker_died"
    assert "SIGKILL" in ended["error"]["message"] and "submit the job again" in ended["error"]["message"]
    assert call(server, "GET", "/v1/models")[0] == 200  # the server kept answering
    status, job = call(server, "POST", "/v1/jobs", {"model": "flux-tiny", "prompt": "next", "num_inference_steps": 1})
    assert wait_job(server, job["id"], timeout=90)["status"] == "completed"  # on the restarted worker
    flux = next(m for m in server.health()["models"] if m["model"] == "flux-tiny")
    assert flux["restarts"] == 1 and flux["pids"] != [pid]
    os.kill(flux["pids"][0], signal.SIGKILL)  # dead while idle: the next job starts a fresh one and runs
    status, job = call(server, "POST", "/v1/jobs", {"model": "flux-tiny", "prompt": "idle", "num_inference_steps": 1})
    assert wait_job(server, job["id"], timeout=90)["status"] == "completed"
    assert next(m for m in server.health()["models"] if m["model"] == "flux-tiny")["restarts"] == 2


CHROMIUM = os.environ.get("MAGI_ZOO_CHROMIUM", "/usr/bin/chromium")


def test_web_page_in_headless_chromium(server):
    """Submit from the page, see the progress move, see the image load."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("MAGI_ZOO_NO_BROWSER") == "1":
            pytest.skip("MAGI_ZOO_NO_BROWSER=1: the web page test is skipped")
        pytest.fail(f"the web page test drives Chromium at {CHROMIUM}, which is missing: install it "
                    "(apt-get install -y chromium), point MAGI_ZOO_CHROMIUM at one, or set MAGI_ZOO_NO_BROWSER=1")
    from playwright.sync_api import sync_playwright  # the test extra installs it

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])  # CI runs as root
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            page.wait_for_function("document.querySelectorAll('#model option').length === 4")
            page.select_option("#model", "bagel-tiny")
            assert page.is_visible("[data-option=image]")  # BAGEL edits an image: the page takes one
            page.select_option("#model", "flux-tiny")
            assert page.is_hidden("[data-option=num_frames]")  # a video option, not shown for an image model
            assert page.is_hidden("[data-option=image]")  # FLUX.1 takes no image
            # enough steps that the job outlasts several of the page's 150 ms polls and the worker's
            # progress reports even on a loaded machine (20 steps once finished between two polls)
            page.fill("#num_inference_steps", "300")
            page.evaluate("""window.seen = [];
                new MutationObserver(() => window.seen.push(document.getElementById('status').textContent))
                    .observe(document.getElementById('status'), {childList: true, characterData: true, subtree: true});""")
            page.click("#submit")
            page.wait_for_selector("#result-image", timeout=60_000)
            page.wait_for_function("document.getElementById('result-image').complete && "
                                   "document.getElementById('result-image').naturalWidth === 32", timeout=10_000)
            seen = page.evaluate("window.seen")
            moving = [s for s in seen if s.startswith("in_progress (") and not s.endswith("(300/300)")
                      and not s.startswith("in_progress (0/")]
            assert moving, seen  # a step count between the first and the last was shown
            assert seen[-1] == "completed (300/300)"
            assert page.text_content("#error") == ""
        finally:
            browser.close()


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # a zombie has ended; its parent (gone too) never reaped it
    except FileNotFoundError:
        return True


def test_sigterm_last_fails_the_running_job_and_exits_clean(server, out_dir):
    """Runs last (it ends the module's server): the running job failed after the grace period,
    the workers gone, no traceback, nothing half-written left in the output directory."""
    status, long = call(server, "POST", "/v1/jobs", {"model": "flux-tiny", "prompt": "long", "num_inference_steps": 1000})
    assert status == 200
    while call(server, "GET", f"/v1/jobs/{long['id']}")[1]["progress"]["done"] < 1:
        time.sleep(0.05)
    completed = [j for j in out_dir.iterdir()]
    workers = [pid for m in server.health()["models"] for pid in m["pids"]]
    server.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then ends by the signal it was sent (what a supervisor expects)
    assert server.proc.wait(30) == -signal.SIGTERM, server.output()
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in workers)
    assert sorted(out_dir.iterdir()) == sorted(completed)  # the running job left nothing, the others kept
    assert not any(p.name.startswith(".") for p in out_dir.iterdir())  # no temporary half-file
    assert "Traceback" not in server.output(), server.output()
