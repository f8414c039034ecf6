"""API adapters: how a model plugs into the OpenAI-shaped routes without model code in the server.

A model package registers adapter objects with the `mstar_register_api_adapters` hook. Each adapter
names the model it serves (`model`) and the routes it can answer (`routes`, among `speech`, `chat`,
`completions`, `images`, `videos`). The server validates the request body against the route's schema, then asks the
adapter to turn it into the model's raw inputs (`speech_inputs`, `chat_inputs`, `completion_inputs`,
`image_inputs`); those go to
`AsyncEngine.submit`. Outputs named in the walk's `emit` come back through the per-route output
hooks (`audio_output`, `token_output`, ...). Subclass `ApiAdapter` to inherit sane defaults.

Chat with images, audio and spoken replies: `chat_media` names the content-part modalities the model
takes; the server decodes them (`mstar_core.api.media`) and calls `chat_message_inputs(body, messages)`
with typed parts in order. `chat_audio_output` names the emitted output that carries the spoken reply
(`modalities: ["text", "audio"]`), `chat_transcript_output` the one carrying its text if not the tokens.

Example (a speech model)::

    class OrpheusAdapter(ApiAdapter):
        model = "orpheus"
        routes = {"speech"}
        voices = ["tara", "leah"]
        sample_rate = 24000

        def speech_inputs(self, body):
            return {"text": body["input"], "voice": body["voice"]}

Every hook may raise `mstar_core.errors.RequestError` (status 4xx) with a message that says what to
fix; the server answers it in OpenAI's error shape.

A route adapter only renames: `request_fields[route]` maps the API's field names to the model's declared
request fields (`{"speech": {"input": "text", "voice": "voice"}}`). Voices, sizes, bounds and defaults
live once, in the model's `RequestSchema`; the routes read them from there (`model_field`), the schema
checks them when the request is prepared, and its errors name the API's field (`api_param`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from mstar_core.api.media import ChatTurn, MediaLimits, decode_messages
from mstar_core.errors import RequestError
from mstar_core.schema import UNSET, RequestField

ROUTES = frozenset({"speech", "chat", "completions", "images", "videos", "transcriptions"})


@runtime_checkable
class ApiAdapterProtocol(Protocol):
    """The minimum a registered adapter provides; everything else falls back to `ApiAdapter`'s defaults."""

    model: str
    routes: set[str]


