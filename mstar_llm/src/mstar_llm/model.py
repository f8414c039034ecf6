"""`ModelSpec("llama")`: a HF Llama/Qwen2/Qwen3 checkpoint dir, a `.gguf` file, or a preset, as a served LM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from mstar_core.errors import ConfigError
from mstar_core.graph import Graph, GraphNode
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_llm.prepare import EXAMPLE, RequestPreparer

PRESETS = ("tiny", "smollm2")


def _dtype(options: LoadOptions) -> torch.dtype:
    if options.dtype is None:
        return torch.bfloat16 if str(options.device).startswith("cuda") else torch.float32
    dtype = getattr(torch, options.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"unknown dtype {options.dtype!r}; use float32, bfloat16 or float16")
    return dtype


#: Emitted with each token when the request asks for log-probabilities (`logprobs` in its sampling). They come
#: first among the node's outputs, so a caller holds a token's log-probabilities by the time the token arrives.
LOGPROB_OUTPUTS = ("logprob", "top_logprobs")


def build_graph(lm: Any, name: str = "llama") -> Graph:
    """One `kvcache` node `lm`; walks `prefill` then `decode` until a finish reason, emitting `next_token`
    (and, when asked, each token's `logprob` and `top_logprobs` just before it)."""
    from mstar_kvcache import ar_walks

    node = GraphNode(
        "lm",
        inputs=("input_ids",),
        optional_inputs=("sampling",),
        outputs=(*LOGPROB_OUTPUTS, "next_token", "finish_reason"),
        engine="kvcache",
        module=lambda: lm,
    )
    walks = [attrs.evolve(w, emit=(*LOGPROB_OUTPUTS, *w.emit)) for w in ar_walks("lm")]
    return Graph.build(name, [node], walks, plan=lambda inputs: ["prefill", "decode"])


def _load_hf(directory: Path, options: LoadOptions, progress: bool) -> tuple[Any, Any, str | None, list[int]]:
    from mstar_core.checkpoint import load_tokenizer, read_chat_template, read_config, read_eos_token_ids
    from mstar_core.nn.llama import load_llama

    lm = load_llama(directory, dtype=_dtype(options), device=options.device_for("lm"), progress=progress)
    eos = read_eos_token_ids(directory, read_config(directory))
    return lm, load_tokenizer(directory), read_chat_template(directory), eos


def _load_gguf(path: Path, options: LoadOptions, progress: bool) -> tuple[Any, Any, str | None, list[int]]:
    from mstar_core.checkpoint import (
        GGUFSource,
        build_and_load,
        gguf_llama_config,
        gguf_llama_mapping,
        gguf_tokenizer,
    )
    from mstar_core.nn import LlamaForCausalLM

    source = GGUFSource(path)
    cfg = gguf_llama_config(source)
    lm = build_and_load(
        lambda: LlamaForCausalLM(cfg), source, gguf_llama_mapping(cfg),
        dtype=_dtype(options), device=options.device_for("lm"), progress=progress,
    )
    eos = [cfg["eos_token_id"]] if cfg.get("eos_token_id") is not None else []
    return lm, gguf_tokenizer(source.metadata), source.metadata.get("tokenizer.chat_template"), eos


def load_llm(options: LoadOptions, *, name: str = "llama", progress: bool = True) -> LoadedModel:
    """Load from `options.checkpoint` (HF dir or `.gguf`) or `options.preset` (`tiny`, `smollm2`)."""
    from mstar_llm.preset import ensure_tiny, smollm2_gguf

    if options.checkpoint and options.preset:
        raise ConfigError(f"{name}: pass a checkpoint or a preset, not both")
    preset = None if options.checkpoint else (options.preset or "tiny")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"{name}: unknown preset {preset!r}; known: {list(PRESETS)}")
    if preset == "tiny":
        path = ensure_tiny()
    elif preset == "smollm2":
        path = smollm2_gguf()
    else:
        path = Path(options.checkpoint)
    loader = _load_gguf if path.suffix == ".gguf" else _load_hf
    lm, tokenizer, template, eos = loader(path, options, progress)
    cfg = lm.config
    specials = {k: tokenizer.id_to_token(v) for k, v in (("bos_token", cfg.bos_token_id),) if v is not None}
    specials.update({"eos_token": tokenizer.id_to_token(eos[0])} if eos else {})
    prepare = RequestPreparer(
        tokenizer=tokenizer,
        chat_template=template,
        eos_token_ids=tuple(eos),
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
        special_tokens={k: v for k, v in specials.items() if v is not None},
    )
    return LoadedModel(
        name=name,
        graph=build_graph(lm, name),
        random_weights=preset == "tiny",
        prepare=prepare,
        request_schema=prepare.schema,
        engine_settings={"lm": {}},
        extras={
            "tokenizer": tokenizer,
            "chat_template": template,
            "eos_token_ids": list(eos),
            "config": cfg,
            "checkpoint": str(path),
            "max_model_len": cfg.max_position_embeddings,
        },
    )


def _load(options: LoadOptions) -> LoadedModel:
    return load_llm(options)


SPEC = ModelSpec(
    name="llama",
    load=_load,
    presets=PRESETS,
    example=EXAMPLE,
    description="Llama / Qwen2 / Qwen3-layout causal LM (HF checkpoint dir or GGUF) on the paged-KV engine",
)
