"""A batch input file checked line by line before it is stored: every error is a 400 naming the line and field."""

from __future__ import annotations

from typing import Any

import orjson

from mstar_core.api.http.errors import ApiError

#: The routes a batch line may call (their non-streaming JSON answers are what the output file holds).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
#: The keys of one input line (OpenAI's shape); any other key is refused by name.
LINE_KEYS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID = 512


def _bad(number: int, field: str, message: str) -> ApiError:
    return ApiError(400, f"line {number}: {message}", param=f"line[{number}].{field}", code="invalid_batch_line")


def check_batch_input(data: bytes, max_lines: int) -> tuple[int, list[str]]:
    """(number of requests, the endpoints they call) of a `purpose=batch` file; a 400 names the first bad line.

    One JSON object a line: `custom_id` (a string unique in the file), `method` "POST", `url` one of
    `BATCH_ENDPOINTS`, `body` the route's request (an object naming its `model`; no `stream`). Line numbers
    count from 1; a final newline is optional, an empty line elsewhere is an error.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise _bad(line, "", f"is not UTF-8 text (byte {exc.start})") from None
    rows = text.split("\n")
    if rows and rows[-1] == "":
        rows.pop()
    if not rows:
        raise ApiError(400, "'file' holds no lines: a batch file has one JSON request per line", param="file")
    if len(rows) > max_lines:
        raise ApiError(400, f"'file' has {len(rows)} lines; this server takes at most {max_lines} requests per batch "
                            "file (split it)", param="file")
    seen: dict[str, int] = {}
    endpoints: dict[str, None] = {}
    for number, row in enumerate(rows, 1):
        if not row.strip():
            raise _bad(number, "", "is empty; every line must hold one JSON request object")
        try:
            item = orjson.loads(row)
        except orjson.JSONDecodeError as exc:
            raise _bad(number, "", f"is not valid JSON: {exc}") from None
        if not isinstance(item, dict):
            raise _bad(number, "", f"must be a JSON object, got {type(item).__name__}")
        for key in item:
            if key not in LINE_KEYS:
                raise _bad(number, key, f"unknown key '{key}'; a line has {', '.join(LINE_KEYS)}")
        _check_line(number, item, seen)
        endpoints[item["url"]] = None
    return len(rows), list(endpoints)


def _check_line(number: int, item: dict[str, Any], seen: dict[str, int]) -> None:
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _bad(number, "custom_id", "'custom_id' must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise _bad(number, "custom_id", f"'custom_id' is longer than {MAX_CUSTOM_ID} characters")
    if custom_id in seen:
        raise _bad(number, "custom_id", f"'custom_id' {custom_id!r} is already used on line {seen[custom_id]}; each "
                                        "must be unique in the file")
    seen[custom_id] = number
    if item.get("method") != "POST":
        raise _bad(number, "method", f"'method' must be \"POST\", got {item.get('method')!r}")
    url = item.get("url")
    if url not in BATCH_ENDPOINTS:
        raise _bad(number, "url", f"'url' {url!r} is not a batch endpoint; use one of {', '.join(BATCH_ENDPOINTS)}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise _bad(number, "body", "'body' must be the request object of the line's 'url'")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _bad(number, "body.model", "'body.model' must name a served model")
    if body.get("stream") not in (None, False):
        raise _bad(number, "body.stream", "'body.stream' must be false or left out: a batch line's answer is stored "
                                          "whole")
