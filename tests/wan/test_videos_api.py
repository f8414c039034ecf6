"""`/v1/videos` with the official openai client against `mstar serve wan` (the tiny preset, no other options)."""

from __future__ import annotations

import io
import time

import httpx
import pytest

from tests.server.helpers import API_KEY, Server, metric

openai = pytest.importorskip("openai")
av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def server():
    srv = Server(["wan"], wait=False, MSTAR_VIDEO_JOBS_PER_KEY="3")
    srv.wait_ready(240)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def _wait(client, video_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        seen.append(video.progress)
        if video.status in ("completed", "failed"):
            return video, seen
        time.sleep(0.05)
    raise AssertionError(f"video {video_id} still {video.status} after {timeout}s")


def _mp4_frames(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return frames, stream.average_rate


def test_create_retrieve_download_with_the_official_client(client):
    video = client.videos.create(model="wan", prompt="a red fox running through snow", size="720x1280", seconds="4",
                                 extra_body={"seed": 1, "num_steps": 3})
    assert video.object == "video" and video.status in ("queued", "in_progress", "completed")
    assert video.size == "720x1280" and video.seconds == "4" and video.model == "wan"
    done, progress = _wait(client, video.id)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    assert done.expires_at > done.completed_at
    assert progress == sorted(progress)  # progress only moves forward
    frames, rate = _mp4_frames(client.videos.download_content(video.id).read())
    # the tiny preset draws 720x1280 at 1/20 (36x64, floored to multiples of 32: 32 wide, 64 high); the file is
    # scaled to the size asked for; 4 s x 8 fps + 1 frames
    assert len(frames) == 33 and frames[0].shape == (1280, 720, 3) and rate == 8


def test_image_to_video_with_an_input_reference_file(client):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 30, 30)).save(buf, format="PNG")
    video = client.videos.create(model="wan", prompt="the red card flies away", size="1280x720", seconds="4",
                                 input_reference=("card.png", buf.getvalue(), "image/png"),
                                 extra_body={"num_steps": 2})
    done, _ = _wait(client, video.id)
    assert done.status == "completed", done.error
    frames, _ = _mp4_frames(client.videos.download_content(video.id).read())
    assert frames[0].shape == (720, 1280, 3)


def test_list_pages_with_after_limit_and_order(client):
    ids = [client.videos.create(model="wan", prompt=f"clip {i}", extra_body={"num_steps": 1}).id for i in range(3)]
    for i in ids:
        _wait(client, i)
    asc = [v.id for v in client.videos.list(order="asc", limit=100).data]
    assert [i for i in asc if i in ids] == ids
    page = client.videos.list(order="asc", limit=1, after=ids[0])
    assert [v.id for v in page.data] == [ids[1]] and page.has_more


def _jobs(server, status: str) -> float:
    return metric(server, "mstar_video_jobs", model="wan", status=status)


