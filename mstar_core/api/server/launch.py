"""`mstar serve`: turn CLI flags and a deploy file into a running uvicorn server on uvloop."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
from typing import Any

import attrs

from mstar_core.api.server.app import ModelToServe, ServerConfig, create_app
from mstar_core.config.lora import LoraSettings
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.openmp import stop_huge_pages_after_load

API_KEY_ENV = "MSTAR_API_KEY"
STATE_DIR_ENV = "MSTAR_STATE_DIR"


def default_state_dir() -> str:
    """$MSTAR_STATE_DIR, else the XDG state directory's `mstar` (what outlives one run of the server)."""
    if os.environ.get(STATE_DIR_ENV):
        return os.environ[STATE_DIR_ENV]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "mstar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", metavar="MODEL", help="model families to serve (see `mstar plugins`)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="[MODEL=]PATH|ORG/NAME[@REV]",
                   help="checkpoint directory or Hugging Face Hub id (fetched into the HF cache; HF_HUB_OFFLINE=1 "
                        "reads the cache only); MODEL= prefix when serving several, MODEL.PART= for a model's part "
                        "(e.g. orpheus.snac=); default: the tiny preset")
    p.add_argument("--generation-config", action="append", default=[], metavar="[MODEL=]auto|none|DIR",
                   help="default sampling: auto (the checkpoint's generation_config.json, as vLLM), none (or vllm: "
                        "greedy unless a request asks), or a directory holding a generation_config.json")
    p.add_argument("--preset", action="append", default=[], metavar="[MODEL=]NAME",
                   help="preset to build when no checkpoint is given (default: tiny)")
    p.add_argument("--config", metavar="deploy.yaml", help="deploy file: server options, per-model placement/settings")
    p.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    p.add_argument("--device", default="cpu", help="device for models without a deploy entry")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="weights and KV dtype for every model served: float32, bfloat16 or float16 (default: the "
                        "deploy file's, else the model's default for its device: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body accepted (default 16 MiB)")
    p.add_argument("--max-running", type=int, default=None, help="requests executing at once (default 256)")
    p.add_argument("--max-queued", type=int, default=None, help="requests waiting beyond that; then 503 (default 1024)")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is cut (default 600)")
    p.add_argument("--max-n", type=int, default=None, help="most choices (n) per prompt on chat/completions (default 16)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch threads for the models in this process (default: the cores, shared with spawned workers)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help=f"where the Batch API keeps files and jobs, resumed after a restart (default: ${STATE_DIR_ENV}, "
                        "else $XDG_STATE_HOME/mstar or ~/.local/state/mstar)")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served as models NAME over the one model served (vLLM's flag; "
                        "several models: the deploy file's lora_adapters)")
    p.add_argument("--max-loras", type=int, default=None, help="LoRA adapters held at once (default 4)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest LoRA rank (default 16)")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to let requests finish on SIGINT/SIGTERM")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="also register this importable module as a plugin (not installed as a distribution)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _per_model(values: list[str], models: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if sep and name in models:
            out[name] = rest
        elif len(models) == 1:
            out[models[0]] = value
        else:
            raise ConfigError(f"{flag} {value!r}: with several models write {flag} MODEL=VALUE (models: {', '.join(models)})")
    return out


def _split_parts(values: list[str], models: list[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """`--checkpoint MODEL.PART=VALUE` values as {model: {part: value}}, apart from the model checkpoints."""
    parts: dict[str, dict[str, str]] = {}
    rest = []
    for value in values:
        name, sep, target = value.partition("=")
        model, dot, part = name.partition(".")
        if sep and dot and model in models and part:
            parts.setdefault(model, {})[part] = target
        else:
            rest.append(value)
    return parts, rest


def _lora_flags(args: argparse.Namespace, models: list[ModelToServe]) -> None:
    """`--lora-modules`, `--max-loras`, `--max-lora-rank` onto the one model served (over its deploy entry's keys)."""
    flags = {"lora_adapters": {}, "max_loras": getattr(args, "max_loras", None),
             "max_lora_rank": getattr(args, "max_lora_rank", None)}
    for value in getattr(args, "lora_modules", None) or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {value!r}: write NAME=PATH (a PEFT adapter directory)")
        flags["lora_adapters"][name] = path
    given = {k: v for k, v in flags.items() if v is not None and v != {}}
    if not given:
        return
    if len(models) != 1:
        raise ConfigError("--lora-modules / --max-loras / --max-lora-rank apply to one served model; with several, "
                          "name each model's lora_adapters, max_loras, max_lora_rank in the deploy file")
    item = models[0]
    before = item.lora or LoraSettings()
    merged = {"lora_adapters": {**before.adapters, **given.get("lora_adapters", {})},
              "max_loras": given.get("max_loras", before.max_loras),
              "max_lora_rank": given.get("max_lora_rank", before.max_lora_rank)}
    item.lora = LoraSettings.from_deploy(merged, "--lora-modules / --max-loras / --max-lora-rank")


def build_config(args: argparse.Namespace) -> tuple[ServerConfig, str, int]:
    """ServerConfig, host and port from flags over the deploy file over defaults."""
    from mstar_core.api.server.deploy import apply_server_options, check_generation_config, load_deploy

    server_opts: dict[str, Any] = {}
    deployed: dict[str, ModelToServe] = {}
    if args.config:
        server_opts, deployed = load_deploy(args.config)
    shared = deployed.pop("*", None)  # a bare placement file applies to every model served
    names = list(dict.fromkeys(list(args.models) or list(deployed)))
    if not names:
        raise ConfigError("name at least one model to serve: `mstar serve MODEL` (see `mstar plugins`)")
    part_checkpoints, model_checkpoints = _split_parts(args.checkpoint, names)
    checkpoints = _per_model(model_checkpoints, names, "--checkpoint")
    presets = _per_model(args.preset, names, "--preset")
    generation = _per_model(getattr(args, "generation_config", []) or [], names, "--generation-config")
    models = []
    for name in names:
        item = deployed.get(name) or ModelToServe(name, LoadOptions(device=args.device))
        if item.compose is not None:  # loads nothing itself: its parts must be served
            item.compose.check_served(names, f"{args.config}: models.{name}")
            models.append(item)
            continue
        if shared is not None and item.placement is None:
            item.placement = shared.placement
        dtype = getattr(args, "dtype", None) or item.options.dtype
        if name in checkpoints:
            item.options = attrs.evolve(item.options, checkpoint=checkpoints[name], preset=None, dtype=dtype)
        elif item.options.checkpoint is None:
            preset = presets.get(name) or item.options.preset or "tiny"
            item.options = attrs.evolve(item.options, preset=preset, dtype=dtype)
        elif dtype != item.options.dtype:
            item.options = attrs.evolve(item.options, dtype=dtype)
        if part_checkpoints.get(name):
            item.options = attrs.evolve(item.options, parts={**item.options.parts, **part_checkpoints[name]})
        if name in generation:
            item.options = attrs.evolve(item.options, generation_config=check_generation_config(
                generation[name], f"--generation-config {generation[name]!r}"))
        item.options.torch_dtype(name)  # an unknown dtype fails here, naming the choices, before anything loads
        models.append(item)
    _lora_flags(args, models)
    config = ServerConfig(models=models)
    apply_server_options(config, server_opts)
    overrides = {"max_body_bytes": args.max_body_bytes, "max_running": args.max_running,
                 "max_queued": args.max_queued, "request_timeout": args.request_timeout,
                 "max_n": args.max_n, "torch_threads": getattr(args, "torch_threads", None)}
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    config.api_key = args.api_key or os.environ.get(API_KEY_ENV) or config.api_key
    config.state_dir = getattr(args, "state_dir", None) or config.state_dir or default_state_dir()
    host = args.host or server_opts.get("host") or "127.0.0.1"
    port = args.port if args.port is not None else int(server_opts.get("port", 8000))
    return config, host, port


def banner(config: ServerConfig, host: str, port: int, models: dict[str, Any], routes: dict[str, list[str]],
           adapters: dict[str, Any] | None = None) -> str:
    """What `mstar serve` prints once the models are in: the URL and ready-to-paste examples."""
    adapters = adapters or {}
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}"
    auth = ' -H "Authorization: Bearer $MSTAR_API_KEY"' if config.api_key else ""
    key = "os.environ['MSTAR_API_KEY']" if config.api_key else '"none"'
    lines = [f"M* serving at {url}   (OpenAPI: {url}/docs, metrics: {url}/metrics)",
             f"  playground: {url}/   (speak, draw, chat, policies, walks in the browser)"]
    from mstar_core.nn import native  # (here: the command's other paths need no torch)

    lines.append(f"  {native.summary()}")  # (which CPU kernels run, at which instruction set)
    for name, loaded in models.items():
        src = next((m.options for m in config.models if m.name == name), None)
        origin = src.checkpoint if src and src.checkpoint else f"preset '{src.preset if src else '?'}'"
        warn = "  ** RANDOM WEIGHTS: output is noise **" if loaded.random_weights else ""
        lines.append(f"  model {name}: {origin}; routes: {', '.join(routes.get(name, [])) or 'native only'}{warn}")
    for name in models:
        r = routes.get(name, [])
        if "speech" in r:
            voices = list(getattr(adapters.get(name), "voices", None) or ["default"])
            voice = voices[0]
            lines += ["", "  curl:",
                      f"    curl {url}/v1/audio/speech{auth} -H 'Content-Type: application/json' \\",
                      f"      -d '{{\"model\": \"{name}\", \"input\": \"Hello there!\", \"voice\": \"{voice}\", "
                      f"\"response_format\": \"wav\"}}' -o speech.wav",
                      "  openai:",
                      f"    from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={key})",
                      f"    c.audio.speech.create(model='{name}', voice='{voice}', input='Hello there!', "
                      "response_format='wav').write_to_file('speech.wav')"]
        if "chat" in r:
            lines += ["", "  curl:",
                      f"    curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\",
                      f"      -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
                      "  openai:",
                      f"    from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={key})",
                      f"    print(c.chat.completions.create(model='{name}', messages=[{{'role': 'user', 'content': 'Hi'}}])"
                      ".choices[0].message.content)"]
        if "transcriptions" in r:
            lines += ["", "  curl (any audio file: wav, mp3, flac, ogg...):",
                      f"    curl {url}/v1/audio/transcriptions{auth} -F model={name} -F file=@speech.wav",
                      "  openai:",
                      f"    from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={key})",
                      f"    print(c.audio.transcriptions.create(model='{name}', file=open('speech.wav', 'rb')).text)"]
        if "images" in r:
            lines += ["", "  openai:",
                      f"    from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={key})",
                      f"    c.images.generate(model='{name}', prompt='a red fox in the snow').data[0].b64_json"]
        if "videos" in r:
            lines += ["", "  openai:",
                      f"    from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={key})",
                      f"    job = c.videos.create_and_poll(model='{name}', prompt='waves on a beach')",
                      "    c.videos.download_content(job.id).write_to_file('video.mp4')"]
        if not r or models[name].example is not None:
            lines += ["", *native_example(url, name, models[name], auth)]
    return "\n".join(lines)


#: A native example request longer than this (a waveform, an image as numbers) is not pasted into the banner.
BANNER_EXAMPLE_CHARS = 600


def native_example(url: str, name: str, loaded: Any, auth: str = "") -> list[str]:
    """Banner lines: a curl for the model's native endpoint with the model's own example request."""
    import json

    example = getattr(loaded, "example", None)
    if example is None:
        return [f"  native ({name} declares no example request; its inputs: {url}/docs):",
                f"    curl {url}/v1/walks/{name}{auth} -H 'Content-Type: application/json' -d '{{\"inputs\": {{...}}}}'"]
    body = json.dumps({"inputs": example, "stream": False}).replace("'", "'\\''")
    if len(body) > BANNER_EXAMPLE_CHARS:
        return [f"  native ({name}'s example request is {len(body):,} characters: GET {url}/v1/graphs/{name} "
                f"has it as 'example'; {url}/docs lists the inputs):",
                f"    curl {url}/v1/walks/{name}{auth} -H 'Content-Type: application/json' -d @request.json"]
    return [f"  native ({url}/docs lists {name}'s inputs):",
            f"    curl {url}/v1/walks/{name}{auth} -H 'Content-Type: application/json' -d '{body}'"]


def serving_engine(registry: Any, config: ServerConfig) -> Any:
    """The server's AsyncEngine. The serving process owns its host, so unlike an embedding application it
    splits the cores evenly with the worker processes a placement spawns here (`torch_threads="share"`); nodes a
    placement puts on workers run there (`WorkerPlacement`)."""
    from mstar_core.cluster.strategy import placed_engine

    threads = config.torch_threads if config.torch_threads is not None else "share"
    return placed_engine(registry, max_running=config.max_running, max_queued=config.max_queued, torch_threads=threads)


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; in-flight requests get `--drain-timeout` seconds, then are cancelled."""
    import uvicorn

    from mstar_core.api.server.drain import DrainingServer  # imports uvicorn: only when serving

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, host, port = build_config(args)
    except (ConfigError, OSError) as exc:
        print(f"mstar serve: {exc}", file=sys.stderr)
        return 2
    from mstar_core.plugins.manager import discover

    registry = discover(extra_modules=args.plugin)
    for info in registry.failed():
        print(f"warning: plugin {info.name} ({info.distribution}) failed to load: {info.error}", file=sys.stderr)
    for item in config.models:
        if item.compose is not None:
            from mstar_core.compose import check_roles

            try:
                check_roles(registry.compositions.get(item.compose.composition), item.compose.parts,
                            f"models.{item.name}", item.compose.options)
            except (ConfigError, LookupError) as exc:
                print(f"mstar serve: {exc}", file=sys.stderr)
                return 2
            continue
        if item.name not in registry.models:
            close = difflib.get_close_matches(item.name, list(registry.models), n=1, cutoff=0.75)
            hint = f" (did you mean '{close[0]}'?)" if close else ""  # `mstar serve vjepa` for vjepa2
            print(f"mstar serve: unknown model '{item.name}'{hint}; installed: {', '.join(registry.models) or 'none'}",
                  file=sys.stderr)
            return 2
        unknown_parts = sorted(set(item.options.parts) - set(registry.models.get(item.name).parts))
        if unknown_parts:
            known = ", ".join(registry.models.get(item.name).parts) or "none"
            print(f"mstar serve: model '{item.name}' has no part {unknown_parts[0]!r} to take a checkpoint for "
                  f"(its parts: {known})", file=sys.stderr)
            return 2

    def engine_factory():
        return serving_engine(registry, config)

    app_box: list[Any] = []

    def on_ready() -> None:
        stop_huge_pages_after_load()  # the weights are in: request buffers fault without compacting memory
        state = app_box[0].state.mstar
        routes = {name: state.routes_of(name) for name in state.engine.models}
        speech = {m: a for (m, r), a in state.adapters.items() if r == "speech"}
        print(banner(config, host, port, state.engine.models, routes, speech), flush=True)

    failed: list[str] = []

    def on_error(message: str) -> None:
        # a server without its models is useless: say why and stop (SIGTERM runs uvicorn's clean shutdown)
        print(f"mstar serve: loading models failed: {message}", file=sys.stderr, flush=True)
        failed.append(message)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        app = create_app(config, engine_factory, on_ready=on_ready, on_error=on_error, registry=registry)
    except ConfigError as exc:  # two plugins (or a plugin and the core) serving one route
        print(f"mstar serve: {exc}", file=sys.stderr)
        return 2
    app_box.append(app)
    loop = "uvloop" if _has_uvloop() else "asyncio"

    def _stopped(signum, frame):  # uvicorn re-raises the signal it drained on: make that a clean exit
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uv_config = uvicorn.Config(app, host=host, port=port, loop=loop, log_level=args.log_level,
                                   access_log=args.log_level == "debug",
                                   timeout_graceful_shutdown=args.drain_timeout, server_header=False,
                                   # no permessage-deflate: a client's compressed frame is inflated on the event loop
                                   # (a 7 MB realtime append held it 0.16 s), and the reply deflated there too
                                   ws_per_message_deflate=False)
        DrainingServer(uv_config, app.state.mstar, args.drain_timeout).run()  # SIGTERM: 503s, in-flight finish
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if failed else 0


class _Stopped(BaseException):
    """Raised by our SIGINT/SIGTERM handler once uvicorn has finished its graceful shutdown."""


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
