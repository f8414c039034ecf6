"""`ModelSpec("whisper")`: a Hugging Face Whisper directory (or the tiny preset) as a served `LoadedModel`."""

from __future__ import annotations

from pathlib import Path

from mstar_core.checkpoint import load_tokenizer
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_core.nn.packed import pack_linears
from mstar_whisper.checkpoint import load_whisper
from mstar_whisper.graph import build_graph
from mstar_whisper.preset import ensure_tiny
from mstar_whisper.request import EXAMPLE, WhisperRequest

#: KV pages per decoder: a 30-second window's 1500 encoder frames take 94 pages of 16 per request.
DECODER_SETTINGS = {"page_size": 16, "num_pages": 2048}
#: One 30-second window an encoder step: its activations then stay in L3 (whisper-base: a [1500, 2048] fc1 output is
#: 12 MB, 98 MB for 8 windows), and its GEMMs are compute-bound at 1500 rows already. Whisper-base on the 2-core EPYC,
#: alternated: 896-939 CPU ms a window at 1 against 982-1041 at 8 (1 thread); 16 clips served at c=8 took 23.0-26.3 CPU
#: s against 24.8-27.6 (BENCHMARKS.md, issue 47). Requests that arrive together take turns, a window a step.
ENCODER_SETTINGS = {"max_batch_size": 1}


def load(options: LoadOptions, *, progress: bool = True) -> LoadedModel:
    preset = options.preset_or_checkpoint("whisper", ("tiny",))
    directory = Path(options.checkpoint) if preset is None else ensure_tiny()
    model, config, tokens, features = load_whisper(directory, dtype=options.torch_dtype("whisper", "float32"),
                                                   device=options.device_for("encoder", "decoder"), progress=progress)
    # the encoder's linears run prepacked (M*'s fp32 panels, oneDNN for bf16), as the kvcache engine packs the
    # decoder's: ~10% less CPU per 30-second window than MKL repacking each weight per call (whisper-tiny, 2 threads)
    pack_linears(model.model.encoder)
    graph = build_graph(model.model.encoder, model.model.decoder, tokens)
    request = WhisperRequest(tokens, features, config.vocab_size)
    return LoadedModel(
        name="whisper",
        graph=graph,
        random_weights=preset is not None,
        prepare=request,
        request_schema=request.schema,
        engine_settings={"decoder": dict(DECODER_SETTINGS), "encoder": dict(ENCODER_SETTINGS)},
        extras={"tokenizer": load_tokenizer(directory), "tokens": tokens, "features": features,
                "sample_rate": features.sampling_rate, "checkpoint": str(directory)},
    )


SPEC = ModelSpec(name="whisper", load=load, presets=("tiny",), example=EXAMPLE,
                 description="Whisper speech recognition: encoder (stateless) + cross-attending decoder (paged KV)")
