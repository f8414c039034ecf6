"""`ModelSpec("qwen3-tts")`: a Qwen3-TTS 12 Hz checkpoint directory or the `tiny` preset -> `LoadedModel`."""

from __future__ import annotations

from pathlib import Path

from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_qwen_tts.prepare import EXAMPLE

PRESETS = ("tiny", "tiny-design", "tiny-base")
#: The Talker's default `admit_streams` (the policy's defaults but these two): a stream's lead counts the frames of
#: the 25-frame (2 s) window not yet decoded, so its listener holds its lead less up to 2 s; 3 s keeps every playing
#: listener at least a second from running dry before another stream starts. Three may start at once: with one, each
#: admission waited for the last stream's first window and a second's speed reading, so 8-s streams ran ~2-3 at a
#: time and a crowd got 4.7 audio-s/s of the box's ~12 (BENCHMARKS.md, Qwen3-TTS: 10.0 with three, viability 1.0)
ADMIT_STREAMS = {"min_lead_s": 3.0, "max_starting": 3}


def load(options: LoadOptions) -> LoadedModel:
    # the loading stack is imported when a model loads: discovery imports this module (for SPEC) in every process
    from mstar_core.checkpoint import load_tokenizer
    from mstar_qwen_tts.checkpoint import (
        load_speech_decoder,
        load_speech_encoder,
        load_tts,
        read_generation_config,
    )
    from mstar_qwen_tts.graph import build_graph
    from mstar_qwen_tts.prepare import Preparer
    from mstar_qwen_tts.preset import ensure_tiny

    preset = options.preset_or_checkpoint("qwen3-tts", PRESETS)
    directory = Path(ensure_tiny(preset) if preset else options.checkpoint)
    model = load_tts(directory, device=options.device, dtype=options.torch_dtype("qwen3-tts"))
    decoder = load_speech_decoder(directory, device=options.device)
    # Base checkpoints clone voices: with a transcript, the reference audio's codes come from the tokenizer's encoder
    # (run once per created voice, by the speech adapter)
    encoder = (load_speech_encoder(directory, device=options.device)
               if model.config.tts_model_type == "base" else None)
    prepare = Preparer(model.config, load_tokenizer(directory), read_generation_config(directory))
    pages = {"num_pages": 512, "page_size": 16}
    # A speech server's streams run dry together once more start than the machine speaks in real time: by default
    # the Talker admits a new stream only while the admitted ones keep their listeners ahead at a measured speed
    # (`mstar_core.runtime.stream_admission`; `{"talker": {"admit_streams": false}}` turns it off). A Talker placed
    # in a worker process drops this default (its calls' leads do not cross the wire yet).
    talker = {**pages, "admit_streams": ADMIT_STREAMS}
    return LoadedModel(
        name="qwen3-tts",
        graph=build_graph(model, decoder),
        random_weights=preset is not None,
        prepare=prepare,
        request_schema=prepare.schema,
        engine_settings={"talker": talker, "code_predictor": dict(pages), "code2wav": {"max_batch_size": 64}},
        extras={"model": model, "config": model.config, "decoder": decoder, "speech_encoder": encoder, "tokenizer": prepare.tokenizer,
                "checkpoint": str(directory), "sample_rate": 24000, "voices": prepare.speakers},
    )


SPEC = ModelSpec(name="qwen3-tts", load=load, presets=PRESETS, example=EXAMPLE,
                 description="Qwen3-TTS 12 Hz: preset speakers and voice design; Talker, code predictor and the "
                             "speech decoder stream audio while the Talker speaks")
