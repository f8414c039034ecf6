"""Hugging Face checkpoint-directory metadata: `config.json`, `tokenizer.json`, chat template, EOS ids, and the default
sampling of `generation_config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mstar_core.checkpoint.errors import CheckpointError
from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingDefaults

GENERATION_CONFIG = "generation_config.json"
#: `LoadOptions.generation_config` values that keep `SamplingParams`' own defaults (vLLM calls that choice "vllm")
NO_GENERATION_CONFIG = ("none", "vllm")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_config(directory: str | Path) -> dict[str, Any]:
    """`config.json` of a checkpoint directory as a dict."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (is this a Hugging Face checkpoint directory?)")
    return _read_json(path)


def load_tokenizer(directory: str | Path):
    """`tokenizer.json` through the `tokenizers` library."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no tokenizer.json (only fast-tokenizer files are supported)")
    return Tokenizer.from_file(str(path))


def read_chat_template(directory: str | Path) -> str | None:
    """The Jinja chat template from `chat_template.jinja` or `tokenizer_config.json`, if any."""
    directory = Path(directory)
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        template = _read_json(cfg_path).get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template
    return None


def read_eos_token_ids(directory: str | Path, config: dict[str, Any] | None = None) -> list[int]:
    """EOS ids from `generation_config.json` (preferred, as `generate` does) or `config.json`."""
    directory = Path(directory)
    sources = []
    gen = directory / "generation_config.json"
    if gen.is_file():
        sources.append(_read_json(gen))
    sources.append(config if config is not None else read_config(directory))
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [int(eos)]
    return []


def read_sampling_defaults(directory: str | Path | None, source: str = "auto",
                           fields: tuple[str, ...] | None = None) -> SamplingDefaults:
    """A model's default sampling from a `generation_config.json` (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens as max_tokens; `do_sample: false` as greedy), as vLLM applies it.

    `source` (`LoadOptions.generation_config`): "auto" reads the checkpoint `directory`'s file if it has one (none:
    no defaults); "none"/"vllm" reads nothing; anything else is a directory that must hold the file. `fields` keeps
    only the sampling fields the model forwards. A value out of its field's bounds is a `CheckpointError` naming the
    file and the field.
    """
    if source in NO_GENERATION_CONFIG:
        return SamplingDefaults()
    if source == "auto":
        if directory is None or not (Path(directory) / GENERATION_CONFIG).is_file():
            return SamplingDefaults()
        path = Path(directory) / GENERATION_CONFIG
    else:
        path = Path(source).expanduser() / GENERATION_CONFIG
        if not path.is_file():
            raise CheckpointError(f"generation_config {source!r}: no {GENERATION_CONFIG} there")
    try:
        defaults = SamplingDefaults.from_generation_config(_read_json(path))
    except (RequestError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if fields is not None:
        defaults = SamplingDefaults({k: v for k, v in defaults.values.items() if k in fields})
    return defaults
