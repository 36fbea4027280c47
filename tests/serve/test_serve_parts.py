"""The serve package's parts without a server: progress read off real tqdm bars, a cancel
raised at the next update, a job ending once, the job table's eviction, the request checks."""

from __future__ import annotations

import asyncio
import io
import sys

import pytest
from tqdm import tqdm

pytest.importorskip("fastapi")  # the serve extra: magi_zoo.serve's error responses are FastAPI's

from magi_zoo.serve.errors import RequestError  # noqa: E402 -- after the skip above
from magi_zoo.serve.jobs import Job, JobTable
from magi_zoo.serve.pool import death_message
from magi_zoo.serve.schemas import ImageRequest, JobRequest, VideoRequest
from magi_zoo.serve.served import ServedModel, parse_size
from magi_zoo.serve.worker import JobCancelled, ProgressTap
from helpers.serve_server import png_data_url


def test_progress_is_read_off_a_real_tqdm_bar_and_a_cancel_raises_at_the_next_update():
    seen, echo = [], io.StringIO()
    tap = ProgressTap(echo, lambda d, t: seen.append((d, t)), lambda: False)
    for _ in tqdm(range(5), file=tap, mininterval=0, desc="denoise"):
        pass
    assert seen[0] == (0, 5) and seen[-1] == (5, 5) and (3, 5) in seen
    tap.write("a log line\n")
    assert echo.getvalue() == "a log line\n"  # other text passes through; the bar does not
    ProgressTap(echo, lambda d, t: seen.append((d, t)), lambda: False).write("  block 2/4: 12 frames decoded\n")
    assert seen[-1] == (2, 4)  # Self-Forcing's block lines
    stop = {"now": False}
    tap = ProgressTap(echo, lambda d, t: stop.update(now=d >= 2), lambda: stop["now"])
    with pytest.raises(JobCancelled):
        for _ in tqdm(range(10), file=tap, mininterval=0):
            pass


def test_a_job_ends_once_and_the_table_drops_the_oldest_ended_with_its_files(tmp_path):
    async def run():
        jobs = [Job("m", "image", "p", {}) for _ in range(3)]
        assert jobs[0].finish("failed", error="first", code="x")
        assert not jobs[0].finish("completed")  # a late answer never overwrites the first end
        assert (jobs[0].status, jobs[0].error) == ("failed", "first")
        table = JobTable(keep=1)
        for j in jobs:
            table.add(j)
        f = tmp_path / "a.png"
        f.write_bytes(b"x")
        jobs[1].finish("completed", files={"content": f})
        table.add(Job("m", "image", "p", {}))  # two ended now, one kept: the older ended one goes
        assert table.get(jobs[0].id) is None and table.get(jobs[1].id) is jobs[1] and f.exists()
        jobs[2].finish("cancelled")
        table.add(Job("m", "image", "p", {}))
        assert table.get(jobs[1].id) is None and not f.exists()  # its file deleted with it
        await jobs[2].wait()  # already ended: returns at once
    asyncio.run(run())


def test_death_message_names_the_signal():
    assert death_message(-9) == "killed by SIGKILL"
    assert death_message(3) == "exited with status 3"


def test_request_checks_name_the_field_before_any_work():
    flux = ServedModel("flux-tiny")
    job = flux.image_job(ImageRequest(model="flux-tiny", prompt="x", size="64x32", num_inference_steps=3))
    assert job.options == {"num_inference_steps": 3, "height": 32, "width": 64}
    with pytest.raises(RequestError) as e:
        flux.image_job(ImageRequest(model="flux-tiny", prompt="x", size="40x40"))
    assert e.value.param == "size" and "divisible" in e.value.message
    with pytest.raises(RequestError) as e:
        parse_size("9000x10")
    assert e.value.param == "size"
    with pytest.raises(RequestError) as e:
        flux.any_job(JobRequest(model="flux-tiny", prompt="x", num_frames=9))
    assert e.value.param == "num_frames" and "cannot use" in e.value.message  # an image model has no frames
    with pytest.raises(RequestError) as e:
        flux.video_job(VideoRequest(model="flux-tiny", prompt="x"))
    assert e.value.param == "model" and e.value.code == "unsupported_model"


