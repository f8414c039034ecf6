"""Request and response bodies of the HTTP API, in OpenAI's shapes (pydantic, so /openapi.json is accurate)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mstar_core.sampling import MAX_SEED


class _Body(BaseModel):
    # OpenAI clients send fields a given server may not know; model parameters ride along as extras.
    model_config = ConfigDict(extra="allow")


# Numbers are strict: a count is never 1.5, "3" or true, and a float is finite (JSON bodies may carry Infinity/NaN).
# Sampling extras that a route does not declare are checked by `mstar_core.sampling.check_fields`.


def _count(default: int | None, lo: int, hi: int, **kw: Any) -> Any:
    return Field(default, ge=lo, le=hi, strict=True, **kw)


def _real(default: float | None, **kw: Any) -> Any:
    return Field(default, allow_inf_nan=False, **kw)


# --- errors -------------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


# --- models / health ----------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mstar"
    routes: list[str] = Field(default_factory=list, description="OpenAI routes this model serves")
    walks: list[str] = Field(default_factory=list, description="walks served by /v1/walks/{model}")
    random_weights: bool = False


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "loading"]
    models: list[str]


# --- speech -------------------------------------------------------------------------------------------------


class SpeechRequest(_Body):
    """POST /v1/audio/speech."""

    model: str = Field(min_length=1)
    input: str = Field(min_length=1, max_length=4096, description="text to speak")
    voice: str = Field(min_length=1)
    response_format: Literal["wav", "pcm", "flac"] = Field(
        "wav", description="wav (streamed with an open-ended header), pcm (raw s16le mono), or flac"
    )
    speed: float = _real(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None


class SpeechUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


# --- chat ---------------------------------------------------------------------------------------------------


class ContentPart(_Body):
    type: str = Field(min_length=1, description="text, image_url, input_audio, ...")
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(_Body):
    """POST /v1/chat/completions."""

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = _count(None, 1, 1_000_000)
    max_completion_tokens: int | None = _count(None, 1, 1_000_000)
    temperature: float | None = _real(None, ge=0.0, le=2.0,
                                      description="0 is greedy; otherwise at least 1e-5 (smaller overflows the arithmetic)")
    top_p: float | None = _real(None, gt=0.0, le=1.0)
    seed: int | None = _count(None, 0, MAX_SEED)
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings")
    n: int = _count(1, 1, 1, description="only 1 is supported")
    logprobs: bool | None = Field(None, strict=True, description="accepted; log-probabilities are not returned yet")
    top_logprobs: int | None = _count(None, 0, 20)
    modalities: list[Literal["text", "audio"]] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: Literal["stop", "length"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# --- images -------------------------------------------------------------------------------------------------


class ImageRequest(_Body):
    """POST /v1/images/generations; model parameters (steps, guidance, ...) ride along as extra fields."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1, max_length=32000)
    n: int = _count(1, 1, 10)
    size: str = Field("512x512", pattern=r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$")
    seed: int | None = _count(None, 0, MAX_SEED)
    response_format: Literal["b64_json"] = "b64_json"


class ImageEditRequest(ImageRequest):
    """POST /v1/images/edits, as JSON: the source image as base64 (PNG/JPEG) in `image`."""

    image: str = Field(min_length=1, description="base64-encoded PNG or JPEG")


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


# --- native walks -------------------------------------------------------------------------------------------


class WalkRequest(BaseModel):
    """POST /v1/walks/{model}: raw model inputs; tensors as {"dtype", "shape", "data": base64}."""

    model_config = ConfigDict(extra="forbid")

    inputs: dict[str, Any] = Field(default_factory=dict)
    stream: bool = Field(True, description="NDJSON events as produced; false returns one JSON object")
    timeout: float | None = _real(None, gt=0, le=3600)
    outputs: list[str] | None = Field(None, description="final env names to return (default: the walks' outputs)")


#: The error statuses every model route can answer, for the OpenAPI schema.
ERROR_RESPONSES = {c: {"model": ErrorResponse} for c in (400, 401, 404, 413, 503)}
