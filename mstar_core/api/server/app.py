"""The FastAPI app: server state, model loading at startup, /v1/models, /health, /metrics, and the routers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar_core.api.batch import BatchLimits, BatchService
from mstar_core.api.batch import service as batch_defaults
from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError, install_error_handlers, retry_after
from mstar_core.api.http.off_loop import install_pool
from mstar_core.api.media import MediaLimits
from mstar_core.api.requests.adapters import ApiAdapter, describe_routes, validate_adapter, with_defaults
from mstar_core.api.requests.chat_adapter import TokenizerChatAdapter
from mstar_core.api.requests.schemas import ErrorResponse, Health, ModelCard, ModelList
from mstar_core.api.requests.video_jobs import VideoJobStore
from mstar_core.api.requests.voices import VoiceStore
from mstar_core.api.routes import (
    batches,
    chat,
    completions,
    files,
    images,
    lora_adapters,
    realtime,
    responses,
    speech,
    speech_stream,
    transcriptions,
    translations,
    videos,
    voices,
    walks,
)
from mstar_core.api.server import playground
from mstar_core.api.server.loop_watch import LoopWatch
from mstar_core.api.server.metrics import Metrics
from mstar_core.api.server.middleware import GuardMiddleware
from mstar_core.api.server.plugin_routes import include_plugin_routes
from mstar_core.config.compose import ComposeSettings
from mstar_core.config.lora import LoraSettings
from mstar_core.config.placement import Placement
from mstar_core.errors import ConfigError
from mstar_core.grammar.compile import warm as warm_grammars
from mstar_core.model import LoadOptions

log = logging.getLogger("mstar.api")

_ROUTE_LABELS = {
    "/v1/audio/speech": "speech",
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/images/generations": "images",
    "/v1/images/edits": "images_edit",
    "/v1/videos": "videos",
    "/v1/models": "models",
}


@attrs.define
class ModelToServe:
    """One model the server loads at startup."""

    name: str
    options: LoadOptions = attrs.field(factory=lambda: LoadOptions(preset="tiny"))
    settings: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    placement: Placement | None = None
    #: the deploy file's `media:` section (MediaLimits fields), over the adapter's limits
    media: dict[str, Any] = attrs.field(factory=dict)
    #: the deploy file's LoRA keys (`lora_adapters`, `max_loras`, `max_lora_rank`); None: no adapters
    lora: LoraSettings | None = None
    #: a composed model (`compose:` and its roles): built from the other models' nodes once they are loaded
    compose: ComposeSettings | None = None


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"server option '{name}' must be a whole number >= 1, got {value!r}")


@attrs.define
class ServerConfig:
    """Server options (CLI flags or the `server:` section of a deploy file)."""

    models: list[ModelToServe] = attrs.field(factory=list)
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_running: int = 256
    max_queued: int = 1024
    request_timeout: float | None = 600.0
    #: The most choices (`n`) one chat or completions request may ask for per prompt.
    max_n: int = 16
    #: torch threads of the serving process (None: its cores, split evenly with workers a placement spawns here)
    torch_threads: int | None = attrs.field(default=None, validator=lambda _, a, v: _positive_or_none(a.name, v))
    #: where the server keeps what outlives a process (the Batch API's files and jobs under `batch/`); None: a
    #: temporary directory (`mstar serve` defaults to $MSTAR_STATE_DIR, else ~/.local/state/mstar)
    state_dir: str | None = None
    #: the Batch API's bounds: input file bytes and lines, and batch lines in flight at once beside live traffic
    batch_max_file_bytes: int = attrs.field(default=batch_defaults.MAX_FILE_BYTES,
                                            validator=lambda _, a, v: _positive_or_none(a.name, v))
    batch_max_lines: int = attrs.field(default=batch_defaults.MAX_LINES,
                                       validator=lambda _, a, v: _positive_or_none(a.name, v))
    batch_concurrency: int = attrs.field(default=batch_defaults.CONCURRENCY,
                                         validator=lambda _, a, v: _positive_or_none(a.name, v))

    @property
    def max_inflight(self) -> int:
        return self.max_running + self.max_queued

    @property
    def batch_limits(self) -> BatchLimits:
        return BatchLimits(self.batch_max_file_bytes, self.batch_max_lines, self.batch_concurrency)

    def body_limit(self, path: str) -> int:
        """The largest body a route takes: a batch input upload has its own bound (plus room for the form)."""
        if path == "/v1/files":
            return max(self.max_body_bytes, self.batch_max_file_bytes + 64 * 1024)
        return self.max_body_bytes


class ServerState:
    """What the routes share: the engine, adapters by (model, route), metrics, in-flight requests."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], Any]):
        self.config = config
        self.engine_factory = engine_factory
        self.engine: Any = None
        self.metrics: Metrics | None = None
        self.adapters: dict[tuple[str, str], ApiAdapter] = {}
        #: each adapter's media limits with the deploy file's and the environment's applied, resolved at startup
        self.media_limits: dict[tuple[str, str], MediaLimits] = {}
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.created = int(time.time())
        self._inflight: set[Any] = set()
        #: cloned voices (/v1/audio/voices), per API key
        self.voices = VoiceStore()
        #: /v1/videos jobs: they outlive the requests that create them (bounded per API key, swept after retention)
        self.video_jobs = VideoJobStore()

    # -- lookups used by routes ----------------------------------------------------------------

    def base_model(self, model: str) -> str:
        """The model a request's `model` runs on: itself, or a LoRA adapter's base model."""
        return self.engine.lora.resolve(model)[0] if self.engine is not None else model

    def loaded(self, model: str) -> Any:
        if not self.ready:
            raise ApiError(503, "models are still loading; retry shortly (GET /health says when ready)",
                           headers=retry_after(2), type_="server_loading")
        model = self.base_model(model)
        models = self.engine.models
        if model not in models:
            raise ApiError(404, f"model '{model}' is not loaded; loaded models: {', '.join(sorted(models)) or 'none'}",
                           param="model", code="model_not_found")
        return models[model]

    def adapter(self, model: str, route: str) -> ApiAdapter:
        self.loaded(model)
        adapter = self.adapters.get((self.base_model(model), route))
        if adapter is None:
            serving = sorted(m for (m, r) in self.adapters if r == route)
            raise ApiError(404, f"model '{model}' does not serve the {route} route; models that do: "
                                f"{', '.join(serving) or 'none'} (its walks are at /v1/walks/{model})",
                           param="model", code="route_not_supported")
        return adapter

    def routes_of(self, model: str) -> list[str]:
        return sorted(r for (m, r) in self.adapters if m == model)

    @staticmethod
    def route_label(path: str) -> str:
        if path.startswith("/v1/walks/"):
            return "walks"
        if path.startswith(("/v1/files", "/v1/batches")):
            return path.split("/")[2]
        return _ROUTE_LABELS.get(path, "other")

    # -- in-flight bookkeeping -----------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def track(self, handle: Any) -> None:
        self._inflight.add(handle)
        task = getattr(handle, "_task", None)
        if task is not None:
            task.add_done_callback(lambda _t: self._inflight.discard(handle))

    # -- startup -------------------------------------------------------------------------------

    async def load(self) -> None:
        """Create the engine, load every model, bind the adapters; `ready` flips when all are in."""
        MediaLimits().with_env()  # a bad MSTAR_MEDIA_* stops the server before minutes of loading
        self.engine = self.engine_factory()
        self.metrics = Metrics(self.engine, self.video_jobs)
        for item in [m for m in self.config.models if m.compose is None]:
            what = item.options.checkpoint or f"preset '{item.options.preset}' (random weights)"
            log.info("loading model %s from %s", item.name, what)
            t0 = time.perf_counter()
            loaded = await self.engine.load_model(
                item.name, item.options, settings=item.settings, alias=item.name, placement=item.placement
            )
            log.info("loaded %s in %.1fs%s", item.name, time.perf_counter() - t0,
                     " -- RANDOM WEIGHTS: output is noise" if loaded.random_weights else "")
            if (loaded.extras or {}).get("grammar_vocab") is not None:  # compile processes start now, not on the
                # first structured request; ready waits for the vocabulary's TokenizerInfo (see `warm`)
                try:
                    await asyncio.to_thread(warm_grammars, loaded.extras["grammar_vocab"], False)
                except Exception:  # (structured outputs then build it on first use, as they would have)
                    log.warning("grammar warm-up for %s failed", item.name, exc_info=True)
            self.bind_adapters(item.name, loaded, item.media)
            if item.lora is not None:  # the nodes that take adapters get their slots, the named adapters load
                await self.engine.enable_lora(item.name, item.lora)
        for item in [m for m in self.config.models if m.compose is not None]:  # once their parts are in
            composed = item.compose
            log.info("composing model %s (%s) from %s", item.name, composed.composition,
                     ", ".join(f"{role}={model}" for role, model in composed.parts.items()))
            loaded = await self.engine.compose(item.name, composed.composition, composed.parts, item.settings,
                                               composed.options)
            self.bind_adapters(item.name, loaded, item.media)
        self.ready = True

    def bind_adapters(self, name: str, loaded: Any, media: dict[str, Any] | None = None) -> None:
        registry = getattr(self.engine, "registry", None)
        for raw in list(getattr(registry, "api_adapters", []) or []):
            if getattr(raw, "model", None) not in (name, loaded.name):
                continue
            validate_adapter(raw)
            adapter = with_defaults(raw)
            adapter.bind(loaded)
            for route in adapter.routes:
                self.adapters[(name, route)] = adapter
        if "tokenizer" in (loaded.extras or {}):
            generic = TokenizerChatAdapter(name, loaded)  # chat needs the chat template too; completions does not
            for route in generic.routes:
                self.adapters.setdefault((name, route), generic)
        for (model, route), adapter in self.adapters.items():
            if model == name:
                limits = getattr(adapter, "media_limits", None) or MediaLimits()
                self.media_limits[(model, route)] = limits.with_settings(media, f"models.{name}.media").with_env()

    async def close(self) -> None:
        self.draining = True
        await self.video_jobs.close()
        if self.engine is not None:
            await self.engine.close()