def test_a_job_survives_its_creator_disconnecting_mid_job(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as first:
        video_id = first.videos.create(model="wan", prompt="a boat", extra_body={"num_steps": 40}).id
        deadline = time.monotonic() + 60
        while (seen := first.videos.retrieve(video_id)).progress == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen.status == "in_progress" and seen.progress < 100  # the client leaves with the job half done
    # the first client is gone; a new one finds the job running or done, and its whole video
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as second:
        done, _ = _wait(second, video_id)
        assert done.status == "completed" and done.progress == 100
        frames, _ = _mp4_frames(second.videos.download_content(video_id).read())
        assert len(frames) == 33  # the default 4 s at the tiny preset's 8 fps: nothing lost
    assert metric(server, "mstar_video_job_bytes", model="wan") > 0  # kept for download until its retention


def _running_requests(server) -> float:
    return metric(server, "mstar_running_requests")


def _denoise(server, stat: str) -> float:
    return metric(server, "mstar_node_stat", model="wan", node="denoise", stat=stat)


def test_delete_cancels_a_running_job_and_frees_the_engine(client, server):
    deleted_before = metric(server, "mstar_video_jobs_finished_total", model="wan", ending="deleted")
    video = client.videos.create(model="wan", prompt="a long one", extra_body={"num_steps": 200})
    deadline = time.monotonic() + 60
    while client.videos.retrieve(video.id).progress == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    # mid-loop: the job is counted running and the diffusion engine holds its latents between steps
    assert _running_requests(server) >= 1 and _jobs(server, "in_progress") == 1
    held = []
    while not held and time.monotonic() < deadline:
        held = [b for b in (_denoise(server, "diffusion_held_bytes") for _ in range(20)) if b > 0]
    assert held and min(held) >= 48 * 9 * 4 * 2 * 4  # at least its latents (float32 [48, 9, 4, 2])
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    deadline = time.monotonic() + 10
    while _running_requests(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    # every counter is back to zero: no job held, no request running, nothing queued or held by the engine
    assert _running_requests(server) == 0
    assert _jobs(server, "in_progress") == _jobs(server, "queued") == 0
    assert metric(server, "mstar_video_jobs_finished_total", model="wan", ending="deleted") == deleted_before + 1
    # the device thread may still be inside the step that was under way when the job was deleted: it lets the call
    # go when that step ends (one step of the tiny model), so the engine's counters are read until then
    deadline = time.monotonic() + 10
    held_stats = ("diffusion_queued", "diffusion_held_requests", "diffusion_held_bytes")
    while any(_denoise(server, s) for s in held_stats) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [_denoise(server, s) for s in held_stats] == [0, 0, 0]


def test_jobs_are_bounded_per_api_key(client):
    jobs = [client.videos.create(model="wan", prompt="slow", extra_body={"num_steps": 200}) for _ in range(3)]
    try:
        with pytest.raises(openai.RateLimitError):
            client.videos.create(model="wan", prompt="one too many")
    finally:
        for job in jobs:
            client.videos.delete(job.id)


@pytest.mark.parametrize(("fields", "param"), [
    ({"size": "big"}, "size"), ({"seconds": "0"}, "seconds"), ({"extra_body": {"num_steps": 0}}, "num_steps"),
    ({"extra_body": {"colour": "red"}}, "colour"), ({"extra_body": {"seed": -1}}, "seed"),
    ({"seconds": "60", "size": "99999x720"}, "size"),
])
def test_bad_fields_are_4xx_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(model="wan", prompt="x", **fields)
    assert info.value.body["param"] == param, info.value.body


def test_unknown_video_is_404_and_unfinished_content_is_409(client, server):
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    video = client.videos.create(model="wan", prompt="pending", extra_body={"num_steps": 200})
    try:
        r = httpx.get(f"{server.url}/v1/videos/{video.id}/content", headers=server.headers, timeout=10)
        assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"
    finally:
        client.videos.delete(video.id)


@pytest.mark.parametrize(("method", "path", "kw", "param"), [
    ("post", "/v1/videos", {"json": ["a list"]}, None),
    ("post", "/v1/videos", {"content": b"--x\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=x"}},
     None),
    ("post", "/v1/videos", {"json": {"model": "wan", "prompt": "x", "input_reference": "not a file"}}, "input_reference"),
    ("post", "/v1/videos", {"json": {"model": "wan", "prompt": "x", "seed": 2**70}}, "seed"),
    ("get", "/v1/videos?limit=0", {}, "limit"),
    ("get", "/v1/videos?order=sideways", {}, "order"),
    ("get", "/v1/videos?after=video_unknown", {}, "after"),
    ("get", "/v1/videos/video_unknown/content?variant=thumbnail", {}, "video_id"),
])
def test_raw_bad_requests_are_4xx(server, method, path, kw, param):
    headers = {**server.headers, **kw.pop("headers", {})}
    r = getattr(httpx, method)(f"{server.url}{path}", headers=headers, timeout=30, **kw) if method == "get" else \
        httpx.request(method.upper(), f"{server.url}{path}", headers=headers, timeout=30, **kw)
    assert 400 <= r.status_code < 500, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text
