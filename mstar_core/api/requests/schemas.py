"""Request and response bodies of the HTTP API, in OpenAI's shapes (pydantic, so /openapi.json is accurate)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from mstar_core.sampling import MAX_COUNT, MAX_TOP_LOGPROBS, SAMPLING_FIELDS


class _Body(BaseModel):
    # OpenAI clients send fields a given server may not know; model parameters ride along as extras.
    model_config = ConfigDict(extra="allow")


# Numbers are strict: a count is never 1.5, "3" or true, and a float is finite (JSON bodies may carry Infinity/NaN).
# Sampling extras that a route does not declare are checked by `mstar_core.sampling.check_fields`.


def _count(default: int | None, lo: int, hi: int, **kw: Any) -> Any:
    return Field(default, ge=lo, le=hi, strict=True, **kw)


def _real(default: float | None, **kw: Any) -> Any:
    return Field(default, allow_inf_nan=False, **kw)


def _sampling(name: str, default: Any = None, **kw: Any) -> Any:
    """A sampling field as the OpenAI routes take it: OpenAI's bounds and the doc from its one declaration
    (`mstar_core.sampling.SAMPLING_FIELDS`); integers strict, reals finite."""
    spec = SAMPLING_FIELDS[name]
    bounds = dict(spec.openai or {})
    kw.setdefault("description", spec.doc)
    if spec.json_schema.get("type") == "integer":
        return Field(default, strict=True, **bounds, **kw)
    return Field(default, allow_inf_nan=False, **bounds, **kw)


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
    voices: list[str] | None = Field(None, description="voices of /v1/audio/speech (and spoken chat replies); "
                                                       "the first is the default")
    audio_formats: list[str] | None = Field(None, description="response_format values of /v1/audio/speech")
    image_sizes: list[str] | None = Field(None, description="OpenAI's standard sizes this model draws")
    image_size_rule: str | None = Field(None, description="which sizes it draws, in words")
    default_image_size: str | None = Field(None, description="the size drawn when a request gives none")
    speed: bool | None = Field(None, description="whether /v1/audio/speech honours 'speed'")
    fields: list[str] | None = Field(None, description="the request fields the model's own schema declares (what "
                                                      "/v1/walks takes; the OpenAI routes map onto them)")
    defaults: dict[str, Any] | None = Field(None, description="the value each request field of the model's own "
                                            "schema (/v1/walks) takes when a request leaves it unset: sampling from "
                                            "the checkpoint's generation_config.json unless the server was started "
                                            "with --generation-config none; the OpenAI routes map onto these")
    parent: str | None = Field(None, description="a LoRA adapter's base model (requests naming the adapter run there)")
    root: str | None = Field(None, description="a LoRA adapter's directory")


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
    voice: str | None = Field(None, min_length=1, description="one of the model's voices (GET /v1/models lists "
                                                              "them); absent: the model's default voice")
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus", "aac"] = Field(
        "mp3", description="mp3 (the default, as OpenAI's), wav (streamed with an open-ended header), pcm (raw s16le "
                           "mono), flac, opus (Ogg) or aac (ADTS); every format streams"
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
    """One part of a message's content; models take text, and images or audio as their adapters declare."""

    type: str = Field(min_length=1, description="text, image_url or input_audio")
    text: str | None = None
    # checked (and named in errors as messages[i].content[j].image_url) by mstar_core.api.media, not here
    image_url: Any = Field(None, description="{url: a data URI (data:image/png;base64,...) or an allowed "
                                             "http(s) URL, detail?: auto|low|high}")
    input_audio: Any = Field(None, description="{data: base64 audio, format: wav|mp3}")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatAudioParams(_Body):
    """`audio` of a chat request: the spoken reply's voice and encoding (with modalities ["text", "audio"])."""

    voice: str | dict[str, Any] = Field(description="one of the model's voices (or {\"id\": voice})")
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"] = Field(
        description="wav, pcm16 (raw s16le mono), mp3, opus (Ogg), aac (ADTS) or flac (not streamed)")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Sampling fields shared by chat and completions: OpenAI's, then vLLM's extensions. Finer bounds (the
    temperature floor, vocabulary-sized ids) are checked by `mstar_core.sampling` and the model's `prepare`."""

    temperature: float | None = _sampling("temperature", description="0 is greedy; otherwise at least 1e-5 (smaller "
                                                                     "overflows the arithmetic)")
    top_p: float | None = _sampling("top_p")
    seed: int | None = _sampling("seed", description="choice i samples with seed + i")
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings; the text ends before the first")
    n: int = _count(1, 1, MAX_COUNT, description="choices per prompt (up to the server's cap, `mstar serve --max-n`)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = _sampling("presence_penalty")
    frequency_penalty: float | None = _sampling("frequency_penalty")
    logit_bias: dict[str, Any] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = Field(None, max_length=256, description="an end-user id (at most 256 characters)")
    # vLLM's extensions
    top_k: int | None = _sampling("top_k", description="keep the k most likely tokens; 0 or -1 disables")
    min_p: float | None = _sampling("min_p")
    repetition_penalty: float | None = _sampling("repetition_penalty", description="1 disables; >1 discourages "
                                                                                  "repeats (prompt and generated tokens)")
    ignore_eos: bool | None = Field(None, strict=True, description="keep generating past the end-of-sequence token")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="json_object: any JSON object; json_schema: output following `json_schema.schema` exactly "
                    "(constrained decoding; `strict` accepted)")
    json_schema: dict[str, Any] | None = Field(None, description="{name, schema, strict?, description?}")