#: A path no route serves: a request for it walks every route (`warm_routes`).
_WARM_PATH = "/.mstar-warm-routes"


async def warm_routes(app: FastAPI) -> None:
    """Have FastAPI build every route's request context now, before the server listens.

    FastAPI builds a route's context (its parameters' and body's validators) the first time a request's matching walks
    past it, on the event loop: ~0.3 s of CPU on a loaded 2-core box, paid by the first requests (and by everyone's
    answers meanwhile). A request that matches nothing walks them all; it goes to the router itself, past the
    middleware (no log line, no metric, no auth)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": _WARM_PATH, "raw_path": _WARM_PATH.encode(), "root_path": "",
             "query_string": b"", "headers": [], "client": None, "server": None, "app": app}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message: dict[str, Any]) -> None:
        pass

    try:
        await app.router(scope, receive, send)
    except StarletteHTTPException as exc:  # the 404 (the exception middleware, skipped here, would have sent it)
        if exc.status_code != 404:
            raise


def create_app(config: ServerConfig, engine_factory: Callable[[], Any], *, on_ready: Callable[[], None] | None = None,
               on_error: Callable[[str], None] | None = None, registry: Any = None) -> FastAPI:
    """Build the app; models load in the background at startup (GET /health answers 503 until then).

    `registry`: the plugins whose `mstar_register_routes` routers the app serves beside its own.
    """
    state = ServerState(config, engine_factory)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async def load():
            try:
                await state.load()
                app.state.batch.runner.resume()  # jobs a previous run left unfinished go on once the models are in
                if on_ready is not None:
                    on_ready()
            except Exception as exc:
                state.load_error = f"{type(exc).__name__}: {exc}"
                log.exception("loading models failed")
                if on_error is not None:
                    on_error(state.load_error)
        # the off-loop pool, its threads started before any request (a thread started on demand holds the loop)
        off_loop = install_pool(asyncio.get_running_loop())
        await warm_routes(app)
        loader = asyncio.ensure_future(load())
        watch = LoopWatch.from_env()  # what holds the loop, when the operator asks (MSTAR_LOOP_WATCH_MS)
        try:
            yield
        finally:
            if watch is not None:
                watch.stop()
            loader.cancel()
            await app.state.batch.runner.close()  # (before the engine: a running line stops as its client left)
            await state.close()
            off_loop.shutdown(wait=False)  # its threads end once idle (uvicorn's asyncio.run joins them)

    app = FastAPI(title="M*", version=_version(), default_response_class=OrjsonResponse, lifespan=lifespan,
                  description="OpenAI-compatible serving of composite multimodal models (Walk Graphs).")
    app.state.mstar = state
    app.state.batch = BatchService(_batch_dir(config), app, config.api_key, config.batch_limits)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)

    # HEAD too: load balancers and uptime probes ask with HEAD (the server sends the status and headers, no body)
    @app.api_route("/health", methods=["GET", "HEAD"], response_model=Health, responses={503: {"model": Health}})
    async def health():
        if state.load_error:
            return OrjsonResponse({"status": "loading", "models": [], "error": state.load_error}, status_code=503)
        if not state.ready or state.draining:
            return OrjsonResponse({"status": "loading", "models": []}, status_code=503)
        return {"status": "ok", "models": sorted(state.engine.models)}

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request):
        request.state.model = "-"
        if not state.ready:
            return {"object": "list", "data": []}
        data = [_model_card(state, name, loaded) for name, loaded in sorted(state.engine.models.items())]
        data += [_adapter_card(state, name, served) for name, served in sorted(state.engine.lora.adapters.items())]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def retrieve_model(model: str, request: Request):
        request.state.model = model
        if state.ready and model in state.engine.lora.adapters:
            return _adapter_card(state, model, state.engine.lora.adapters[model])
        loaded = state.engine.models.get(model) if state.ready else None
        if loaded is None:
            raise ApiError(404, f"model '{model}' is not served here; GET /v1/models lists what is", param="model",
                           code="model_not_found")
        return _model_card(state, model, loaded)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics():
        if state.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    for module in (speech, speech_stream, voices, chat, completions, responses, images, videos, walks, realtime,
                   transcriptions, translations, files, batches, playground, lora_adapters):
        app.include_router(module.router)
    include_plugin_routes(app, getattr(registry, "routers", ()))  # a model package's own routes (pi0's socket)

    def openapi() -> dict[str, Any]:
        # once models are in, `model` fields list the models that serve each route, so the schema is exact
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        if state.ready:
            _pin_models(schema, state)
        else:
            app.openapi_schema = None  # rebuild after loading
        return schema

    app.openapi = openapi
    return app


def _model_card(state: ServerState, name: str, loaded: Any) -> dict[str, Any]:
    """What GET /v1/models says of one model: its routes and walks, what its routes take (voices, sizes), and the
    values its request fields take when a request leaves them unset (sampling from its checkpoint's
    generation_config.json included)."""
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mstar",
            "routes": state.routes_of(name), "walks": sorted(loaded.graph.walks),
            "random_weights": bool(loaded.random_weights), "defaults": _jsonable(loaded.request_defaults()),
            "fields": [f.name for f in loaded.request_schema.fields] if loaded.request_schema is not None else [],
            **describe_routes({r: a for (m, r), a in state.adapters.items() if m == name})}


def _adapter_card(state: ServerState, name: str, served: Any) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists it: `parent` its base model, `root` its directory; it serves its base's routes."""
    return {"id": name, "object": "model", "created": served.created, "owned_by": "mstar", "parent": served.base,
            "root": served.path, "routes": state.routes_of(served.base),
            "walks": sorted(state.engine.models[served.base].graph.walks), "random_weights": False}


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    """Defaults that JSON can say (a tensor-valued default is left out rather than failing the listing)."""
    return {k: v for k, v in values.items() if isinstance(v, str | int | float | bool | list | tuple | dict)}