def test_image_inputs_go_where_the_variant_takes_them():
    """A first frame (`input_reference`) is required by an image-to-video variant and refused
    by a text-to-video one; an image to edit or condition on goes to every image model that
    takes one (BAGEL's edit task, FLUX.2's conditioning image), its own limits checked before
    a job exists. The variants are looked up, never built."""
    from PIL import Image

    frame = Image.new("RGB", (96, 64))
    i2v = ServedModel("hunyuanvideo-1.5-480p-i2v")
    assert i2v.first_frame and i2v.card()["first_frame"]
    job = i2v.video_job(VideoRequest(model=i2v.name, prompt="x", num_inference_steps=2), image=frame)
    assert job.options["image"] is frame and job.options["num_inference_steps"] == 2
    with pytest.raises(RequestError) as e:  # no first frame: named as the request's field
        i2v.video_job(VideoRequest(model=i2v.name, prompt="x"))
    assert e.value.param == "input_reference" and "image-to-video" in e.value.message
    with pytest.raises(RequestError) as e:  # its size comes from the frame
        i2v.video_job(VideoRequest(model=i2v.name, prompt="x", size="832x480"), image=frame)
    assert e.value.param == "size"
    assert ServedModel("wan2.1-i2v-14b-480p").first_frame
    # seconds -> frames on the variant's own temporal step: LTX-2's VAE takes 1 + 8 k frames at 24 fps
    ltx = ServedModel("ltx-2").video_job(VideoRequest(model="ltx-2", prompt="x", seconds=4.5))
    assert ltx.options["num_frames"] == 1 + 8 * 14  # 4.5 s x 24 fps = 108 frames = 13.5 steps of 8, rounded
    wan = ServedModel("wan2.1-t2v-1.3b").video_job(VideoRequest(model="wan2.1-t2v-1.3b", prompt="x", seconds=5))
    assert wan.options["num_frames"] == 81  # 5 s x 16 fps = 80 = 20 steps of 4
    t2v = ServedModel("wan2.1-tiny")
    assert not t2v.first_frame
    with pytest.raises(RequestError) as e:
        t2v.video_job(VideoRequest(model="wan2.1-tiny", prompt="x"), image=frame)
    assert e.value.param == "input_reference" and "makes video from text" in e.value.message

    flux2 = ServedModel("flux.2-tiny")
    assert flux2.edits and flux2.card()["edits"]
    job = flux2.image_job(ImageRequest(model="flux.2-tiny", prompt="x", size="64x64"), image=frame)
    assert job.options["image"] is frame and job.options["height"] == 64 and "task" not in job.options
    with pytest.raises(RequestError) as e:  # FLUX.2 conditions on 64 px a side or more
        flux2.image_job(ImageRequest(model="flux.2-tiny", prompt="x"), image=Image.new("RGB", (32, 80)))
    assert e.value.param == "image" and "64x64" in e.value.message
    bagel = ServedModel("bagel-tiny").image_job(ImageRequest(model="bagel-tiny", prompt="x"), image=frame)
    assert bagel.options["task"] == "edit" and bagel.options["image"] is frame
    assert not ServedModel("flux-tiny").edits

    # the jobs API (the web page): the image as a data: URL
    url = png_data_url(frame)
    job = i2v.any_job(JobRequest(model=i2v.name, prompt="x", image=url))
    assert job.kind == "video" and job.options["image"].size == (96, 64)
    job = ServedModel("bagel-tiny").any_job(JobRequest(model="bagel-tiny", prompt="x", image=url))
    assert job.options["task"] == "edit"
    with pytest.raises(RequestError) as e:
        ServedModel("flux-tiny").any_job(JobRequest(model="flux-tiny", prompt="x", image=url))
    assert e.value.param == "image" and "takes no image" in e.value.message
    with pytest.raises(RequestError) as e:
        i2v.any_job(JobRequest(model=i2v.name, prompt="x", image="https://example.invalid/a.png"))
    assert e.value.param == "image" and "fetches nothing" in e.value.message


def test_a_job_runs_the_cli_run_path_writes_its_file_and_a_cancel_leaves_nothing(tmp_path, monkeypatch):
    import magi_zoo
    from magi_zoo.serve.worker import compile_info, run_job

    handle = magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    seen = []
    assert run_job(handle, "warm up", {}, None, None, lambda d, t: seen.append((d, t)), lambda: False) == {}
    assert seen[-1] == (2, 2)  # the warm-up (--warmup) at the model's defaults: 2 steps, nothing written
    out = tmp_path / "job.png"
    info = run_job(handle, "a cat", {"num_inference_steps": 3}, str(out), None, lambda d, t: seen.append((d, t)),
                   lambda: False)
    assert info == {"files": [str(out)]} and out.read_bytes()[:4] == b"\x89PNG" and seen[-1] == (3, 3)
    # A writer's own bar (PyAV's video encoder draws "1/1 [") is no step: in a group only the
    # writing rank would report it, and meet a collective its peers never join.
    import magi_zoo.cli.commands.run as run_command

    real_write = run_command.write_output

    def write_with_a_bar(*args, **kwargs):
        print("Encoding video chunks: 100%|##########| 1/1 [00:00<00:00, 95.53it/s]", file=sys.stderr)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(run_command, "write_output", write_with_a_bar)
    seen.clear()
    run_job(handle, "a cat", {"num_inference_steps": 3}, str(tmp_path / "barred.png"), None,
            lambda d, t: seen.append((d, t)), lambda: False)
    assert seen[-1] == (3, 3) and (1, 1) not in seen, seen
    (tmp_path / "barred.png").unlink()
    with pytest.raises(JobCancelled):
        run_job(handle, "a cat", {}, str(tmp_path / "cancelled.png"), None, lambda d, t: None, lambda: True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.png"]  # no file, no temporary half-file
    assert compile_info(handle) == {"frames": 0, "graph_breaks": 0, "recompiles": 0, "compile_s": 0.0,
                                    "cache": "unused"}  # eager: nothing compiled, no cache
