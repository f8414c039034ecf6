"""The Batch API's files, jobs and runner in-process, without a model: input files refused with the line and field
named, files and batches scoped to the API key, and the runner's behaviour on a fake dispatch (results in input
order in OpenAI's shape, 4xx answers in the error file, busy answers retried, resume after a stop running only the
lines without a result, cancel keeping what finished). The served round trip is tests/server/test_batch_api.py."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from fastapi.testclient import TestClient

from mstar_core.api.batch.files import FileStore
from mstar_core.api.batch.jobs import BatchStore
from mstar_core.api.batch.lines import check_batch_input
from mstar_core.api.batch.runner import BatchRunner
from mstar_core.api.http.errors import ApiError
from mstar_core.api.server.app import ServerConfig, create_app


def line(cid: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": cid}], **body}}


def jsonl(*items) -> bytes:
    return b"".join((i if isinstance(i, bytes) else orjson.dumps(i)) + b"\n" for i in items)


@pytest.mark.parametrize("data, param, words", [
    (jsonl(line("a"), line("a")), "line[2].custom_id", "already used on line 1"),
    (jsonl(line("a"), {**line("b"), "url": "/v1/embeddings"}), "line[2].url", "not a batch endpoint"),
    (jsonl(line("a"), {**line("b"), "method": "GET"}), "line[2].method", "POST"),
    (jsonl(b"{not json"), "line[1].", "not valid JSON"),
    (jsonl(line("a"), b"[1, 2]"), "line[2].", "JSON object"),
    (jsonl({**line("a"), "extra": 1}), "line[1].extra", "unknown key"),
    (jsonl({**line("a"), "custom_id": 7}), "line[1].custom_id", "non-empty string"),
    (jsonl(line("a", stream=True)), "line[1].body.stream", "stream"),
    (jsonl({**line("a"), "body": {"messages": []}}), "line[1].body.model", "model"),
    (jsonl(line("a")) + b"\n" + jsonl(line("b")), "line[2].", "empty"),
    (b"\xff\xfe", "line[1].", "UTF-8"),
])
def test_bad_lines_name_their_line_and_field(data, param, words):
    with pytest.raises(ApiError) as info:
        check_batch_input(data, max_lines=100)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_good_file_counts_lines_and_endpoints():
    data = jsonl(line("a"), line("b", url="/v1/completions"), line("c"))
    assert check_batch_input(data, 100) == (3, ["/v1/chat/completions", "/v1/completions"])
    assert check_batch_input(data.rstrip(b"\n"), 100)[0] == 3  # the final newline is optional
    with pytest.raises(ApiError, match="at most 2"):
        check_batch_input(data, 2)


@pytest.fixture
def client(tmp_path):
    config = ServerConfig(state_dir=str(tmp_path), batch_max_file_bytes=4096)
    app = create_app(config, engine_factory=lambda: None)
    return TestClient(app)  # no lifespan: no engine, the file and batch routes need none (jobs are not started)


def upload(client, data: bytes, key: str = "k1", purpose: str = "batch"):
    return client.post("/v1/files", data={"purpose": purpose}, files={"file": ("in.jsonl", data)},
                       headers={"Authorization": f"Bearer {key}"})


def test_files_routes_scope_by_key(client):
    made = upload(client, jsonl(line("a"), line("b")))
    assert made.status_code == 200, made.text
    meta = made.json()
    assert meta["object"] == "file" and meta["purpose"] == "batch" and meta["bytes"] == len(jsonl(line("a"), line("b")))
    assert not any(k.startswith("_") for k in meta)
    mine = {"Authorization": "Bearer k1"}
    other = {"Authorization": "Bearer k2"}
    assert [f["id"] for f in client.get("/v1/files", headers=mine).json()["data"]] == [meta["id"]]
    assert client.get("/v1/files", headers=other).json()["data"] == []
    assert client.get(f"/v1/files/{meta['id']}", headers=other).status_code == 404
    assert client.get(f"/v1/files/{meta['id']}/content", headers=mine).content == jsonl(line("a"), line("b"))
    assert client.delete(f"/v1/files/{meta['id']}", headers=other).status_code == 404
    assert client.delete(f"/v1/files/{meta['id']}", headers=mine).json()["deleted"] is True
    assert client.get(f"/v1/files/{meta['id']}", headers=mine).status_code == 404
    assert client.get("/v1/files/../../etc/passwd", headers=mine).status_code == 404


def test_upload_refusals(client):
    bad = upload(client, jsonl(line("a"), line("a")))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "line[2].custom_id"
    assert upload(client, jsonl(line("a")), purpose="fine-tune").json()["error"]["param"] == "purpose"
    big = upload(client, jsonl(*[line(str(i)) for i in range(60)]))
    assert big.status_code == 413 and big.json()["error"]["param"] == "file"
    assert client.post("/v1/files", data={"purpose": "batch"}).status_code == 400  # no file part


def test_batch_create_refusals(client):
    fid = upload(client, jsonl(line("a"), line("b", url="/v1/completions"))).json()["id"]
    h = {"Authorization": "Bearer k1"}

    def create(**kw):
        body = {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kw}
        return client.post("/v1/batches", json=body, headers=h)

    mixed = create()
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "line[2].url"
    assert create(endpoint="/v1/embeddings").json()["error"]["param"] == "endpoint"
    assert create(completion_window="1h").json()["error"]["param"] == "completion_window"
    assert create(metadata={str(i): "v" for i in range(17)}).json()["error"]["param"] == "metadata"
    assert create(input_file_id="file-" + "0" * 24).status_code == 404
    assert create(unknown=1).json()["error"]["param"] == "unknown"
    assert client.get("/v1/batches/batch_nope", headers=h).status_code == 404
    assert client.post("/v1/batches/batch_nope/cancel", headers=h).status_code == 404


# --- the runner, on a fake dispatch ---------------------------------------------------------------------------


class FakeDispatch:
    """Answers each line like a route: 200 with the line's content echoed, 400 for content 'bad', and a 503 first
    for content 'busy' (then 200); calls from number `hold_from` on (counting from 0) wait for `gate`."""

    def __init__(self, hold_from: int | None = None):
        self.calls: list[str] = []
        self.gate = asyncio.Event()
        self.hold_from = hold_from
        self.busy_seen = False

    async def __call__(self, url, body, cancelled):
        content = orjson.loads(body)["messages"][0]["content"]
        self.calls.append(content)
        if self.hold_from is not None and len(self.calls) > self.hold_from:
            waiter = asyncio.ensure_future(self.gate.wait())
            stop = asyncio.ensure_future(cancelled.wait())
            await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stop.cancel()
        if cancelled.is_set():
            return 499, orjson.dumps({"error": {"message": "client disconnected"}})
        if content == "bad":
            return 400, orjson.dumps({"error": {"message": "no", "type": "invalid_request_error", "code": None}})
        if content == "busy" and not self.busy_seen:
            self.busy_seen = True
            return 503, orjson.dumps({"error": {"message": "busy"}})
        return 200, orjson.dumps({"object": "chat.completion", "echo": content})


def make(tmp_path, dispatch, concurrency=2):
    files, jobs = FileStore(tmp_path / "files"), BatchStore(tmp_path / "batches")
    return files, jobs, BatchRunner(files, jobs, dispatch, concurrency)


def new_job(files, jobs, contents):
    data = jsonl(*[line(f"id-{c}-{i}", messages=[{"role": "user", "content": c}]) for i, c in enumerate(contents)])
    meta = files.create("o", "in.jsonl", "batch", data, lines=len(contents), endpoints=["/v1/chat/completions"])
    return jobs.create("o", meta["id"], "/v1/chat/completions", "24h", {"k": "v"}, len(contents))


async def wait_for(record, *statuses, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while record["status"] not in statuses:
        assert asyncio.get_running_loop().time() < deadline, record
        await asyncio.sleep(0.01)


def read_file(files, fid):
    return [orjson.loads(r) for r in files.data_path("o", fid).read_bytes().splitlines()]


async def test_runner_output_and_error_files(tmp_path, monkeypatch):
    monkeypatch.setattr("mstar_core.api.batch.runner.RETRY_FIRST", 0.01)
    dispatch = FakeDispatch()
    files, jobs, runner = make(tmp_path, dispatch)
    record = new_job(files, jobs, ["x", "bad", "busy", "y"])
    runner.start(record)
    await wait_for(record, "completed")
    out, err = read_file(files, record["output_file_id"]), read_file(files, record["error_file_id"])
    assert [r["custom_id"] for r in out] == ["id-x-0", "id-busy-2", "id-y-3"]  # input order
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    assert out[0]["response"]["body"] == {"object": "chat.completion", "echo": "x"}
    assert out[0]["id"].startswith("batch_req_") and out[0]["response"]["request_id"].startswith("req_")
    assert [r["custom_id"] for r in err] == ["id-bad-1"]
    assert err[0]["response"]["status_code"] == 400 and err[0]["error"]["code"] == "invalid_request_error"
    assert dispatch.calls.count("busy") == 2  # the 503 was retried, not recorded
    assert record["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert record["completed_at"] is not None and files.get("o", record["output_file_id"])["purpose"] == "batch_output"
    # what is on disk says the same (what a restarted server would read)
    assert BatchStore(tmp_path / "batches").get("o", record["id"])["status"] == "completed"


async def test_runner_resumes_only_unfinished_lines(tmp_path):
    dispatch = FakeDispatch(hold_from=1)  # line a finishes, b hangs
    files, jobs, runner = make(tmp_path, dispatch, concurrency=1)
    record = new_job(files, jobs, ["a", "b", "c", "d"])
    runner.start(record)
    while len(dispatch.calls) < 2:
        await asyncio.sleep(0.01)
    await runner.close()  # the server stops mid-job
    assert record["status"] == "in_progress"

    again = FakeDispatch()
    files2, jobs2, runner2 = make(tmp_path, again)
    resumed = jobs2.get("o", record["id"])
    assert resumed["status"] == "in_progress"
    runner2.resume()
    await wait_for(resumed, "completed")
    assert sorted(again.calls) == ["b", "c", "d"]  # a's result was kept; b (cut off) runs again
    out = read_file(files2, resumed["output_file_id"])
    assert [r["custom_id"] for r in out] == ["id-a-0", "id-b-1", "id-c-2", "id-d-3"]
    assert resumed["request_counts"]["completed"] == 4


async def test_cancel_keeps_what_finished(tmp_path):
    dispatch = FakeDispatch(hold_from=1)
    files, jobs, runner = make(tmp_path, dispatch, concurrency=1)
    record = new_job(files, jobs, ["a", "b", "c"])
    runner.start(record)
    while len(dispatch.calls) < 2:
        await asyncio.sleep(0.005)
    runner.cancel(record)  # b is running: it sees its client leave
    assert record["status"] in ("cancelling", "cancelled")
    await wait_for(record, "cancelled")
    assert [r["custom_id"] for r in read_file(files, record["output_file_id"])] == ["id-a-0"]
    assert record["error_file_id"] is None and "c" not in dispatch.calls
    assert record["cancelled_at"] is not None and record["request_counts"]["completed"] == 1
