"""OpenAI's Batch API against a real `mstar serve llama` (the tiny preset), driven by the official `openai` client:
upload, create, poll, download; each output line is what the same request answers live (the same route and
pipeline); a line naming an unserved model lands in the error file; bad files are 400s naming the line and field;
and a server killed mid-job resumes it after a restart, running only the lines without a result."""

from __future__ import annotations

import io
import time

import openai
import orjson
import pytest
from openai import OpenAI

from tests.server.helpers import Server

pytest.importorskip("mstar_llm")
pytest.importorskip("mstar_kvcache")

TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = Server(["llama"], "--state-dir", str(tmp_path_factory.mktemp("state")))
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()[-3000:]
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


def client_of(srv: Server) -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(served):
    return client_of(served)


def jsonl(rows) -> io.BytesIO:
    return io.BytesIO(b"".join(orjson.dumps(r) + b"\n" for r in rows))


#: <|im_end|> (2) held off: the tiny preset ends its replies by itself; these lines run to their max_tokens
TO_LENGTH = {"logit_bias": {"2": -100}}


def chat_line(cid: str, content: str, max_tokens: int, model: str = "llama") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     **TO_LENGTH}}


def run_batch(client: OpenAI, rows, endpoint: str, timeout: float = 120.0, **kw):
    uploaded = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **kw)
    assert batch.status in ("validating", "in_progress") and batch.input_file_id == uploaded.id
    deadline = time.monotonic() + timeout
    while batch.status not in TERMINAL:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return uploaded, batch


def lines_of(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [orjson.loads(r) for r in client.files.content(file_id).content.splitlines()]


def test_chat_batch_round_trip(client):
    rows = [chat_line(f"q{i}", f"Question {i}?", 6 + i) for i in range(4)]
    rows.insert(2, chat_line("unserved", "hi", 4, model="no-such-model"))
    uploaded, batch = run_batch(client, rows, "/v1/chat/completions", metadata={"run": "round-trip"})
    assert batch.status == "completed" and batch.metadata == {"run": "round-trip"}
    assert batch.request_counts.total == 5 and batch.request_counts.completed == 4 and batch.request_counts.failed == 1
    out = lines_of(client, batch.output_file_id)
    assert [r["custom_id"] for r in out] == ["q0", "q1", "q2", "q3"]
    for i, r in enumerate(out):
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6 + i
        # the same request answered live (greedy): the same text, so the same route and pipeline ran
        live = client.chat.completions.create(model="llama", messages=rows[i if i < 2 else i + 1]["body"]["messages"],
                                              max_tokens=6 + i, **TO_LENGTH)
        assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
    err = lines_of(client, batch.error_file_id)
    assert [r["custom_id"] for r in err] == ["unserved"]
    assert err[0]["response"]["status_code"] == 404 and err[0]["error"]["code"] == "model_not_found"
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    outputs = {f.id for f in client.files.list(purpose="batch_output")}
    assert {batch.output_file_id, batch.error_file_id} <= outputs
    assert client.files.retrieve(uploaded.id).purpose == "batch"


def test_completions_and_responses_batches(client):
    rows = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
             "body": {"model": "llama", "prompt": "Once upon a time", "max_tokens": 5, **TO_LENGTH}}]
    _, batch = run_batch(client, rows, "/v1/completions")
    (line,) = lines_of(client, batch.output_file_id)
    assert line["response"]["body"]["object"] == "text_completion"
    assert line["response"]["body"]["usage"]["completion_tokens"] == 5
    rows = [{"custom_id": "r", "method": "POST", "url": "/v1/responses",
             "body": {"model": "llama", "input": "Say hi", "max_output_tokens": 5}}]
    _, batch = run_batch(client, rows, "/v1/responses")
    (line,) = lines_of(client, batch.output_file_id)
    # (the Responses API takes no logit_bias: the tiny preset's reply ends by itself, greedy, within the 5)
    body = line["response"]["body"]
    assert body["object"] == "response" and body["status"] == "completed" and 1 <= body["usage"]["output_tokens"] <= 5


def test_bad_files_are_400s_naming_line_and_field(client):
    rows = [chat_line("a", "x", 4), chat_line("a", "y", 4)]
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    assert info.value.body["param"] == "line[2].custom_id" and "line 2" in info.value.body["message"]
    mixed = [chat_line("a", "x", 4), {**chat_line("b", "y", 4), "url": "/v1/completions"}]
    uploaded = client.files.create(file=("in.jsonl", jsonl(mixed)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert info.value.body["param"] == "line[2].url"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 24)


def test_cancel(client):
    rows = [chat_line(f"l{i}", f"long {i}", 200) for i in range(12)]
    uploaded = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    deadline = time.monotonic() + 60
    while cancelled.status != "cancelled":
        assert time.monotonic() < deadline, cancelled
        time.sleep(0.2)
        cancelled = client.batches.retrieve(batch.id)
    done = lines_of(client, cancelled.output_file_id)
    assert len(done) == cancelled.request_counts.completed < 12
    with pytest.raises(openai.ConflictError):  # a finished batch has nothing to cancel
        client.batches.cancel(run_batch(client, [chat_line("one", "x", 2)], "/v1/chat/completions")[1].id)


@pytest.mark.slow
def test_restart_resumes_unfinished_job(tmp_path):
    state = tmp_path / "state"
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("server: {batch_concurrency: 1}\n")
    first = Server(["llama"], "--state-dir", str(state), "--config", str(deploy))
    rows = [chat_line(f"r{i}", f"resume {i}", 120) for i in range(8)]
    try:
        c = client_of(first)
        uploaded = c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while (got := c.batches.retrieve(batch.id)).request_counts.completed < 2:
            assert got.status == "in_progress" and time.monotonic() < deadline, got
            time.sleep(0.1)
    finally:
        first.proc.kill()  # no shutdown: what is on disk is all the next server has
        first.proc.wait()
    assert got.status == "in_progress"
    second = Server(["llama"], "--state-dir", str(state), "--config", str(deploy))
    try:
        c = client_of(second)
        deadline = time.monotonic() + 180
        while (got := c.batches.retrieve(batch.id)).status not in TERMINAL:
            assert time.monotonic() < deadline, got
            time.sleep(0.3)
        assert got.status == "completed" and got.request_counts.completed == 8
        out = lines_of(c, got.output_file_id)
        assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(8)]  # each line once, in input order
        assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["usage"]["completion_tokens"] > 0
                   for r in out)
    finally:
        second.stop()
