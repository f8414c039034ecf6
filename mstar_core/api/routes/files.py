"""OpenAI's Files API for the Batch API: POST /v1/files (a `purpose=batch` JSONL upload, checked line by line and
bounded in bytes and lines), GET /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}.
Files belong to the API key that uploaded them (`batch.owner_of`); batch output and error files are listed here too
(`purpose=batch_output`)."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from mstar_core.api.batch import batch_service, owner_of
from mstar_core.api.batch.files import public
from mstar_core.api.batch.lines import check_batch_input
from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.schemas import ERROR_RESPONSES

router = APIRouter()
#: Purposes a client may upload with (the server writes `batch_output` files itself).
UPLOAD_PURPOSES = ("batch",)


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, f"no file {file_id!r} (never uploaded with this API key, or deleted)", param="file_id",
                    code="file_not_found")


@router.post("/v1/files", responses=ERROR_RESPONSES, summary="Upload a file (a Batch API input, JSONL)")
async def create_file(request: Request, file: UploadFile, purpose: str = Form(...)):
    service = batch_service(request)
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(400, f"'purpose' {purpose!r} is not taken here; this server stores files for "
                            f"{', '.join(UPLOAD_PURPOSES)} (the Batch API)", param="purpose")
    limit = service.limits.max_file_bytes
    raw = await file.read(limit + 1)
    if len(raw) > limit:
        raise ApiError(413, f"'file' is larger than this server's batch file limit of {limit} bytes (split it)",
                       param="file")
    lines, endpoints = await asyncio.to_thread(check_batch_input, raw, service.limits.max_lines)
    meta = await asyncio.to_thread(service.files.create, owner_of(request), file.filename or "batch.jsonl", purpose,
                                   raw, lines=lines, endpoints=endpoints)
    return OrjsonResponse(public(meta))


@router.get("/v1/files", responses=ERROR_RESPONSES, summary="List your files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000), order: Literal["asc", "desc"] = "desc"):
    found = batch_service(request).files.list(owner_of(request), purpose)
    if order == "asc":
        found.reverse()
    if after is not None:
        ids = [m["id"] for m in found]
        found = found[ids.index(after) + 1:] if after in ids else []
    page = [public(m) for m in found[:limit]]
    return OrjsonResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                           "last_id": page[-1]["id"] if page else None, "has_more": len(found) > limit})


@router.get("/v1/files/{file_id}", responses=ERROR_RESPONSES, summary="A file's metadata")
async def retrieve_file(file_id: str, request: Request):
    meta = batch_service(request).files.get(owner_of(request), file_id)
    if meta is None:
        raise _not_found(file_id)
    return OrjsonResponse(public(meta))


@router.get("/v1/files/{file_id}/content", responses={200: {"content": {"application/jsonl": {}}}, **ERROR_RESPONSES},
            summary="A file's content")
async def file_content(file_id: str, request: Request):
    service = batch_service(request)
    owner = owner_of(request)
    meta = service.files.get(owner, file_id)
    if meta is None:
        raise _not_found(file_id)
    return FileResponse(service.files.data_path(owner, file_id), media_type="application/jsonl",
                        filename=meta["filename"])


@router.delete("/v1/files/{file_id}", responses=ERROR_RESPONSES, summary="Delete a file")
async def delete_file(file_id: str, request: Request):
    service = batch_service(request)
    owner = owner_of(request)
    if service.files.get(owner, file_id) is None:
        raise _not_found(file_id)
    for job in service.jobs.unfinished():
        if job["_owner"] == owner and job["input_file_id"] == file_id:
            raise ApiError(409, f"file {file_id!r} is the input of batch {job['id']} ({job['status']}); cancel the "
                                "batch or let it finish first", param="file_id", code="file_in_use")
    service.files.delete(owner, file_id)
    return OrjsonResponse({"id": file_id, "object": "file", "deleted": True})