class ApiAdapter:
    """Base class for adapters: per-route hooks with defaults that suit most models."""

    model: str = ""
    routes: ClassVar[set[str]] | set[str] = set()

    # --- lifecycle ----------------------------------------------------------------------------------------

    def bind(self, loaded: Any) -> None:
        """Called once the model is loaded (a `LoadedModel`); keep what the hooks need (tokenizer, config)."""
        self.loaded = loaded

    # --- renaming API fields to the model's ------------------------------------------------------------------

    #: Per route: API field -> the model's request field. Fields the schema declares under the API's own name
    #: (`max_tokens`, `seed`, `temperature`, ...) pass through without an entry.
    request_fields: ClassVar[Mapping[str, Mapping[str, str]]] = {}

    def model_field(self, route: str, api_name: str) -> RequestField | None:
        """The model's declared field that the route's `api_name` becomes (None: the model takes no such field)."""
        schema = getattr(getattr(self, "loaded", None), "request_schema", None)
        if schema is None:
            return None
        return schema.get(self.request_fields.get(route, {}).get(api_name, api_name))

    def field_default(self, route: str, api_name: str) -> Any:
        """The model's default for the route's field, or None when it declares none."""
        field = self.model_field(route, api_name)
        return None if field is None or field.default is UNSET else field.default

    def rename(self, route: str, body: Mapping[str, Any], *, skip: Sequence[str] = ()) -> dict[str, Any]:
        """The route's body as the model's raw inputs: mapped fields renamed, fields the schema declares kept,
        the route's own (model, response_format, ...) and unsent ones dropped."""
        names = self.request_fields.get(route, {})
        schema = getattr(getattr(self, "loaded", None), "request_schema", None)
        known = set(schema.names) if schema is not None else set()
        out: dict[str, Any] = {}
        for key, value in body.items():
            if value is None or key in skip:
                continue
            target = names.get(key, key)
            if target in known:
                out[target] = value
        return out

    def api_param(self, route: str, param: str | None) -> str | None:
        """The API's name for a model field a schema error names (`text` -> `input`)."""
        for api, model in self.request_fields.get(route, {}).items():
            if model == param:
                return api
        return param

    # --- speech (/v1/audio/speech) -----------------------------------------------------------------------

    @property
    def voices(self) -> Sequence[str]:
        """Voices the model accepts: the choices of the field `voice` becomes (speech, or chat audio). Empty = any."""
        for route in ("speech", "chat"):
            field = self.model_field(route, "voice")
            if field is not None and field.choices:
                return tuple(field.choices)
        return ()
    #: Sample rate of the audio the model emits, in Hz.
    sample_rate: int = 24000
    #: Name of the emitted output that carries audio chunks (1-D float in [-1, 1] or int16 tensors).
    audio_output: str = "audio"
    #: Whether `speed` other than 1.0 is honoured without a declared field (a model with a schema declares `speed`).
    supports_speed: bool = False

    def speech_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Turn a validated speech body (`input`, `voice`, `speed`, extras) into the model's raw inputs."""
        if "speech" in self.request_fields:
            return self.rename("speech", body)
        raise RequestError(f"model '{self.model}' does not serve /v1/audio/speech", status=404)

    def audio_chunk(self, value: Any) -> np.ndarray:
        """Convert one emitted audio value into mono int16 PCM samples."""
        return to_int16_pcm(value)

    # --- voices (/v1/audio/voices: cloned voices) ------------------------------------------------------------

    #: Whether the model clones voices from reference audio (`clone_voice`); the voices route refuses the others.
    clones_voices: bool = False

    def clone_voice(self, samples: np.ndarray, sample_rate: int, transcript: str) -> Mapping[str, Any]:
        """Reference audio (mono float) and its transcript ("" when none was sent) -> the voice's prompt (what the
        speech route hands back to
`speech_inputs` as `cloned_voice`): computed once when the voice is created, so speaking with it runs
        no encoder. Its values are JSON-like (lists of numbers, strings): the store keeps them as they are."""
        raise RequestError(f"model '{self.model}' does not clone voices", param="model")

    # --- chat (/v1/chat/completions) ----------------------------------------------------------------------

    #: Name of the emitted output that carries one generated token id per value.
    token_output: str = "next_token"

    def chat_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Turn a validated chat body (`messages`, sampling fields) into the model's raw inputs."""
        typed = getattr(self.chat_message_inputs, "__func__", None)
        if typed is not None and typed is not ApiAdapter.chat_message_inputs:
            # an adapter written against typed parts serves bodies given directly too (`mstar run --prompt`)
            limits = (getattr(self, "media_limits", None) or MediaLimits()).with_env()
            accepts = frozenset(getattr(self, "chat_media", ()) or ())
            return self.chat_message_inputs(body, decode_messages(body["messages"], accepts, self.model, limits))
        raise RequestError(f"model '{self.model}' does not serve /v1/chat/completions", status=404)

    #: Content-part modalities the model takes in chat besides text: "image" (`image_url`), "audio" (`input_audio`).
    #: A part of any other modality is a 400 naming it (`messages[1].content[0].image_url`) before any hook runs.
    chat_media: frozenset[str] | set[str] = frozenset()
    #: Bounds on those parts (bytes, pixels, seconds, parts per request, allowed URL prefixes); the server's
    #: MSTAR_MEDIA_* environment variables override them (`MediaLimits.with_env`).
    media_limits: MediaLimits = MediaLimits()

    def chat_message_inputs(self, body: Mapping[str, Any], messages: list[ChatTurn]) -> dict[str, Any]:
        """Raw inputs from a validated chat body and its messages as typed parts (text, image, audio), in order."""
        return self.chat_inputs(body)

    #: Emitted output carrying the audio the model speaks in chat (values as `audio_chunk` takes them, at
    #: `sample_rate`, voice from `voices`); None: the model does not speak in chat (`modalities: ["audio"]` is a 400).
    chat_audio_output: str | None = None
    #: Emitted output carrying the spoken reply's text as str pieces (or the final env's str / list of str under
    #: that name); None: the transcript is the reply's text (`token_output`, detokenized).
    chat_transcript_output: str | None = None
    #: Prompt tokens one second of input audio becomes, and the model's context in tokens (None: not declared). A
    #: route that asks for output in proportion to the audio (transcriptions) bounds the audio by both, so audio
    #: whose answer cannot fit is a 413 from its header rather than a failure after decoding it.
    audio_tokens_per_second: float | None = None
    context_tokens: int | None = None

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text for a sequence of generated token ids (special tokens dropped)."""
        raise NotImplementedError

    def is_stop_token(self, token_id: int) -> bool:
        """Whether a generated id ends the reply and is not part of it (EOS)."""
        return False

    #: Name of the emitted output carrying a token's log-probability, and of the one carrying its most likely
    #: alternatives (`[(token id, logprob), ...]`); both come before the token they belong to.
    logprob_output: str = "logprob"
    top_logprobs_output: str = "top_logprobs"

    def sampling_logprobs(self, count: int) -> dict[str, Any]:
        """Raw inputs that make the model emit log-probabilities with `count` alternatives per token."""
        return {"logprobs": count}

    def token_text(self, token_id: int) -> str:
        """One token's text, for log-probabilities (special tokens included)."""
        return self.detokenize([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        """One token's bytes (a piece of a multi-byte character is its raw bytes), for log-probabilities."""
        return list(self.token_text(token_id).encode("utf-8", errors="replace"))

    # --- completions (/v1/completions) ----------------------------------------------------------------------

    def completion_inputs(self, body: Mapping[str, Any], prompt: str | list[int]) -> dict[str, Any]:
        """Raw inputs for one prompt (text, or token ids) of a validated completions body (sampling fields)."""
        raise RequestError(f"model '{self.model}' does not serve /v1/completions", status=404)

    def prompt_tokens(self, env: Mapping[str, Any], inputs: Mapping[str, Any]) -> int:
        """Prompt tokens of the request, for `usage` (`input_ids`/`prompt_ids` of the prepared inputs or final env)."""
        for source in (inputs, env):
            for key in ("input_ids", "prompt_ids"):
                ids = source.get(key) if isinstance(source, Mapping) else None
                if ids is not None:
                    return len(ids)
        return 0

    # --- images (/v1/images/generations and /v1/images/edits) ---------------------------------------------

    #: Name of the output (in the final env) that holds the generated image(s).
    image_output: str = "image"

    def image_inputs(self, body: Mapping[str, Any], *, edit: bool) -> dict[str, Any]:
        """Turn a validated images body (`prompt`, `size`, `seed`, extras; `image` bytes for edits) into inputs."""
        route = "/v1/images/edits" if edit else "/v1/images/generations"
        raise RequestError(f"model '{self.model}' does not serve {route}", status=404)

    def images_from_env(self, env: Mapping[str, Any]) -> list[bytes]:
        """PNG bytes of each generated image, from the request's final env."""
        return [to_png(img) for img in _as_list(env.get(self.image_output))]


    # --- videos (/v1/videos: jobs) -------------------------------------------------------------------------

    def video_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Turn a create body (`prompt`, `size`, `seconds`, `seed`, `input_reference` bytes, extras) into inputs."""
        raise RequestError(f"model '{self.model}' does not serve /v1/videos", status=404)

    def video_progress(self, prepared: Mapping[str, Any], emitted: Mapping[str, int]) -> float:
        """The job's done fraction in [0, 1) from how many outputs of each emitted name arrived so far."""
        return 0.0

    #: The emitted output that carries each decoded chunk of frames `[t, H, W, 3]` uint8, in order (None: the
    #: video comes whole from `video_from_env`). With it, the MP4 is written as the chunks arrive.
    video_frames_output: str | None = None

    def video_fps(self, prepared: Mapping[str, Any]) -> int:
        """Frames per second of the request's video."""
        return int(prepared.get("fps", 24))

    def video_from_env(self, env: Mapping[str, Any], prepared: Mapping[str, Any]) -> Any:
        """The finished video's frames `[T, H, W, 3]` uint8, from the request's final env."""
        raise RequestError(f"model '{self.model}' returned no video", status=500)


def api_named(exc: Any, adapter: Any, route: str) -> Any:
    """An `ApiError` from the model's schema with the API's field names (`'text'` -> `'input'`, width -> size)."""
    param = getattr(exc, "param", None)
    api = adapter.api_param(route, param) if param else param
    if api == param:
        return exc
    message = exc.message.replace(f"'{param}'", f"'{api}'")
    if f"'{api}'" not in message:
        message = f"'{api}': {message}"
    exc.message, exc.param = message, api
    exc.args = (message,)
    return exc


def validate_adapter(adapter: Any) -> None:
    """Check a registered adapter's declared shape; raise ValueError naming what is wrong."""
    if not isinstance(adapter, ApiAdapterProtocol):
        raise ValueError(f"API adapter {adapter!r} must have `model: str` and `routes: set[str]`")
    unknown = set(adapter.routes) - ROUTES
    if unknown:
        raise ValueError(f"API adapter for '{adapter.model}' declares unknown routes {sorted(unknown)}; known: {sorted(ROUTES)}")


def with_defaults(adapter: Any) -> ApiAdapter:
    """Return an `ApiAdapter` view of any protocol-conforming object (missing hooks take the defaults)."""
    if isinstance(adapter, ApiAdapter):
        return adapter
    return _Wrapped(adapter)


class _Wrapped(ApiAdapter):
    """Delegates to a duck-typed adapter, falling back to `ApiAdapter` for what it lacks."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            inner = object.__getattribute__(self, "_inner")
            if hasattr(inner, name):
                return getattr(inner, name)
        return object.__getattribute__(self, name)


# --- conversions shared by the defaults --------------------------------------------------------------------


def to_int16_pcm(value: Any) -> np.ndarray:
    """Mono int16 samples from a tensor/array/list: float data is taken as [-1, 1] and clipped."""
    if hasattr(value, "detach"):
        value = value.detach().to("cpu")
        if str(value.dtype) == "torch.bfloat16" or str(value.dtype) == "torch.float16":
            value = value.float()
        value = value.numpy()
    arr = np.asarray(value)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.dtype == np.int16:
        return arr
    if np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():  # NaN would be cast to an arbitrary sample: fail the request, play nothing
            raise RequestError("the model produced non-finite audio samples (NaN or Inf); the stream is cut there",
                               status=500)
        return (np.clip(arr, -1.0, 1.0) * 32767.0).round().astype(np.int16)
    if np.issubdtype(arr.dtype, np.integer):
        return np.clip(arr, -32768, 32767).astype(np.int16)
    raise TypeError(f"cannot turn {arr.dtype} values into audio samples")


def to_png(image: Any) -> bytes:
    """PNG bytes of an image given as PIL image, HxWxC uint8/float array or CxHxW tensor in [0, 1]."""
    import io

    from PIL import Image

    if isinstance(image, bytes | bytearray):
        return bytes(image)
    if not isinstance(image, Image.Image):
        if hasattr(image, "detach"):
            image = image.detach().cpu()
            image = image.float() if image.dtype.is_floating_point else image
            arr = image.numpy()
        else:
            arr = np.asarray(image)
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = np.moveaxis(arr, 0, -1)
        if np.issubdtype(arr.dtype, np.floating):
            arr = (np.clip(arr, 0.0, 1.0) * 255.0).round()
        arr = arr.astype(np.uint8)
        if arr.ndim == 3 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        image = Image.fromarray(arr)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if hasattr(value, "dim") and value.dim() == 4:
        return list(value)
    return [value]


#: OpenAI's image sizes (dall-e-2's squares, dall-e-3's and gpt-image-1's landscapes and portraits).
STANDARD_SIZES = ("256x256", "512x512", "1024x1024", "1536x1024", "1024x1536", "1792x1024", "1024x1792")


def _takes(field: RequestField | None, value: Any) -> bool:
    if field is None:
        return True
    try:
        field.convert(value)
    except RequestError:
        return False
    return True


def describe_routes(adapters: Mapping[str, Any]) -> dict[str, Any]:
    """What a model's routes take, read from its declared fields: voices, audio formats, speed, image sizes."""
    from mstar_core.api.media.audio import FORMATS

    out: dict[str, Any] = {}
    speech = adapters.get("speech")
    if speech is not None:
        out.update(voices=list(speech.voices) or None, audio_formats=list(FORMATS),
                   speed=speech.model_field("speech", "speed") is not None or bool(speech.supports_speed))
    images = adapters.get("images")
    if images is not None:
        width, height = images.model_field("images", "width"), images.model_field("images", "height")
        out["image_sizes"] = [s for s in STANDARD_SIZES
                              if _takes(width, int(s.split("x")[0])) and _takes(height, int(s.split("x")[1]))]
        if width is not None and height is not None:
            step = width.multiple_of or 1
            out["image_size_rule"] = (f"WIDTHxHEIGHT, each side a multiple of {step} from {width.minimum:g} to "
                                      f"{width.maximum:g}")
            if width.default is not UNSET and height.default is not UNSET:
                out["default_image_size"] = f"{width.default}x{height.default}"
    if "voices" not in out and adapters.get("chat") is not None and adapters["chat"].voices:
        out["voices"] = list(adapters["chat"].voices)
    return out
