"""`ModelSpec("llama")`: a HF Llama/Qwen2/Qwen3 checkpoint dir, a `.gguf` file, or a preset, as a served LM."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.grammar import GrammarVocab
from mstar_core.graph import DynamicLoop, FromEnv, Graph, GraphNode, NodeCall, Parallel, Sequential, Walk
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_llm.prepare import EXAMPLE, RequestPreparer

PRESETS = ("tiny", "smollm2")


#: Emitted with each token when the request asks for log-probabilities (`logprobs` in its sampling). They come
#: first among the node's outputs, so a caller holds a token's log-probabilities by the time the token arrives.
LOGPROB_OUTPUTS = ("logprob", "top_logprobs")


def choice_walks(node: str = "lm", default_max_tokens: int | None = None) -> tuple[Walk, Walk]:
    """`n > 1` choices as cache forks: `prefill_shared` runs the prompt but its last token once on label `main`
    (nothing sampled is kept), then `choices` fans out `n` branches: branch `i` forks `main` as label `choice<i>`
    (shared pages, copy-on-write), feeds the prompt's last token and samples its first token with seed + i, then
    decodes until its finish reason. So choice i samples what a single request seeded with seed + i does (the
    same draws over logits equal up to the last ulps: the prompt's last token runs as a step of its own here).
    Every emitted value carries its branch (`Output.branch`); a one-token prompt skips `prefill_shared`
    (`fork_label` None: each branch starts empty)."""
    # the kvcache engine (about 1 s of imports) comes in when a graph is built, not when `import mstar_llm`
    # brings this module in for its spec at plugin discovery
    from mstar_kvcache.walks import decode_iterations

    label = FromEnv("choice", "choice{}")
    seed = FromEnv("choice")
    prefill = Walk(
        name="prefill_shared",
        # no sampling: the token it predicts is dropped, and no random stream is drawn from
        body=NodeCall(node, inputs={"input_ids": "prompt_head", "sampling": None},
                      outputs={name: f"prompt_{name}" for name in (*LOGPROB_OUTPUTS, "next_token", "finish_reason")},
                      options={"cache_label": "main"}),
        inputs=("prompt_head",),
        optional_inputs=("lora",),
        description=f"run the prompt but its last token through '{node}' once, on cache label 'main'",
    )
    first = NodeCall(node, inputs={"input_ids": "prompt_tail", "sampling": "sampling"},
                     options={"cache_label": label, "fork_from": FromEnv("fork_label"), "seed_offset": seed})
    decode = DynamicLoop(
        body=NodeCall(node, inputs={"input_ids": "next_token", "sampling": "sampling"},
                      options={"cache_label": label, "seed_offset": seed}),
        until=lambda env: env.get("finish_reason") is not None,
        max_iters=decode_iterations("sampling", default_max_tokens),
    )
    choices = Walk(
        name="choices",
        # every name a branch writes comes back as a list, one value per choice
        body=Parallel(Sequential(first, decode), count="n", index_name="choice"),
        inputs=("prompt_tail", "n", "fork_label"),
        optional_inputs=("sampling", "lora"),
        outputs=("next_token", "finish_reason"),
        emit=(*LOGPROB_OUTPUTS, "next_token"),
        description=f"fork the prompt's cache n times and decode the forks side by side on '{node}'",
    )
    return prefill, choices


def plan(inputs: Mapping[str, Any]) -> list[str]:
    if inputs.get("n") is None:
        return ["prefill", "decode"]
    return ["prefill_shared", "choices"] if inputs.get("fork_label") is not None else ["choices"]


def build_graph(lm: Any, name: str = "llama") -> Graph:
    """One `kvcache` node `lm`; walks `prefill` then `decode` until a finish reason, emitting `next_token`
    (and, when asked, each token's `logprob` and `top_logprobs` just before it); with `n` (see `choice_walks`),
    `prefill_shared` then `choices`."""
    from mstar_kvcache import ar_walks  # (imported here: see `choice_walks`)

    node = GraphNode(
        "lm",
        inputs=("input_ids",),
        optional_inputs=("sampling", "lora"),  # lora: the request's LoRA adapter (mstar_kvcache.walks.LORA_INPUT)
        outputs=(*LOGPROB_OUTPUTS, "next_token", "finish_reason"),
        engine="kvcache",
        module=lambda: lm,
    )
    walks = [attrs.evolve(w, emit=(*LOGPROB_OUTPUTS, *w.emit)) for w in ar_walks("lm")]
    return Graph.build(name, [node], [*walks, *choice_walks("lm")], plan=plan)


def _load_hf(directory: Path, options: LoadOptions, progress: bool) -> tuple[Any, Any, str | None, list[int]]:
    # the loading stack (checkpoint readers, the split Llama: over half a second) is imported when a model loads
    from mstar_core.checkpoint import load_tokenizer, read_chat_template, read_config, read_eos_token_ids
    from mstar_core.nn.parallel import load_llama_for_rank

    # with a rank group: this rank's slices only, read straight from the memory-mapped files
    lm = load_llama_for_rank(directory, options.tensor_parallel, dtype=options.torch_dtype("llama", None),
                             device=options.device_for("lm"), module="node 'lm' (llama)", progress=progress)
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

    if options.tensor_parallel is not None and options.tensor_parallel.world_size > 1:
        raise ConfigError(f"node 'lm' (llama): a GGUF checkpoint ({path.name}) cannot be split across ranks; "
                          "serve a HF safetensors checkpoint with tensor_parallel, or drop tensor_parallel")
    source = GGUFSource(path)
    cfg = gguf_llama_config(source)
    lm = build_and_load(
        lambda: LlamaForCausalLM(cfg), source, gguf_llama_mapping(cfg),
        dtype=options.torch_dtype("llama", None), device=options.device_for("lm"), progress=progress,
    )
    eos = [cfg["eos_token_id"]] if cfg.get("eos_token_id") is not None else []
    return lm, gguf_tokenizer(source.metadata), source.metadata.get("tokenizer.chat_template"), eos


def load_llm(options: LoadOptions, *, name: str = "llama", progress: bool = True) -> LoadedModel:
    """Load from `options.checkpoint` (HF dir or `.gguf`) or `options.preset` (`tiny`, `smollm2`)."""
    from mstar_llm.preset import ensure_tiny, smollm2_gguf

    preset = options.preset_or_checkpoint(name, PRESETS)
    if preset == "tiny":
        path = ensure_tiny()
    elif preset == "smollm2":
        path = smollm2_gguf()
    else:
        path = Path(options.checkpoint)
    loader = _load_gguf if path.suffix == ".gguf" else _load_hf
    lm, tokenizer, template, eos = loader(path, options, progress)
    cfg = lm.config
    # what the kvcache engine compiles sampling grammars against (structured outputs, tool calls)
    lm.grammar_vocab = GrammarVocab.from_tokenizer(tokenizer, cfg.vocab_size, eos)
    specials = {k: tokenizer.id_to_token(v) for k, v in (("bos_token", cfg.bos_token_id),) if v is not None}
    specials.update({"eos_token": tokenizer.id_to_token(eos[0])} if eos else {})
    from mstar_core.checkpoint.hf import read_sampling_defaults

    # the checkpoint's generation_config.json (a GGUF file has none beside it), unless the deploy says otherwise
    defaults = read_sampling_defaults(None if path.suffix == ".gguf" else path, options.generation_config)
    prepare = RequestPreparer(
        tokenizer=tokenizer,
        chat_template=template,
        eos_token_ids=tuple(eos),
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
        special_tokens={k: v for k, v in specials.items() if v is not None},
        sampling_defaults=defaults,
    )
    return LoadedModel(
        name=name,
        graph=build_graph(lm, name),
        random_weights=preset == "tiny",
        prepare=prepare,
        request_schema=prepare.schema,
        sampling_defaults=defaults,
        engine_settings={"lm": {}},
        extras={
            "tokenizer": tokenizer,
            "chat_template": template,
            "eos_token_ids": list(eos),
            "config": cfg,
            "checkpoint": str(path),
            "max_model_len": cfg.max_position_embeddings,
            "grammar_vocab": lm.grammar_vocab,
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
