"""The `qwen-tts` package (built for transformers 5: `qwen-tts-compat` 0.1.1.post1, import name `qwen_tts`) as the
fidelity oracle, on the same files M* loads.

`import qwen_tts` also loads the 25 Hz tokenizer, whose imports (`sox`, `torchaudio`) this project does not install;
the 12 Hz model and tokenizer never touch it, so when those are missing its module is stood in for by an empty one.
Tests skip when `qwen_tts` or `librosa` (imported by the model file) is absent.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch


def import_qwen_tts():
    if importlib.util.find_spec("qwen_tts") is None:
        pytest.skip("qwen-tts (pip install qwen-tts-compat==0.1.1.post1 --no-deps) is not installed")
    pytest.importorskip("librosa")
    if importlib.util.find_spec("sox") is None or importlib.util.find_spec("torchaudio") is None:
        stub = types.ModuleType("qwen_tts.core.tokenizer_25hz.vq.speech_vq")
        stub.WhisperEncoderVQ = stub.XVectorExtractor = type("Unused25HzPart", (), {})
        sys.modules.setdefault(stub.__name__, stub)
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from qwen_tts.core.models import modeling_qwen3_tts as modeling

    for cls in (modeling.Qwen3TTSTalkerForConditionalGeneration,
                modeling.Qwen3TTSTalkerCodePredictorModelForConditionalGeneration):
        _take_cache_keyword(cls)
    return Qwen3TTSConfig, Qwen3TTSForConditionalGeneration


def _take_cache_keyword(cls) -> None:
    """transformers 5.25's `generate` hands a model its KV cache as `cache=`, where this build's forwards read
    `past_key_values=`; unshimmed, the cache lands in `**kwargs` and every decode step attends to itself alone
    (its codes then differ from the same model run densely). Map the keyword back, once per class."""
    forward = cls.forward
    if getattr(forward, "_mstar_takes_cache", False):
        return

    @functools.wraps(forward)  # generate checks its keyword arguments against the forward's own signature
    def take_cache(self, *args, **kwargs):
        cache = kwargs.pop("cache", None)
        if cache is not None and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = cache
        return forward(self, *args, **kwargs)

    take_cache._mstar_takes_cache = True
    cls.forward = take_cache


def load_reference(directory: Path):
    """`Qwen3TTSForConditionalGeneration` built from the checkpoint's config with its safetensors loaded (fp32)."""
    from safetensors.torch import load_file

    config_cls, model_cls = import_qwen_tts()
    cfg = config_cls(**json.loads((directory / "config.json").read_text()))
    # transformers 5 configs no longer default `pad_token_id`, which the predictor's constructor reads (unused)
    predictor = cfg.talker_config.code_predictor_config
    if not hasattr(predictor, "pad_token_id"):
        predictor.pad_token_id = None
    cfg._attn_implementation = "eager"
    cfg.talker_config._attn_implementation = "eager"
    cfg.talker_config.code_predictor_config._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    missing, unexpected = model.load_state_dict(load_file(directory / "model.safetensors"), strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)
    return model


def load_reference_decoder(directory: Path):
    """The upstream 12 Hz tokenizer's decoder with the checkpoint's `speech_tokenizer/` weights (fp32)."""
    from safetensors.torch import load_file

    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

    where = directory / "speech_tokenizer"
    cfg = Qwen3TTSTokenizerV2Config(**json.loads((where / "config.json").read_text())).decoder_config
    cfg._attn_implementation = "eager"
    decoder = Qwen3TTSTokenizerV2Decoder(cfg).eval()
    state = {k[len("decoder."):]: v for k, v in load_file(where / "model.safetensors").items()
             if k.startswith("decoder.")}
    missing, unexpected = decoder.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return decoder


@torch.no_grad()
def reference_codes(model, text_ids, *, speaker=None, instruct_ids=None, language="auto", non_streaming=True,
                    max_frames=24, repetition_penalty=1.05) -> torch.Tensor:
    """Greedy codes `[frames, G]` from the upstream `generate(do_sample=False, subtalker_dosample=False)`."""
    codes, _ = model.generate(
        input_ids=[torch.tensor([list(text_ids)])],
        instruct_ids=[torch.tensor([list(instruct_ids)]) if instruct_ids else None],
        languages=[language], speakers=[speaker], non_streaming_mode=non_streaming, max_new_tokens=max_frames,
        do_sample=False, subtalker_dosample=False, repetition_penalty=repetition_penalty)
    return codes[0]


def load_reference_tokenizer(directory: Path):
    """The upstream 12 Hz tokenizer (`Qwen3TTSTokenizerV2Model`, its `encode` is the oracle) with the checkpoint's
    `speech_tokenizer/` weights (fp32).

    Its encoder subclasses transformers' `MimiModel` and clears the decoder half by assigning `None` to names that
    transformers 5.25's `MimiModel` made read-only properties (the halves are now `MimiModel.encoder` and
    `.decoder`); the stand-in constructor builds the same Mimi without its decoder the 5.25 way
    (`decoder_config = None`). The flat checkpoint names are mapped as transformers' own conversion for `MimiModel`
    maps them (`encoder.layers` -> `encoder.encoder_seanet.layers`, `encoder_transformer.` and `downsample.` under
    `encoder.`).
    """
    import copy
    import re

    from safetensors.torch import load_file

    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as modeling
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from transformers import MimiModel

    def without_decoder(self, config):
        config = copy.deepcopy(config)
        config.decoder_config = None
        MimiModel.__init__(self, config)

    modeling.Qwen3TTSTokenizerV2Encoder.__init__ = without_decoder
    where = directory / "speech_tokenizer"
    raw = json.loads((where / "config.json").read_text())
    cfg = Qwen3TTSTokenizerV2Config(**raw)
    cfg.encoder_config._attn_implementation = "eager"
    cfg.decoder_config._attn_implementation = "eager"
    # the upstream decoder concatenates the two ratio lists: give it lists, as its JSON would
    cfg.decoder_config.upsample_rates = list(cfg.decoder_config.upsample_rates)
    cfg.decoder_config.upsampling_ratios = list(cfg.decoder_config.upsampling_ratios)
    model = modeling.Qwen3TTSTokenizerV2Model(cfg).eval()
    renames = ((r"^encoder\.encoder\.layers", "encoder.encoder.encoder_seanet.layers"),
               (r"^encoder\.encoder_transformer\.", "encoder.encoder.encoder_transformer."),
               (r"^encoder\.downsample\.", "encoder.encoder.downsample."))
    state = {}
    for name, tensor in load_file(where / "model.safetensors").items():
        for pattern, repl in renames:
            name = re.sub(pattern, repl, name)
        state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    # the tiny preset writes what encoding reads: not the quantizers' decoding projections or training flags
    assert not unexpected and all(re.search(r"inv_freq|output_proj|initialized", k) for k in missing), (
        missing, unexpected)
    return model
