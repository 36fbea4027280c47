"""The endpoints. OpenAI's shapes where a family fits them:

    POST /v1/images/generations        image models (Flux, BAGEL): waits, answers b64_json or a url
    POST /v1/images/edits              BAGEL (edit), FLUX.2 (a conditioning image): a multipart form with the image
    POST /v1/videos                    video models (Wan, Self-Forcing, HunyuanVideo-1.5, LTX-2): a job; JSON
                                       or form; image-to-video variants take the first frame as `input_reference`
    GET  /v1/videos/{id}               its status and progress (percent)
    GET  /v1/videos/{id}/content       the .mp4
    DELETE /v1/videos/{id}             cancel it (and delete its file)
    POST /v1/chat/completions          Qwen3-Omni (text; speech with modalities ["text", "audio"]),
                                       BAGEL understanding (an image as a data: URL)
    GET  /v1/models

and the server's own: `/v1/jobs` (any model, any output: create, get, cancel, content,
audio), `/health`, `/metrics`, and the web page at `/`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import ValidationError

from .errors import RequestError, parse_json
from .jobs import Job
from .metrics import CONTENT_TYPE_LATEST
from .schemas import ChatRequest, ImageRequest, JobRequest, VideoRequest
from .served import decode_image

router = APIRouter()
MEDIA = {"image": "image/png", "video": "video/mp4", "text": "text/plain; charset=utf-8", "audio": "audio/wav"}


def validated(schema, data: Any):
    """`data` as `schema`, or a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object", code="invalid_value")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        raise RequestError(400, f"{field}: {first['msg']}", param=field or None, code="invalid_value") from None


async def body(request: Request) -> tuple[dict[str, Any], Any]:
    """The body as fields: JSON, or a form (multipart or urlencoded: what `openai`'s videos and
    image edits send); the second value is the uploaded file named `image`/`input_reference`."""
    kind = request.headers.get("content-type", "")
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form()
        fields, upload = {}, None
        for key, value in form.multi_items():
            if hasattr(value, "read"):
                if key not in ("image", "image[]", "input_reference"):
                    raise RequestError(400, f"unexpected file field {key!r}", param=key)
                upload = (key, await value.read())
            else:
                fields[key] = value
        return fields, upload
    return parse_json(await request.body()), None


def serve_state(request: Request):
    return request.app.state.serve


async def finished(request: Request, job: Job) -> Job:
    """Submit `job` and wait for its end; a failure is answered as an error."""
    state = serve_state(request)
    state.submit(job)
    await job.wait()
    if job.status != "completed":
        status = 503 if job.error_code in ("worker_died", "shutdown") else 500
        raise RequestError(status, f"job {job.id} {job.status}: {job.error}", code=job.error_code)
    return job


# -- OpenAI shapes ----------------------------------------------------------------------------
@router.get("/v1/models")
async def models(request: Request):
    cards = {m.name: m.card() for m in serve_state(request).models.values()}
    return {"object": "list", "data": list(cards.values())}


@router.get("/v1/models/{model_id}")
async def model(request: Request, model_id: str):
    return serve_state(request).model(model_id).card()


@router.post("/v1/images/generations")
async def images(request: Request):
    data, _ = await body(request)
    served = serve_state(request).model(data.get("model") if isinstance(data, dict) else None)
    req = validated(ImageRequest, data)
    job = await finished(request, served.image_job(req))
    return image_answer(request, job, req.response_format)


@router.post("/v1/images/edits")
async def image_edits(request: Request):
    data, upload = await body(request)
    served = serve_state(request).model(data.get("model"))
    if upload is None:
        raise RequestError(400, "send the image to edit as the form's file field 'image'", param="image")
    req = validated(ImageRequest, data)
    job = await finished(request, served.image_job(req, image=decode_image(upload[1], "image")))
    return image_answer(request, job, req.response_format)


def image_answer(request: Request, job: Job, response_format: str) -> dict:
    if response_format == "url":
        item = {"url": str(request.url_for("job_content", job_id=job.id))}
    else:
        item = {"b64_json": base64.b64encode(job.files["content"].read_bytes()).decode()}
    return {"created": int(job.created), "data": [item]}


@router.post("/v1/videos")
async def create_video(request: Request):
    data, upload = await body(request)
    served = serve_state(request).model(data.get("model") if isinstance(data, dict) else None)
    # the first frame of an image-to-video variant: the form's file (what `openai` sends), or
    # a data: URL in a JSON body; nothing is fetched
    reference = upload[1] if upload is not None else (data.pop("input_reference", None) if isinstance(data, dict)
                                                      else None)
    if upload is not None and upload[0] != "input_reference":
        raise RequestError(400, f"send the first frame as the file field 'input_reference' (got {upload[0]!r})",
                           param=upload[0])
    req = validated(VideoRequest, data)
    image = None if reference is None else decode_image(reference, "input_reference")
    job = serve_state(request).submit(served.video_job(req, image=image))
    return video_object(request, job)


