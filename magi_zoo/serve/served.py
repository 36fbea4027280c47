"""A served model: what it can answer, and a request turned into a checked job.

Requests are checked by the same code as `magi-zoo run`'s options, before a job exists:
`Adapter.check_call` (counts, sizes against the family's limits, the output against the
memory of the machine or card), then `Adapter.check_run` (the options this family takes, and
its own rules: Wan's frame counts, BAGEL's tasks, Self-Forcing's blocks). Their messages name
the CLI's flags; here each is answered as a 400 naming the request's field instead.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from .. import adapters
from ..adapters.base import FLAGS
from .errors import RequestError
from .jobs import Job
from .schemas import ChatRequest, ImageRequest, JobRequest, VideoRequest

MAX_IMAGE_BYTES = 20 * 2**20  # an input image, decoded
MAX_SIDE = 8192  # pixels per side: the server's sanity limit (schemas.Side), the model's own come after


class ServedModel:
    """One model the server loaded: its adapter and variant (found without building it)."""

    def __init__(self, name: str, gpu_memory_gib: float | None = None):
        self.adapter, self.variant = adapters.lookup(name)
        self.name = self.variant.name
        self.requested = name
        self.device_gib = gpu_memory_gib
        a, v = self.adapter, self.variant
        self.images = ".png" in a.out_suffixes(v, {})
        self.video = ".mp4" in a.out_suffixes(v, {})
        # an image to edit (BAGEL's edit task) or to condition on (FLUX.2): /v1/images/edits
        self.edits = self.images and "image" in a.run_options
        # a first frame, required: image-to-video variants take `input_reference` on /v1/videos
        self.first_frame = self.video and a.image_to_video(v)
        self.chat = ".txt" in a.out_suffixes(v, {}) or ".txt" in a.out_suffixes(v, {"task": "understand"})
        self.speaks = "audio_out" in a.run_options
        self.fps = v.config.get("fps", getattr(a, "fps", None)) or 16
        limits = a.call_limits(v)
        # a video's frames are 1 + k * step (its VAE's temporal factor): what `seconds` rounds to.
        # A family that states none (Self-Forcing: its own block rule, checked after) gets Wan's 4
        self.frame_step = (limits.frame_step if limits is not None else None) or 4

    def card(self) -> dict[str, Any]:
        """The model as `/v1/models` lists it (OpenAI's fields, then what the web page needs)."""
        a, v = self.adapter, self.variant
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "magi-zoo",
                "family": a.family, "outputs": [k for k, on in (("image", self.images), ("video", self.video),
                                                                 ("text", self.chat)) if on],
                "speaks": self.speaks, "edits": self.edits, "first_frame": self.first_frame,
                "options": list(a.run_options),
                "defaults": {k: x for k, x in a.call_defaults(v).items() if isinstance(x, (int, float, str))}}

    # -- requests -> jobs -------------------------------------------------------------------
    def check(self, options: dict[str, Any], *, kind: str, names: dict[str, str] | None = None) -> dict[str, Any]:
        """`options` (run names; None = not given) checked as `magi-zoo run` checks them; a
        failure is a 400 naming the request field (`names` maps a run option to it)."""
        names = names or {}
        field = lambda k: names.get(k, k)  # noqa: E731
        given = {k: x for k, x in options.items() if x is not None}
        a, v = self.adapter, self.variant
        try:
            a.check_call(v, {**a.call_defaults(v), **given}, name=field, device_gib=self.device_gib)
            out = Path("out" + {"image": ".png", "video": ".mp4", "text": ".txt"}[kind])
            checked = a.check_run(v, given, out)
            a.check_inputs(checked)  # an input image's own limits (FLUX.2: 64 px a side)
            return checked
        except (ValueError, TypeError) as e:
            text = " ".join(str(e).split())
            for key, flag in sorted(FLAGS.items(), key=lambda kv: -len(kv[1])):  # --steps names steps
                if flag in text:
                    text = text.replace(flag, field(key))
            # the field the message names: a given one, or one left out that is required
            param = next((field(k) for k in (*given, *options) if field(k) in text), None)
            raise RequestError(400, text, param=param, code="invalid_value") from None

    def image_job(self, req: ImageRequest, image=None) -> Job:
        self.need(self.images if image is None else self.edits, "images/edits" if image is not None else "images")
        height, width = parse_size(req.size)
        opts = dict(num_inference_steps=req.num_inference_steps, seed=req.seed, height=height, width=width)
        if image is not None:
            opts["image"] = image
            if "task" in self.adapter.run_options:  # BAGEL: an edit keeps the image's size
                opts.update(task="edit", height=None, width=None)
        names = {"height": "size", "width": "size", "image": "image"}
        return Job(self.name, "image", req.prompt, self.check(opts, kind="image", names=names))

    def video_job(self, req: VideoRequest, image=None) -> Job:
        """A video job; `image`: the first frame (`input_reference`), which an image-to-video
        variant requires and any other refuses."""
        self.need(self.video, "videos")
        if image is not None and not self.first_frame:
            raise RequestError(400, f"{self.name} makes video from text; it takes no input_reference (the served "
                               "image-to-video variants do: GET /v1/models, \"first_frame\": true)",
                               param="input_reference")
        if req.seconds is not None and req.num_frames is not None:
            raise RequestError(400, "give seconds or num_frames, not both", param="seconds")
        frames = req.num_frames
        if req.seconds is not None:  # 1 + k * step frames: the variant's VAE temporal step (Wan 4, LTX-2 8)
            step = self.frame_step
            frames = 1 + step * max(1, round(req.seconds * self.fps / step))
        height, width = parse_size(req.size)
        opts = dict(num_inference_steps=req.num_inference_steps, seed=req.seed, height=height, width=width,
                    num_frames=frames, image=image)
        names = {"height": "size", "width": "size", "num_frames": "seconds" if req.seconds else "num_frames",
                 "image": "input_reference"}
        return Job(self.name, "video", req.prompt, self.check(opts, kind="video", names=names))

    def chat_job(self, req: ChatRequest) -> Job:
        self.need(self.chat, "chat/completions")
        if req.messages[-1].role != "user" or any(m.role not in ("system", "developer") for m in req.messages[:-1]):
            raise RequestError(400, "the models here answer one prompt per call: send system messages (optional) "
                               "and one user message, last", param="messages")
        texts, images = [], []
        for m in req.messages:
            parts = [m.content] if isinstance(m.content, str) else m.content
            for p in parts:
                if isinstance(p, str):
                    texts.append(p)
                elif p.type == "text":
                    texts.append(p.text)
                else:
                    images.append(decode_image(p.image_url.url, "messages"))
        if len(images) > 1:
            raise RequestError(400, "at most one image per request", param="messages")
        speak = "audio" in (req.modalities or [])
        if speak and not self.speaks:
            raise RequestError(400, f"{self.name} does not speak; drop \"audio\" from modalities", param="modalities")
        opts: dict[str, Any] = dict(max_new_tokens=req.max_completion_tokens or req.max_tokens, seed=req.seed)
        if req.audio is not None and req.audio.voice is not None:
            opts["voice"] = req.audio.voice
        if images:
            opts["image"] = images[0]
        if "task" in self.adapter.run_options:  # BAGEL: understanding is its text task
            opts["task"] = "understand"
        if speak:  # checked as `run --audio-out` is; the worker writes the job's own .wav
            opts["audio_out"] = "speech.wav"
        names = {"max_new_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                 "voice": "audio.voice", "image": "messages", "audio_out": "modalities"}
        prompt = "\n".join(t for t in texts if t.strip())
        if not prompt:
            raise RequestError(400, "the messages hold no text", param="messages")
        return Job(self.name, "text", prompt, without_audio_out(self.check(opts, kind="text", names=names)), audio=speak)

    def any_job(self, req: JobRequest) -> Job:
        kind = "video" if self.video else "image" if self.images else "text"
        if req.speech and not self.speaks:
            raise RequestError(400, f"{self.name} does not speak", param="speech")
        opts = req.model_dump(exclude={"model", "prompt", "speech", "image"})
        if req.image is not None:
            if not (self.edits or self.first_frame):
                raise RequestError(400, f"{self.name} takes no image", param="image")
            opts["image"] = decode_image(req.image, "image")
            if "task" in self.adapter.run_options:  # BAGEL: an image to edit
                opts["task"] = "edit"
        if req.speech:
            opts["audio_out"] = "speech.wav"
        given = self.check(opts, kind=kind, names={"audio_out": "speech"})
        return Job(self.name, kind, req.prompt, without_audio_out(given), audio=req.speech)

    def need(self, ok: bool, endpoint: str) -> None:
        if not ok:
            raise RequestError(400, f"{self.name} ({self.adapter.family}) does not answer /v1/{endpoint}; it makes "
                               f"{', '.join(self.card()['outputs']) or 'nothing this server serves'}", param="model",
                               code="unsupported_model")


def without_audio_out(options: dict[str, Any]) -> dict[str, Any]:
    """The checked options less `audio_out`: the worker names the job's own .wav file."""
    return {k: v for k, v in options.items() if k != "audio_out"}


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """OpenAI's "WIDTHxHEIGHT" (the pattern was checked) -> (height, width)."""
    if size is None:
        return None, None
    w, h = (int(x) for x in size.split("x"))
    if not (1 <= w <= MAX_SIDE and 1 <= h <= MAX_SIDE):
        raise RequestError(400, f"size {size!r}: each side is 1 to {MAX_SIDE} pixels", param="size",
                           code="invalid_value")
    return h, w


def decode_image(data: bytes | str, param: str):
    """An image sent in the request (bytes, or a base64 `data:` URL; nothing is fetched) as
    an RGB PIL image, or a 400 naming `param`."""
    from PIL import Image, UnidentifiedImageError  # lazy: PIL is needed only by requests with images

    if isinstance(data, str):
        head, sep, b64 = data.partition(",")
        if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
            raise RequestError(400, "images are sent inline as data:image/...;base64,... URLs (the server fetches "
                               "nothing)", param=param)
        try:
            data = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(400, "the image's base64 does not decode", param=param) from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height * 4 > MAX_IMAGE_BYTES:
                raise RequestError(400, f"the image is {img.width}x{img.height}: too large (at most "
                                   f"{MAX_IMAGE_BYTES // 2**20} MiB decoded)", param=param)
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise RequestError(400, f"not an image PIL can read ({type(e).__name__}); send a PNG, JPEG or WebP",
                           param=param) from None
