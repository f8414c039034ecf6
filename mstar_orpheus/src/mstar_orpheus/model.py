"""`ModelSpec("orpheus")`: load a checkpoint (or the tiny preset) into a served `LoadedModel`."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mstar_core.checkpoint import load_tokenizer
from mstar_core.checkpoint.meta import on_meta
from mstar_core.errors import ConfigError
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_core.nn.parallel import load_llama_for_rank
from mstar_orpheus.graph import build_graph
from mstar_orpheus.preset import ensure_preset
from mstar_orpheus.prompt import EXAMPLE, VOICES, OrpheusVocab, PromptBuilder
from mstar_orpheus.snac import load_snac
from mstar_orpheus.snac.checkpoint import SNACConfig
from mstar_orpheus.snac.model import SNACDecoder
from mstar_orpheus.snac_node import SNACWindowDecoder

SNAC_ENV = "MSTAR_ORPHEUS_SNAC"


def snac_directory(checkpoint: Path, part: str | None = None) -> Path:
    """SNAC is the `snac` part's checkpoint when one is given (the deploy file's `checkpoint: {snac: ...}`), else
    in `<checkpoint>/snac/`, or wherever `$MSTAR_ORPHEUS_SNAC` points."""
    if part is not None:
        return Path(part)
    if (checkpoint / "snac" / "config.json").is_file():
        return checkpoint / "snac"
    if os.environ.get(SNAC_ENV):
        return Path(os.environ[SNAC_ENV])
    raise ConfigError(
        f"no SNAC codec for {checkpoint}: put hubertsiuzdak/snac_24khz (config.json + pytorch_model.bin) "
        f"in {checkpoint / 'snac'} or set {SNAC_ENV} to its directory"
    )


def _snac(directory: Path, device: str) -> torch.nn.Module:
    """The SNAC decoder, in fp32 (the codec always runs in fp32); on the meta device, built without reading it."""
    if device != "meta":
        return load_snac(directory, device=device)
    with on_meta():
        return SNACDecoder(SNACConfig.from_file(directory / "config.json")).fold_weight_norm().eval()


def load_orpheus(
    options: LoadOptions, *, lm_engine: str = "kvcache", snac_engine: str = "stateless", progress: bool = True
) -> LoadedModel:
    """Load Orpheus from `options.checkpoint` (HF Llama dir + `snac/`) or the `tiny` preset."""
    preset = options.preset_or_checkpoint("orpheus", ("tiny",))
    if preset is None:
        directory, random_weights = Path(options.checkpoint), False
    else:
        directory, random_weights = ensure_preset(preset), True
    # a worker loads only the weights of the nodes it hosts; the others stay on the meta device.
    # A Llama: with a rank group, this rank's heads, columns and vocabulary rows, read from the checkpoint's slices
    lm = load_llama_for_rank(directory, options.tensor_parallel, dtype=options.torch_dtype("orpheus", None),
                             device=options.device_for("lm"), module="node 'lm' (orpheus)", progress=progress)
    tokenizer = load_tokenizer(directory)
    snac = _snac(snac_directory(directory, options.part("snac")), options.device_for("snac"))
    vocab = OrpheusVocab.from_tokenizer(tokenizer, snac.config.codebook_size)
    if vocab.audio.end > lm.config.vocab_size:
        raise ConfigError(
            f"orpheus: audio tokens need ids up to {vocab.audio.end - 1}, but the LM vocab_size is "
            f"{lm.config.vocab_size}; the SNAC codebook_size ({snac.config.codebook_size}) does not fit this LM"
        )
    graph = build_graph(lm, SNACWindowDecoder(snac, vocab.audio), vocab.audio, lm_engine=lm_engine, snac_engine=snac_engine)
    return LoadedModel(
        name="orpheus",
        graph=graph,
        random_weights=random_weights,
        prepare=(prompt := PromptBuilder(tokenizer, vocab, vocab_size=lm.config.vocab_size)),
        request_schema=prompt.schema,
        engine_settings={"snac": {"max_batch_size": 64, "own_thread": True}},
        extras={
            "sample_rate": snac.config.sampling_rate,
            "voices": list(VOICES),
            "tokenizer": tokenizer,
            "vocab": vocab,
            "checkpoint": str(directory),
        },
    )


def _load(options: LoadOptions) -> LoadedModel:
    return load_orpheus(options)


SPEC = ModelSpec(
    name="orpheus",
    load=_load,
    presets=("tiny",),
    parts=("snac",),
    example=EXAMPLE,
    description="Orpheus TTS: Llama LM streaming SNAC audio tokens, decoded to 24 kHz speech while generating",
)