def find(request: Request, job_id: str, kind: str | None = None) -> Job:
    job = serve_state(request).jobs.get(job_id)
    if job is None or (kind is not None and job.kind != kind):
        raise RequestError(404, f"no {kind or 'job'} with id {job_id!r}", param="id", code="not_found")
    return job


def video_object(request: Request, job: Job) -> dict:
    served = serve_state(request).models[job.model]
    call = {**served.adapter.call_defaults(served.variant), **job.options}
    frames = call.get("num_frames") or 1
    return {"id": job.id, "object": "video", "model": job.model, "prompt": job.prompt,
            "status": "failed" if job.status == "cancelled" else job.status, "progress": job.percent,
            "created_at": int(job.created), "completed_at": int(job.finished) if job.finished else None,
            "size": f"{call.get('width')}x{call.get('height')}", "seconds": f"{frames / served.fps:g}",
            "error": {"code": job.error_code, "message": job.error} if job.error else None}


@router.get("/v1/videos/{job_id}")
async def get_video(request: Request, job_id: str):
    return video_object(request, find(request, job_id, "video"))


@router.get("/v1/videos/{job_id}/content")
async def video_content(request: Request, job_id: str):
    return content(find(request, job_id, "video"), "content")


@router.delete("/v1/videos/{job_id}")
async def delete_video(request: Request, job_id: str):
    job = find(request, job_id, "video")
    serve_state(request).pools[job.model].cancel(job)
    return {"id": job.id, "object": "video.deleted", "deleted": True}


@router.post("/v1/chat/completions")
async def chat(request: Request):
    data, _ = await body(request)
    served = serve_state(request).model(data.get("model") if isinstance(data, dict) else None)
    job = await finished(request, served.chat_job(validated(ChatRequest, data)))
    text = job.files["content"].read_text(encoding="utf-8").removesuffix("\n")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if job.audio:
        message["audio"] = {"id": job.id, "data": base64.b64encode(job.files["audio"].read_bytes()).decode(),
                            "expires_at": int(time.time()) + 3600, "transcript": text}
    return {"id": "chatcmpl-" + job.id.removeprefix("job_"), "object": "chat.completion", "created": int(job.created),
            "model": job.model, "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


# -- the server's own -------------------------------------------------------------------------
@router.post("/v1/jobs")
async def create_job(request: Request):
    data, _ = await body(request)
    served = serve_state(request).model(data.get("model") if isinstance(data, dict) else None)
    return serve_state(request).submit(served.any_job(validated(JobRequest, data))).public()


@router.get("/v1/jobs/{job_id}")
async def get_job(request: Request, job_id: str, wait: float = 0.0):
    """The job; `?wait=S` answers when it ends or after S seconds (at most 600), whichever is first."""
    job = find(request, job_id)
    if wait > 0 and not job.ended:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(job.wait()), min(wait, 600.0))
    return job.public()


@router.post("/v1/jobs/{job_id}/cancel")
async def cancel_job(request: Request, job_id: str):
    job = find(request, job_id)
    serve_state(request).pools[job.model].cancel(job)
    return job.public()


@router.get("/v1/jobs/{job_id}/content", name="job_content")
async def job_content(request: Request, job_id: str):
    return content(find(request, job_id), "content")


@router.get("/v1/jobs/{job_id}/audio")
async def job_audio(request: Request, job_id: str):
    return content(find(request, job_id), "audio")


def content(job: Job, which: str) -> Response:
    if job.status != "completed":
        raise RequestError(409 if not job.ended else 404, f"job {job.id} is {job.status}; its content exists once "
                           "it has completed", code="not_ready")
    path = job.files.get(which)
    if path is None or not path.is_file():
        raise RequestError(404, f"job {job.id} has no {which}", code="not_found")
    return FileResponse(path, media_type=MEDIA["audio" if which == "audio" else job.kind],
                        filename=f"{job.id}{path.suffix}")


@router.get("/health")
async def health(request: Request):
    pools = [p.health() for p in serve_state(request).pools.values()]
    ok = all(p["error"] is None for p in pools)
    return JSONResponse({"status": "ok" if ok else "degraded", "models": pools}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(serve_state(request).metrics.text(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse)
async def page():
    return HTMLResponse(resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8"))
