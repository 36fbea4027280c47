"""Jobs: ids, status, progress, the files they wrote, and the table the server keeps them in.

A job moves queued -> in_progress -> completed | failed | cancelled, once: `finish` sets the
end state and wakes every waiter, and a second `finish` is ignored (a worker's late answer
after a cancel or a shutdown never overwrites the first end). Ids are random
(`job_<24 hex>`); a request names a job by id only, and the table maps the id to the paths
the server itself chose, so no path from a request ever reaches the filesystem.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

END_STATES = ("completed", "failed", "cancelled")


@dataclasses.dataclass
class Job:
    """One request's work: what to run, where it stands, what it wrote."""

    model: str
    kind: str  # "image" | "video" | "text": what the output is
    prompt: str
    options: dict[str, Any]  # run options, checked (adapter.check_run) before the job was made
    audio: bool = False  # a speech .wav beside the text
    id: str = dataclasses.field(default_factory=lambda: "job_" + secrets.token_hex(12))
    created: float = dataclasses.field(default_factory=time.time)
    status: str = "queued"
    done_steps: int = 0
    total_steps: int = 0
    error: str | None = None
    error_code: str | None = None
    files: dict[str, Path] = dataclasses.field(default_factory=dict)  # "content" / "audio" -> path
    started: float | None = None
    finished: float | None = None
    cancel_requested: bool = False
    retried: bool = False  # run again once because its worker was found dead before it began
    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event, repr=False)

    @property
    def ended(self) -> bool:
        return self.status in END_STATES

    @property
    def percent(self) -> int:
        if self.status == "completed":
            return 100
        return int(100 * self.done_steps / self.total_steps) if self.total_steps else 0

    def start(self) -> None:
        self.status, self.started = "in_progress", time.time()

    def finish(self, status: str, *, error: str | None = None, code: str | None = None,
               files: dict[str, Path] | None = None) -> bool:
        """End the job (False if it had ended already: the first end stands)."""
        if self.ended:
            return False
        self.status, self.error, self.error_code, self.finished = status, error, code, time.time()
        self.files = dict(files or {})
        self.event.set()
        return True

    async def wait(self) -> None:
        await self.event.wait()

    def public(self) -> dict[str, Any]:
        """The job as the generic jobs API shows it."""
        return {"id": self.id, "object": "job", "model": self.model, "kind": self.kind, "status": self.status,
                "progress": {"done": self.done_steps, "total": self.total_steps, "percent": self.percent},
                "created_at": int(self.created), "completed_at": int(self.finished) if self.finished else None,
                "error": {"code": self.error_code, "message": self.error} if self.error else None,
                "content": sorted(self.files)}


class JobTable:
    """The jobs by id, newest last; past `keep` ended jobs the oldest ended one is dropped and
    its files deleted (a server that runs for weeks does not fill its disk)."""

    def __init__(self, keep: int = 1000):
        self.keep = keep
        self.jobs: OrderedDict[str, Job] = OrderedDict()

    def add(self, job: Job) -> Job:
        self.jobs[job.id] = job
        ended = [j for j in self.jobs.values() if j.ended]
        for old in ended[: max(0, len(ended) - self.keep)]:
            for path in old.files.values():
                path.unlink(missing_ok=True)
            del self.jobs[old.id]
        return job

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)
