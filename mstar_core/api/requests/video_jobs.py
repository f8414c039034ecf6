"""Video jobs (`/v1/videos`): a generation that runs for minutes, owned by the API key that created it.

A job is submitted once and then runs on its own task, whatever its creator's connection does: a client
that disconnects mid-job loses nothing and reads it later. `DELETE` cancels a running job (the engines
free what the request held: pages, buffers, queued invocations) and forgets it. Each API key has at most
`max_active` jobs queued or running (a 429 beyond), and sees only its own jobs. A finished job (and its
MP4) is kept `retention_s` seconds after it completes, then dropped; the sweep runs on every access.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from mstar_core.api.http.errors import ApiError
from mstar_core.api.media.mp4 import Mp4Writer
from mstar_core.errors import RequestCancelled, RequestError

log = logging.getLogger("mstar.api.videos")

ACTIVE = ("queued", "in_progress")
STATUSES = (*ACTIVE, "completed", "failed")
ENDINGS = ("completed", "failed", "deleted")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else max(1, int(value))


@attrs.define(eq=False)
class VideoJob:
    """One job: what the client sees (`public()`) and what the server keeps (the request handle, the MP4)."""

    id: str
    owner: str
    model: str
    prompt: str
    size: str
    seconds: str
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None
    mp4: bytes | None = None
    handle: Any = None
    task: asyncio.Task | None = None
    order: int = 0  # creation order (created_at is whole seconds: ties are common)

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "prompt": self.prompt, "seconds": self.seconds, "size": self.size,
                "remixed_from_video_id": None, "error": self.error}


def owner_of(authorization: str | None) -> str:
    """Jobs belong to the bearer key that created them (a digest of it, never the key); no key: one shared owner."""
    token = (authorization or "").removeprefix("Bearer ").strip()
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else "anonymous"


class VideoJobStore:
    """Jobs by id, bounded per owner, swept after their retention time."""

    def __init__(self, max_active: int | None = None, retention_s: int | None = None):
        self.max_active = max_active or _env_int("MSTAR_VIDEO_JOBS_PER_KEY", 4)
        self.retention_s = retention_s or _env_int("MSTAR_VIDEO_RETENTION_S", 3600)
        self.jobs: dict[str, VideoJob] = {}
        self._created = itertools.count()
        self._models: set[str] = set()  # every model that had a job (its gauges stay, at 0 when it has none)
        self.finished: Counter = Counter()  # (model, completed | failed | deleted) -> jobs since start

    def sweep(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for job in [j for j in self.jobs.values() if j.expires_at is not None and j.expires_at <= now]:
            del self.jobs[job.id]

    def admit(self, owner: str, **fields: Any) -> VideoJob:
        """A queued job for `owner`, counted against its bound from now on (429 past it)."""
        self.sweep()
        active = sum(1 for j in self.jobs.values() if j.owner == owner and j.status in ACTIVE)
        if active >= self.max_active:
            raise ApiError(429, f"this API key has {active} video jobs queued or running (at most {self.max_active}); "
                                "wait for one to finish or DELETE one", type_="rate_limit_error",
                           code="too_many_video_jobs")
        job = VideoJob(id=f"video_{secrets.token_hex(12)}", owner=owner, order=next(self._created), **fields)
        self.jobs[job.id] = job
        self._models.add(job.model)
        return job

    def discard(self, job: VideoJob) -> None:
        """Forget a job that never started (its request was refused)."""
        self.jobs.pop(job.id, None)

    def launch(self, job: VideoJob, run: Callable[[VideoJob], Awaitable[None]]) -> None:
        """Run `run(job)` on a task of its own: the job outlives the request that created it."""
        job.task = asyncio.ensure_future(self._guarded(job, run))

    async def _guarded(self, job: VideoJob, run: Callable[[VideoJob], Awaitable[None]]) -> None:
        try:
            await run(job)
        except asyncio.CancelledError:
            if job.status in ACTIVE:
                self._fail(job, "cancelled", "the job was cancelled")
        except RequestError as exc:
            self._fail(job, "invalid_request" if exc.status < 500 else "server_error", str(exc))
        except ApiError as exc:
            self._fail(job, exc.code or "invalid_request", exc.message)
        except RequestCancelled:
            self._fail(job, "cancelled", "the job was cancelled")
        except Exception as exc:  # a job's failure stays in the job
            log.exception("video job %s failed", job.id)
            self._fail(job, "server_error", f"{type(exc).__name__}: {exc}")

    def _fail(self, job: VideoJob, code: str, message: str) -> None:
        job.status, job.error = "failed", {"code": code, "message": message}
        self._finish(job)

    def _finish(self, job: VideoJob) -> None:
        if self.jobs.get(job.id) is job:  # (a deleted job's cancelled task ends here too: counted as deleted)
            self.finished[(job.model, job.status)] += 1
        job.completed_at = int(time.time())
        job.expires_at = job.completed_at + self.retention_s

    def complete(self, job: VideoJob, mp4: bytes) -> None:
        job.mp4, job.status, job.progress = mp4, "completed", 100
        self._finish(job)

    def get(self, owner: str, video_id: str) -> VideoJob:
        self.sweep()
        job = self.jobs.get(video_id)
        if job is None or job.owner != owner:
            raise ApiError(404, f"no video '{video_id}' (unknown, deleted, expired, or another API key's)",
                           param="video_id", code="video_not_found")
        return job

    def list(self, owner: str, after: str | None, limit: int, order: str) -> dict[str, Any]:
        self.sweep()
        mine = sorted((j for j in self.jobs.values() if j.owner == owner), key=lambda j: j.order,
                      reverse=order == "desc")
        if after is not None:
            ids = [j.id for j in mine]
            if after not in ids:
                raise ApiError(400, f"'after' names no video of this key: {after!r}", param="after")
            mine = mine[ids.index(after) + 1:]
        page = mine[:limit]
        return {"object": "list", "data": [j.public() for j in page], "has_more": len(mine) > limit,
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}

    def delete(self, owner: str, video_id: str) -> dict[str, Any]:
        job = self.get(owner, video_id)
        if job.handle is not None:
            job.handle.cancel()  # every engine the request touched frees its state
        if job.task is not None and not job.task.done():
            job.task.cancel()
        del self.jobs[job.id]
        self.finished[(job.model, "deleted")] += 1
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    def counts(self) -> Counter:
        return Counter(j.status for j in self.jobs.values())

    def stats(self) -> dict[str, dict[str, float]]:
        """What `/metrics` shows, per model: jobs held by status (every status of a model that ever had a job,
        zeros included, so a gauge drops to 0 rather than vanishing), jobs finished since start by how they
        ended (completed, failed, deleted), and the bytes of finished MP4s kept for download."""
        out = {model: {**{f"jobs_{s}": 0.0 for s in STATUSES}, **{f"finished_{s}": 0.0 for s in ENDINGS},
                       "mp4_bytes": 0.0} for model in self._models}
        for job in self.jobs.values():
            out[job.model][f"jobs_{job.status}"] += 1
            out[job.model]["mp4_bytes"] += len(job.mp4 or b"")
        for (model, ending), n in self.finished.items():
            out[model][f"finished_{ending}"] = float(n)
        return out

    async def close(self) -> None:
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for j in self.jobs.values():
            if j.handle is not None:
                j.handle.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def follow_video_job(job: VideoJob, *, store: VideoJobStore, handle: Any, adapter: Any) -> None:
    """Follow a submitted request: its emitted outputs give the progress, and its chunks of frames (when the
    adapter names them) go into the MP4 as they arrive; the encoder runs off the event loop."""
    job.handle, job.status = handle, "in_progress"
    prepared = getattr(handle, "prepared", None) or {}
    width, height = (int(v) for v in job.size.lower().split("x"))  # (checked by the route: WIDTHxHEIGHT)
    writer = Mp4Writer(adapter.video_fps(prepared), size=(width, height))
    chunks = adapter.video_frames_output
    emitted: Counter = Counter()
    async for out in handle:
        emitted[out.name] += 1
        if chunks is not None and out.name == chunks:
            await asyncio.to_thread(writer.add, out.value)
        job.progress = max(job.progress, min(99, int(100 * adapter.video_progress(prepared, emitted))))
    env = await handle.result()
    if not writer.frames:  # the adapter streams no chunks: the whole video from the final env
        await asyncio.to_thread(writer.add, adapter.video_from_env(env, prepared))
    mp4 = await asyncio.to_thread(writer.close)
    job.handle = None
    store.complete(job, mp4)
