"""The FastAPI app: configuration, lifespan (workers up, graceful stop), errors, security.

Every refusal is an OpenAI-shaped JSON error, `{"error": {"message", "type", "param",
"code"}}`, with a 4xx status: a body that does not parse or validate (400, naming the
field), an unknown model (404), a missing or wrong key (401), a body over the size limit
(413), a full queue (429, with Retry-After). The bearer key is compared with
`hmac.compare_digest` (constant time: the comparison leaks no prefix of the key). The body
limit is enforced on the bytes received, not only on the Content-Length a client declares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from .errors import RequestError, error
from .jobs import JobTable
from .metrics import Metrics
from .pool import ModelPool, QueueFull
from .routes import router
from .served import ServedModel

@dataclasses.dataclass
class ServeConfig:
    """What `magi-zoo serve` was started with."""

    models: list[str]
    load: dict[str, Any]  # magi_zoo.load's arguments but the name (gpu, weights, compile, ...)
    devices: list[int | None] = dataclasses.field(default_factory=lambda: [None])  # one worker each (or nproc)
    nproc: int = 1  # processes per worker: a group of N over N devices (--nproc; the CPU: N processes)
    model_load: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # per model, over `load`
    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 32 * 2**20
    output_dir: Path | None = None  # None: a fresh temporary directory, removed at shutdown
    keep_jobs: int = 1000
    grace_s: float = 30.0  # how long running jobs may finish at shutdown
    warmup: bool = False
    gpu_memory_gib: float | None = None  # the card's memory: requests are checked against it

    def groups(self) -> list[tuple[int | None, ...]]:
        """The workers' devices: `devices` in consecutive groups of `nproc`."""
        return split_groups(self.devices, self.nproc)


def split_groups(devices: list[int | None], nproc: int) -> list[tuple[int | None, ...]]:
    """`devices` split into workers of `nproc` processes each: consecutive cards ([0, 1, 2, 3]
    by 2: (0, 1), (2, 3)); on the CPU ([None]) one group of `nproc` processes. A clear error
    when `nproc` does not divide the cards."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"--nproc {nproc!r}: expected a positive number of processes per worker")
    if devices == [None]:
        return [(None,) * nproc]
    if len(devices) % nproc:
        fits = [n for n in range(1, len(devices) + 1) if len(devices) % n == 0]
        raise ValueError(f"--nproc {nproc} does not divide the {len(devices)} device(s) {devices}: each worker is a "
                         f"group of {nproc} cards; name {nproc} x k cards with --devices (e.g. --devices "
                         f"{','.join(str(d) for d in devices[:nproc])}), or use --nproc {' / '.join(map(str, fits))}")
    return [tuple(devices[i:i + nproc]) for i in range(0, len(devices), nproc)]


class State:
    """What the routes share: the models, their pools, the jobs, the metrics."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = Metrics()
        self.models = {}
        for name in config.models:
            served = ServedModel(name, config.gpu_memory_gib)
            self.models[served.name] = served
            if served.requested != served.name:  # an alias answers too
                self.models[served.requested] = served
        self.owned_dir = config.output_dir is None
        self.out_dir = Path(tempfile.mkdtemp(prefix="magi-zoo-serve-")) if self.owned_dir else config.output_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.pools: dict[str, ModelPool] = {}
        self.jobs = JobTable(config.keep_jobs)

    def model(self, name: Any) -> ServedModel:
        if not isinstance(name, str) or name not in self.models:
            served = ", ".join(sorted({m.name for m in self.models.values()}))
            raise RequestError(404, f"unknown model {name!r}; this server serves: {served}", param="model",
                               code="model_not_found")
        return self.models[name]

    def submit(self, job):
        try:
            self.pools[job.model].submit(job)
        except RuntimeError as e:  # the model could not load, or the server is stopping
            raise RequestError(503, str(e), param="model", code="unavailable") from None
        return self.jobs.add(job)


class BodyLimit:
    """An ASGI middleware refusing bodies over `limit` bytes with 413: on Content-Length at
    once, and on the bytes actually received (a chunked body declares no length)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self.too_large(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise RequestError(413, self.message(), param=None, code="body_too_large")
            return message

        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception as e:  # raised by `counted` in a route, maybe wrapped by a middleware's task group
            if started or not over_limit(e):
                raise
            await self.too_large(scope, receive, send)

    def message(self) -> str:
        return f"the request body is over {self.limit} bytes (--max-body-mib on the server)"

    async def too_large(self, scope, receive, send):
        await error(413, self.message(), code="body_too_large")(scope, receive, send)


def over_limit(e: BaseException) -> bool:
    """`e` is (or groups) the body limit's refusal."""
    if isinstance(e, BaseExceptionGroup):
        return any(over_limit(x) for x in e.exceptions)
    return isinstance(e, RequestError) and e.code == "body_too_large"


def create_app(config: ServeConfig) -> FastAPI:
    """The app for `config`; its lifespan starts the workers and stops them."""
    state = State(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for served in {id(m): m for m in state.models.values()}.values():
            load = {**config.load, **config.model_load.get(served.name, {})}
            pool = ModelPool(served.name, load, config.groups(), out_dir=state.out_dir,
                             max_queue=config.max_queue, metrics=state.metrics, warmup=config.warmup)
            state.pools[served.name] = pool
            pool.start()
        try:
            yield
        finally:
            for pool in state.pools.values():
                await pool.shutdown(config.grace_s)
            if state.owned_dir:
                shutil.rmtree(state.out_dir, ignore_errors=True)
            else:  # a kept directory: no temporary half-file of a killed write stays behind
                for partial in state.out_dir.glob(".*.partial.*"):
                    partial.unlink(missing_ok=True)

    app = FastAPI(title="magi-zoo", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.middleware("http")
    async def bearer(request: Request, call_next):
        path = request.url.path
        if config.api_key is not None and not (path == "/" or path == "/health" or path.startswith("/static/")):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
                state.metrics.refused(401)
                return error(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                             code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError):
        state.metrics.refused(e.status)
        return error(e.status, e.message, param=e.param, code=e.code)

    @app.exception_handler(QueueFull)
    async def on_full(request: Request, e: QueueFull):
        state.metrics.refused(429)
        return error(429, str(e), code="queue_full", headers={"Retry-After": "1"})

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        return error(400, first["msg"], param=".".join(str(x) for x in first["loc"][1:]) or None,
                     code="invalid_value")

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, e: HTTPException):
        return error(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)

    app.include_router(router)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)  # added last: outermost, sees the bytes first
    return app
