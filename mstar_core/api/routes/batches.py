"""OpenAI's Batch API: POST /v1/batches (a `purpose=batch` file's requests run in the background), GET
/v1/batches/{id}, GET /v1/batches (newest first, `after` and `limit`), POST /v1/batches/{id}/cancel.

A job's lines run through the app's own routes, in this process, at background priority beside live traffic
(`batch.runner`); its state lives on disk under the server's state directory, so a restarted server resumes it.
When it ends, `output_file_id` holds the 2xx answers and `error_file_id` the rest, one OpenAI output line each
(`{id, custom_id, response: {status_code, request_id, body}, error}`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from fastapi import Query, Request
from pydantic import BaseModel, ConfigDict

from mstar_core.api.batch import batch_service, owner_of
from mstar_core.api.batch.files import public
from mstar_core.api.batch.jobs import COMPLETION_WINDOWS
from mstar_core.api.batch.lines import BATCH_ENDPOINTS
from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.requests.schemas import ERROR_RESPONSES

router = json_router()  # large JSON bodies parsed off the event loop
#: OpenAI's bounds on a batch's metadata.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server would ignore is refused by name

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch {batch_id!r} (never created with this API key)", param="batch_id",
                    code="batch_not_found")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise ApiError(400, f"'metadata' has {len(metadata)} keys; at most {MAX_METADATA}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise ApiError(400, f"'metadata.{key[:64]}': keys take up to {MAX_METADATA_KEY} characters, values up "
                                f"to {MAX_METADATA_VALUE}", param=f"metadata.{key[:64]}")


def _first_other_endpoint(path: Path, endpoint: str) -> tuple[int, str] | None:
    """(line number, url) of the first line of the file that calls another endpoint than the batch's."""
    with open(path, "rb") as f:
        for number, row in enumerate(f, 1):
            if row.strip() and (url := orjson.loads(row)["url"]) != endpoint:
                return number, url
    return None


@router.post("/v1/batches", responses=ERROR_RESPONSES, summary="Create a batch")
async def create_batch(body: BatchRequest, request: Request):
    service = batch_service(request)
    owner = owner_of(request)
    if body.endpoint not in BATCH_ENDPOINTS:
        raise ApiError(400, f"'endpoint' {body.endpoint!r} is not served in batches; use one of "
                            f"{', '.join(BATCH_ENDPOINTS)}", param="endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise ApiError(400, f"'completion_window' must be one of {', '.join(COMPLETION_WINDOWS)}",
                       param="completion_window")
    _check_metadata(body.metadata)
    meta = service.files.get(owner, body.input_file_id)
    if meta is None:
        raise ApiError(404, f"'input_file_id' {body.input_file_id!r} names no file uploaded with this API key",
                       param="input_file_id", code="file_not_found")
    if meta["purpose"] != "batch":
        raise ApiError(400, f"'input_file_id' {body.input_file_id!r} has purpose {meta['purpose']!r}; upload the "
                            "requests with purpose 'batch'", param="input_file_id")
    if meta.get("_endpoints") != [body.endpoint]:
        other = await asyncio.to_thread(_first_other_endpoint, service.files.data_path(owner, meta["id"]),
                                        body.endpoint)
        if other is not None:
            raise ApiError(400, f"line {other[0]}: 'url' {other[1]!r} differs from the batch's 'endpoint' "
                                f"{body.endpoint!r}; every line of a batch calls its endpoint",
                           param=f"line[{other[0]}].url", code="invalid_batch_line")
    record = service.jobs.create(owner, meta["id"], body.endpoint, body.completion_window, body.metadata,
                                 meta["_lines"])
    service.runner.start(record)
    return OrjsonResponse(public(record))


@router.get("/v1/batches/{batch_id}", responses=ERROR_RESPONSES, summary="A batch")
async def retrieve_batch(batch_id: str, request: Request):
    record = batch_service(request).jobs.get(owner_of(request), batch_id)
    if record is None:
        raise _not_found(batch_id)
    return OrjsonResponse(public(record))


@router.get("/v1/batches", responses=ERROR_RESPONSES, summary="List your batches, newest first")
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    found = batch_service(request).jobs.list(owner_of(request))
    if after is not None:
        ids = [r["id"] for r in found]
        found = found[ids.index(after) + 1:] if after in ids else []
    page = [public(r) for r in found[:limit]]
    return OrjsonResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                           "last_id": page[-1]["id"] if page else None, "has_more": len(found) > limit})


@router.post("/v1/batches/{batch_id}/cancel", responses=ERROR_RESPONSES, summary="Cancel a batch")
async def cancel_batch(batch_id: str, request: Request):
    service = batch_service(request)
    record = service.jobs.get(owner_of(request), batch_id)
    if record is None:
        raise _not_found(batch_id)
    if record["status"] in ("completed", "failed", "expired"):
        raise ApiError(409, f"batch {batch_id} is {record['status']}; there is nothing to cancel", param="batch_id",
                       code="batch_not_cancellable")
    service.runner.cancel(record)
    return OrjsonResponse(public(record))
