"""The request bodies, as pydantic models: types, ranges and unknown fields are refused here,
with the field named, before a request reaches the model's own checks (`served.py`).

The OpenAI shapes take the fields their clients send (`size` as "WxH", `n`,
`response_format`, chat `messages`, `max_tokens`, `modalities`, `audio`); the model options
beyond them (`num_inference_steps`, `seed`, `num_frames`, ...) are the names `magi-zoo run`'s
options have in `magi_zoo.load`'s call, sent as extra body fields (the `openai` client's
`extra_body=`). The upper bounds are sanity limits of the server, far above any published
model's use; the model's own limits (pixel multiples, position tables, memory) come after.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _no_bool(v: Any) -> Any:
    if isinstance(v, bool):  # pydantic's lax mode reads true as 1; a count is never a yes/no
        raise ValueError("expected an integer, got a boolean")
    return v


Count = Annotated[int, BeforeValidator(_no_bool)]
Steps = Annotated[Count, Field(ge=1, le=1000)]
Side = Annotated[Count, Field(ge=1, le=8192)]
Seed = Annotated[Count, Field(ge=0, le=2**63 - 1)]
Prompt = Annotated[str, Field(min_length=1, max_length=20000)]
SIZE = r"^[0-9]{1,5}x[0-9]{1,5}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Options(Strict):
    """Model options every generation endpoint takes (None: the model's default)."""

    num_inference_steps: Steps | None = None
    seed: Seed | None = None


class ImageRequest(Options):
    """`POST /v1/images/generations` (and the fields of `/v1/images/edits`' form)."""

    model: str
    prompt: Prompt
    n: Annotated[Count, Field(ge=1, le=1)] = 1  # one image per request: each is its own job
    size: Annotated[str, Field(pattern=SIZE)] | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"


class VideoRequest(Options):
    """`POST /v1/videos` (JSON or the form the `openai` client sends)."""

    model: str
    prompt: Prompt
    size: Annotated[str, Field(pattern=SIZE)] | None = None
    seconds: Annotated[float, Field(gt=0, le=600)] | None = None  # num_frames = 1 + fps * seconds, rounded
    num_frames: Annotated[Count, Field(ge=1, le=4097)] | None = None


class JobRequest(Options):
    """`POST /v1/jobs`: any model, every option by its `run` name (the web page uses it)."""

    model: str
    prompt: Prompt
    height: Side | None = None
    width: Side | None = None
    num_frames: Annotated[Count, Field(ge=1, le=4097)] | None = None
    max_new_tokens: Annotated[Count, Field(ge=1, le=8192)] | None = None
    voice: Annotated[str, Field(max_length=64)] | None = None
    speech: bool = False  # a .wav of the reply too (models that speak)
    # a data: URL: the first frame of an image-to-video variant, or the image an image model
    # edits or conditions on (the body's size limit bounds it)
    image: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: Annotated[str, Field(max_length=50_000_000)]  # a data: URL; nothing is fetched
    detail: str | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class AudioFormat(Strict):
    voice: Annotated[str, Field(max_length=64)] | None = None
    format: Literal["wav"] = "wav"


class ChatRequest(Strict):
    """`POST /v1/chat/completions`: one user turn (the models run one prompt per call)."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1, max_length=64)]
    max_tokens: Annotated[Count, Field(ge=1, le=8192)] | None = None
    max_completion_tokens: Annotated[Count, Field(ge=1, le=8192)] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioFormat | None = None
    seed: Seed | None = None
    stream: Literal[False] | None = None
    n: Annotated[Count, Field(ge=1, le=1)] | None = None
