"""The deploy file for `mstar serve --config`: server options and per-model loading, strictly checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mstar_core.api.media import MediaLimits
from mstar_core.api.server.app import ModelToServe, ServerConfig
from mstar_core.config.compose import COMPOSE_KEY, ComposeSettings
from mstar_core.config.lora import DEPLOY_KEYS as LORA_KEYS
from mstar_core.config.lora import LoraSettings
from mstar_core.config.placement import PLACEMENT_KEYS, Placement, load_placement
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.strict import reject_unknown

#: server options a deploy file may set beside host and port (ServerConfig's fields of the same names)
_OPTION_KEYS = ("api_key", "max_body_bytes", "max_running", "max_queued", "request_timeout", "max_n", "torch_threads",
                "state_dir", "batch_max_file_bytes", "batch_max_lines", "batch_concurrency")
_SERVER_KEYS = {"host", "port", *_OPTION_KEYS}
_MODEL_KEYS = {"checkpoint", "preset", "device", "dtype", "engines", "placement", "media", "generation_config",
               *LORA_KEYS}
#: in a per-part `checkpoint:` mapping, the key of the model's own checkpoint (the others name its parts)
MAIN_PART = "model"


def _check(section: str, data: Any, allowed: set[str]) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{section} must be a mapping, got {type(data).__name__}")
    reject_unknown(data, allowed, section)
    return data


def load_deploy(path: str | Path) -> tuple[dict[str, Any], dict[str, ModelToServe]]:
    """Read a deploy file: (server options, models by name). Unknown keys are errors naming the key.

    Shape::

        server: {host: 0.0.0.0, port: 8000, max_running: 64, max_queued: 256}
        models:
          orpheus: {checkpoint: /ckpt/orpheus, device: cuda:0, engines: {lm: {num_pages: 4096}},
                    placement: placement/orpheus-disaggregated.yaml}   # a file (relative to this one) or inline
          qwen3-omni: {checkpoint: Qwen/Qwen3-Omni-30B-A3B-Instruct,   # a Hub id: fetched into the HF cache
                       generation_config: none,    # greedy unless asked (default auto: generation_config.json's)
                       media: {max_image_pixels: 4000000, url_prefixes: ["https://cdn.example.com/img/"]}}
          # a checkpoint per part: the model's own under `model`, a part's under its name (`ModelSpec.parts`)
          orpheus-hub: {checkpoint: {model: canopylabs/orpheus-3b-0.1-ft, snac: hubertsiuzdak/snac_24khz}}
          llama: {checkpoint: /ckpt/llama, lora_adapters: {sql: /adapters/sql}, max_loras: 4, max_lora_rank: 16}
          # a model built from the others' nodes (their weights and engines shared): `compose` and one model per role
          agent: {compose: voice_agent, asr: whisper, llm: llama, tts: qwen3-tts}

    A checkpoint is a local path, or a Hugging Face Hub id `ORG/NAME[@REVISION]` (a local path of that name wins).

    A deploy file may also be a bare placement file (top-level `workers`/`nodes`/...): it then
    applies to every model named on the command line.
    """
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if isinstance(raw, dict) and raw and set(raw) <= PLACEMENT_KEYS:
        return {}, {"*": ModelToServe("*", LoadOptions(), {}, Placement.from_dict(raw, str(path)))}
    top = _check(f"{path}", raw, {"server", "models"})
    server = _check(f"{path}: server", top.get("server"), _SERVER_KEYS)
    models: dict[str, ModelToServe] = {}
    entries = _check(f"{path}: models", top.get("models"), set(top.get("models") or {}))
    for name, spec in entries.items():
        if isinstance(spec, dict) and COMPOSE_KEY in spec:  # built from the other models' nodes, not loaded itself
            compose = ComposeSettings.from_deploy(spec, f"{path}: models.{name}", entries)
            models[name] = ModelToServe(name, LoadOptions(), dict(compose.engines), compose=compose)
            continue
        spec = _check(f"{path}: models.{name}", spec, _MODEL_KEYS)
        engines = spec.get("engines") or {}
        if not isinstance(engines, dict) or not all(isinstance(v, dict) for v in engines.values()):
            raise ConfigError(f"{path}: models.{name}.engines must map node names to settings mappings")
        checkpoint, parts = _checkpoints(f"{path}: models.{name}.checkpoint", spec.get("checkpoint"))
        options = LoadOptions(
            checkpoint=checkpoint,
            preset=spec.get("preset") if checkpoint is None else None,
            device=spec.get("device", "cpu"),
            dtype=spec.get("dtype"),
            parts=parts,
            generation_config=check_generation_config(spec.get("generation_config", "auto"),
                                                      f"{path}: models.{name}.generation_config"),
        )
        media = spec.get("media") or {}
        MediaLimits().with_settings(media, f"{path}: models.{name}.media")  # checked now, applied at startup
        models[name] = ModelToServe(
            name, options, {k: dict(v) for k, v in engines.items()}, _placement(path, name, spec.get("placement")),
            media=dict(media), lora=LoraSettings.from_deploy(spec, f"{path}: models.{name}"),
        )
    return server, models


def _checkpoints(where: str, value: Any) -> tuple[str | None, dict[str, str]]:
    """A `checkpoint:` value as (the model's checkpoint, its parts' checkpoints): a path or Hub id, or a mapping
    with the model's own under `model` and each part's under the part's name."""
    if value is None or isinstance(value, str):
        return value, {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{where} must be a path or Hub id, or a mapping of part names ('{MAIN_PART}' for the model "
                          f"itself) to paths or Hub ids; got {value!r}")
    parts = dict(value)
    return parts.pop(MAIN_PART, None), parts


def check_generation_config(value: Any, where: str) -> str:
    """`auto`, `none` (also vLLM's `vllm`) or a directory holding a generation_config.json; else a ConfigError."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be 'auto', 'none' or a directory with a generation_config.json; got {value!r}")
    if value not in ("auto", "none", "vllm") and not (Path(value).expanduser() / "generation_config.json").is_file():
        raise ConfigError(f"{where}: {value!r} is not 'auto', 'none' or a directory with a generation_config.json")
    return value


def _placement(path: str | Path, model: str, value: Any) -> Placement | None:
    if value is None:
        return None
    if isinstance(value, str):
        return load_placement(Path(path).parent / value)
    return Placement.from_dict(value, f"{path}: models.{model}.placement")


def apply_server_options(config: ServerConfig, options: dict[str, Any]) -> None:
    for key in _OPTION_KEYS:
        if key in options:
            setattr(config, key, options[key])
