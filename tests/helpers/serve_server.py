"""A `magi-zoo serve` process for a test module: started on a free loopback port, waited on
until every model's worker is ready, stopped (SIGTERM, then SIGKILL) at the end."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import tempfile
import time

from magi_zoo.serve.pool import free_port


def png_data_url(image) -> str:
    """A PIL image as the inline `data:image/png;base64,...` URL a request sends."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Server:
    """One `python -m magi_zoo.cli serve ...` process and its base URL."""

    def __init__(self, *args: str, key: str | None = None, timeout: float = 120.0, cwd=None, gpu: str = "cpu",
                 compile: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        cmd = [sys.executable, "-m", "magi_zoo.cli", "serve", *args, "--gpu", gpu, "--port", str(self.port),
               "--log-level", "warning"] + ([] if compile else ["--no-compile"])
        if key:
            cmd += ["--api-key", key]
        env = {**os.environ, "MAGI_ZOO_API_KEY": ""}
        # the log goes to a file: a pipe nobody reads would block the server once full
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.wait_ready(timeout)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def health(self) -> dict:
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                h = self.health()
                if all(m["ready"] == m["workers"] for m in h["models"]):
                    return
                if h["status"] != "ok":
                    raise RuntimeError(f"a model failed to load: {h}")
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        """What the server (and its workers) printed so far."""
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def call(server, method: str, path: str, body=None, *, headers=None, raw: bytes | None = None):
    """(status, parsed JSON or bytes) of one request to `server` (its key sent where it has one)."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {**server.headers(), **({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    req = urllib.request.Request(server.url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            payload, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        payload, status = e.read(), e.code
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload


def wait_job(server, job_id: str, timeout: float = 60.0, until=None, poll: float = 0.05) -> dict:
    """The job once `until(job)` holds (default: it ended -- completed, failed or cancelled),
    polling GET /v1/jobs/{id}; an AssertionError with the last state after `timeout` s."""
    done = until or (lambda j: j["status"] in ("completed", "failed", "cancelled"))
    deadline = time.monotonic() + timeout
    job = None
    while time.monotonic() < deadline:
        job = call(server, "GET", f"/v1/jobs/{job_id}")[1]
        if done(job):
            return job
        time.sleep(poll)
    raise AssertionError(f"job {job_id} did not get there in {timeout} s: {job}")