def _pin_models(schema: dict[str, Any], state: ServerState) -> None:
    """Put the served model names into the schema as enums (per route) and into the walks path parameter."""
    components = schema.get("components", {}).get("schemas", {})
    by_route = {"SpeechRequest": "speech", "ChatRequest": "chat", "CompletionRequest": "completions",
                "ImageRequest": "images", "ImageEditRequest": "images"}
    for name, route in by_route.items():
        models = sorted(m for (m, r) in state.adapters if r == route)
        prop = components.get(name, {}).get("properties", {}).get("model")
        if prop is not None and models:
            prop["enum"] = models
    voices = [a.voices for (m, r), a in state.adapters.items() if r == "speech"]
    voice = components.get("SpeechRequest", {}).get("properties", {}).get("voice")
    if voice is not None and voices and all(voices):
        voice["enum"] = sorted({v for vs in voices for v in vs})
    # per model, in words: which voices and formats speech takes, which sizes images draws (GET /v1/models too)
    models = {m for (m, _r) in state.adapters}
    described = {m: describe_routes({r: a for (mm, r), a in state.adapters.items() if mm == m}) for m in models}
    docs = {("SpeechRequest", "voice"): lambda d: d.get("voices") and f"voices {', '.join(d['voices'])} "
                                                                      f"(default {d['voices'][0]})",
            ("SpeechRequest", "response_format"): lambda d: d.get("audio_formats") and ", ".join(d["audio_formats"]),
            ("SpeechRequest", "speed"): lambda d: "speed" in d and ("honoured" if d["speed"] else "1.0 only"),
            ("ImageRequest", "size"): lambda d: d.get("image_size_rule") and (
                f"{d['image_size_rule']}; standard sizes {', '.join(d['image_sizes'])}; default "
                f"{d.get('default_image_size')}")}
    for (component, prop_name), say in docs.items():
        prop = components.get(component, {}).get("properties", {}).get(prop_name)
        lines = [f"{m}: {text}" for m in sorted(described) if (text := say(described[m]))]
        if prop is not None and lines:
            prop["description"] = (prop.get("description", "") + " | per model: " + "; ".join(lines)).lstrip(" |")
    walk_op = schema.get("paths", {}).get("/v1/walks/{model}", {}).get("post", {})
    for param in walk_op.get("parameters", []):
        if param.get("name") == "model" and state.engine.models:
            param["schema"]["enum"] = sorted(state.engine.models)
    walks.document_models(schema, state.engine.models)


def _batch_dir(config: ServerConfig) -> Path:
    """The Batch API's directory: `<state_dir>/batch`, or a temporary one (jobs then end with the process)."""
    if config.state_dir is None:
        directory = Path(tempfile.mkdtemp(prefix="mstar-batch-"))
        log.info("no state directory set: Batch API files and jobs kept in %s until the process ends", directory)
        return directory
    return Path(config.state_dir).expanduser() / "batch"


def _version() -> str:
    from mstar_core import __version__

    return __version__
