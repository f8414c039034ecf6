"""`ModelSpec("qwen3-omni")`: a Qwen3-Omni checkpoint directory or the `tiny` preset -> `LoadedModel`."""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from mstar_core.grammar import GrammarVocab
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_qwen_omni.prepare import EXAMPLE, SAMPLING, Preparer

PRESETS = ("tiny",)


def load(options: LoadOptions) -> LoadedModel:
    # the loading stack is imported when a model loads: discovery imports this module (for SPEC) in every process
    from mstar_core.checkpoint import load_tokenizer
    from mstar_core.checkpoint.hf import read_sampling_defaults
    from mstar_qwen_omni.checkpoint import load_omni
    from mstar_qwen_omni.graph import SPEECH_NODES, build_graph
    from mstar_qwen_omni.parallel import load_omni_tensor_parallel
    from mstar_qwen_omni.preset import ensure_tiny

    preset = options.preset_or_checkpoint("qwen3-omni", PRESETS)
    directory = Path(ensure_tiny() if preset else options.checkpoint)
    group = options.tensor_parallel  # (the rank group, if any)
    if group is not None and group.world_size > 1:
        model = load_omni_tensor_parallel(directory, group, options)
    else:
        model = load_omni(directory, device=options.device, dtype=options.torch_dtype("qwen3-omni"))
    if model.code2wav is not None and options.device != "meta":
        model.code2wav.float()  # the codec runs in fp32 whatever the LM dtype
    defaults = read_sampling_defaults(directory, options.generation_config, fields=SAMPLING)
    prepare = Preparer(model.config, load_tokenizer(directory), model.talker is not None, sampling_defaults=defaults)
    # what the Thinker's kvcache engine compiles sampling grammars against (structured outputs, tool calls)
    vocab = GrammarVocab.from_tokenizer(prepare.tokenizer, model.config.thinker.text.vocab_size,
                                        [model.config.im_end_token_id])
    # the media placeholders stand for features, never for text: a reply that sampled one (random weights can) could
    # not be sent back as the next turn's history, which refuses them, so the engine never samples them
    t = model.config.thinker
    media = {t.audio_token_id, t.image_token_id, t.video_token_id}
    model.thinker.grammar_vocab = attrs.evolve(vocab, no_token_ids=tuple(sorted({*vocab.no_token_ids, *media})))
    text_embed = None
    hosted = set(options.nodes or ())
    if options.nodes is not None and hosted & set(SPEECH_NODES) and not hosted & {"thinker", "encode"}:
        # this process speaks but does not think: a copy of the token embeddings lets the Thinker go
        text_embed = torch.nn.Embedding.from_pretrained(model.thinker.model.embed_tokens.weight.detach().clone())
    pages = {"num_pages": 512, "page_size": 16}
    return LoadedModel(
        name="qwen3-omni",
        graph=build_graph(model, text_embed=text_embed),
        random_weights=preset is not None,
        prepare=prepare,
        request_schema=prepare.schema,
        sampling_defaults=defaults,
        engine_settings={"thinker": dict(pages), "talker": dict(pages), "code_predictor": dict(pages)},
        extras={"model": model, "config": model.config, "tokenizer": prepare.tokenizer, "checkpoint": str(directory),
                "grammar_vocab": model.thinker.grammar_vocab},
    )


SPEC = ModelSpec(name="qwen3-omni", load=load, presets=PRESETS, example=EXAMPLE,
                 description="Qwen3-Omni: MoE Thinker writes while the Talker, code predictor and Code2Wav speak")
