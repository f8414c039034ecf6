"""The video job store alone: per-key bounds and isolation, retention sweep, cancellation on delete."""

from __future__ import annotations

import asyncio

import pytest

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.video_jobs import VideoJobStore, owner_of

FIELDS = {"model": "wan", "prompt": "p", "size": "720x1280", "seconds": "4"}


def test_owner_is_a_digest_of_the_bearer_key_never_the_key():
    assert owner_of("Bearer secret") == owner_of("Bearer secret") != owner_of("Bearer other")
    assert "secret" not in owner_of("Bearer secret") and owner_of(None) == "anonymous"


def test_bounded_per_key_and_invisible_to_other_keys():
    store = VideoJobStore(max_active=2, retention_s=60)
    a = [store.admit("a", **FIELDS) for _ in range(2)]
    with pytest.raises(ApiError) as info:
        store.admit("a", **FIELDS)
    assert info.value.status == 429
    store.admit("b", **FIELDS)  # another key has its own bound
    with pytest.raises(ApiError) as info:
        store.get("b", a[0].id)
    assert info.value.status == 404
    store.complete(a[0], b"mp4")  # a finished job no longer counts
    store.admit("a", **FIELDS)


def test_finished_jobs_are_swept_after_the_retention_time():
    store = VideoJobStore(max_active=4, retention_s=30)
    job = store.admit("a", **FIELDS)
    store.complete(job, b"mp4")
    assert job.expires_at == job.completed_at + 30
    store.sweep(now=job.expires_at - 1)
    assert store.get("a", job.id) is job
    store.sweep(now=job.expires_at)
    with pytest.raises(ApiError):
        store.get("a", job.id)


def test_delete_cancels_the_running_task_and_its_request():
    async def go():
        store = VideoJobStore(max_active=4, retention_s=30)
        job = store.admit("a", **FIELDS)
        cancelled = []

        class Handle:
            def cancel(self):
                cancelled.append(True)

        async def run(j):
            j.handle, j.status = Handle(), "in_progress"
            await asyncio.sleep(3600)

        store.launch(job, run)
        await asyncio.sleep(0.01)
        assert store.delete("a", job.id)["deleted"]
        await asyncio.sleep(0.01)
        return job, cancelled

    job, cancelled = asyncio.run(go())
    assert cancelled == [True] and job.task.done()


def test_metrics_count_jobs_by_status_and_a_deleted_running_job_once():
    from mstar_core.api.server.metrics import Metrics

    class Engine:  # an AsyncEngine with no model loaded, as the collector reads it
        models: dict = {}
        waiting = running = 0
        cluster = None

    async def go():
        store = VideoJobStore(max_active=4, retention_s=30)
        done, failed, running = (store.admit("a", **FIELDS) for _ in range(3))
        store.complete(done, b"x" * 1000)
        store._fail(failed, "server_error", "boom")

        async def run(j):
            j.status = "in_progress"
            await asyncio.sleep(3600)

        store.launch(running, run)
        await asyncio.sleep(0.01)
        mid = Metrics(Engine(), store).render().decode()
        store.delete("a", running.id)
        await asyncio.sleep(0.01)  # its cancelled task ends: it must not count again as failed
        return mid, Metrics(Engine(), store).render().decode()

    mid, after = asyncio.run(go())

    def sample(text: str, name: str, **labels: str) -> float:
        want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + want)))

    assert sample(mid, "mstar_video_jobs", model="wan", status="in_progress") == 1
    assert sample(mid, "mstar_video_jobs", model="wan", status="completed") == 1
    assert sample(mid, "mstar_video_jobs", model="wan", status="failed") == 1
    assert sample(mid, "mstar_video_job_bytes", model="wan") == 1000
    assert sample(after, "mstar_video_jobs", model="wan", status="in_progress") == 0  # a 0, not a vanished gauge
    assert sample(after, "mstar_video_jobs_finished_total", model="wan", ending="deleted") == 1
    assert sample(after, "mstar_video_jobs_finished_total", model="wan", ending="failed") == 1
    assert sample(after, "mstar_video_jobs_finished_total", model="wan", ending="completed") == 1


def test_the_mp4_written_chunk_by_chunk_is_the_whole_one():
    import io

    import av
    import numpy as np

    from mstar_core.api.media.mp4 import Mp4Writer, encode_mp4

    # smooth moving patterns (random noise does not survive 4:2:0 chroma: ~13 dB whatever the writer does)
    t, y, x = np.arange(13)[:, None, None], np.arange(32)[None, :, None], np.arange(48)[None, None, :]
    frames = np.stack([128 + 100 * np.sin(0.2 * x + 0.3 * t + c) * np.cos(0.15 * y - 0.2 * t) for c in (0, 1, 2)],
                      -1).clip(0, 255).astype(np.uint8)
    writer = Mp4Writer(8)
    for a, b in ((0, 5), (5, 9), (9, 13)):
        writer.add(frames[a:b])

    def decoded(data: bytes) -> list:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            assert stream.average_rate == 8
            return [f.to_ndarray(format="rgb24") for f in container.decode(stream)]

    def psnr(a, b) -> float:
        return float(10 * np.log10(255**2 / np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))

    # every frame, in order, as faithful as the whole video encoded at once (~33 dB at CRF 18 here). Not the same
    # bytes: x264's output for the same frames differed between two encodes in one CI process under load.
    pieces, whole = decoded(writer.close()), decoded(encode_mp4(frames, 8))
    assert len(pieces) == len(whole) == 13
    assert all(psnr(p, f) > 30 for p, f in zip(pieces, frames, strict=True))
    assert all(abs(psnr(p, f) - psnr(w, f)) < 1.5 for p, w, f in zip(pieces, whole, frames, strict=True))
    with pytest.raises(ValueError, match=r"\[T, H, W, 3\]"):
        Mp4Writer(8).add(frames[:, :, :, :2])
    mixed = Mp4Writer(8)
    mixed.add(frames[:2])
    with pytest.raises(ValueError, match="chunk"):  # every chunk of one video has its size
        mixed.add(frames[:2, :16])


def test_the_mp4_is_scaled_to_the_size_the_client_asked_for():
    """A model drawing on its own grid (a multiple of 32; the tiny preset's 1/20 scale) still answers at `size`."""
    import io

    import av
    import numpy as np

    from mstar_core.api.media.mp4 import Mp4Writer

    y, x = np.arange(32)[:, None], np.arange(64)[None, :]
    frame = np.stack(np.broadcast_arrays((4 * x).clip(0, 255), (8 * y).clip(0, 255), 128 + 0 * x * y), -1).astype(np.uint8)
    writer = Mp4Writer(8, size=(1280, 640))
    writer.add(np.stack([frame] * 3))
    with av.open(io.BytesIO(writer.close())) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == 3 and decoded[0].shape == (640, 1280, 3)
    # the picture is the frame scaled, not padded or cropped: a coarse grid of it matches the source
    small = decoded[0].reshape(32, 20, 64, 20, 3).mean(axis=(1, 3))
    assert np.abs(small - frame).mean() < 6
    odd = Mp4Writer(8, size=(33, 17))  # 4:2:0 needs even sides: rounded up
    odd.add(frame[None])
    with av.open(io.BytesIO(odd.close())) as container:
        assert (container.streams.video[0].width, container.streams.video[0].height) == (34, 18)