#: Messages in one chat request: validating each is work on the event loop that holds the interpreter (200,000 tiny
#: messages in a 7 MB body took seconds); OpenAI's own bound on `messages`.
MAX_MESSAGES = 2048


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = _sampling("max_tokens")
    max_completion_tokens: int | None = _sampling("max_tokens")
    logprobs: bool | None = Field(None, strict=True, description="return each token's log-probability")
    top_logprobs: int | None = _count(None, 0, MAX_TOP_LOGPROBS,
                                      description="and this many most likely alternatives (needs logprobs)")
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, description="[\"text\", \"audio\"] asks models that speak in chat for a spoken reply (needs 'audio')")
    audio: ChatAudioParams | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions (OpenAI's legacy text completions)."""

    model: str = Field(min_length=1)
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="a string, a list of strings (each its own choices), token ids, or a list of token-id lists")
    max_tokens: int | None = _sampling("max_tokens", 16)
    logprobs: int | None = _count(None, 0, MAX_TOP_LOGPROBS,
                                  description="return each token's log-probability and this many alternatives")
    echo: bool | None = Field(None, strict=True, description="not supported: only false")
    suffix: str | None = Field(None, description="not supported: only empty")
    best_of: int | None = _count(None, 1, MAX_COUNT, description="only equal to n (no server-side ranking)")
    response_format: ResponseFormat | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: str | None = None


class ChatResponseAudio(BaseModel):
    id: str
    data: str = Field(description="base64 of the whole reply in the requested format")
    expires_at: int = Field(description="the audio is not kept for later turns: the creation time")
    transcript: str


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the reply; null when it is spoken (see audio.transcript)")
    audio: ChatResponseAudio | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="calls of the request's tools: "
                                                                  "[{id, type: function, function: {name, arguments}}]")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChoiceLogprobs | None = None


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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# --- images -------------------------------------------------------------------------------------------------


class ImageRequest(_Body):
    """POST /v1/images/generations; model parameters (steps, guidance, ...) ride along as extra fields."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1, max_length=32000)
    n: int = _count(1, 1, 10)
    size: str | None = Field(None, pattern=r"^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$",
                             description="WIDTHxHEIGHT; absent or auto: the model's default (GET /v1/models says which "
                                         "sizes each model draws), for an edit the input image's size")
    seed: int | None = _sampling("seed", description="image i draws with seed + i")
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


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(description="a string, or message / function_call / "
                                                          "function_call_output items")
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="{format: {type: text | json_object | json_schema, ...}}")
    max_output_tokens: int | None = _sampling("max_tokens")
    temperature: float | None = _sampling("temperature")
    top_p: float | None = _sampling("top_p")
    seed: int | None = _sampling("seed")
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
