"""`ModelSpec` `wan`: a Wan2.2 TI2V diffusers checkpoint directory or the `tiny` preset -> `LoadedModel`."""

from __future__ import annotations

from pathlib import Path

from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_wan.checkpoint import ensure_tiny, load_wan, serving_defaults
from mstar_wan.graph import build_graph
from mstar_wan.prepare import Defaults, Preparer
from mstar_wan.tokenizer import open_tokenizer

PRESETS = ("tiny",)
EXAMPLE = {"prompt": "a red fox running through snow", "num_steps": 2}


def engine_settings() -> dict:
    """Every request's CFG rows share the DiT's forwards; the VAE decodes one request's chunk per call."""
    return {"denoise": {"max_rows": 16}, "vae_decode": {}}


def load(options: LoadOptions) -> LoadedModel:
    preset = options.preset_or_checkpoint("wan", PRESETS)
    directory = Path(ensure_tiny() if preset else options.checkpoint)
    dtype = options.torch_dtype("wan", "float32" if preset else "bfloat16")
    cfg, dit, vae, text = load_wan(directory, device=options.device, dtype=dtype)
    defaults = Defaults.from_mapping(serving_defaults(directory))
    tokenizer = open_tokenizer(directory)
    prepare = Preparer(tokenizer, defaults, cfg.scheduler.flow_shift, cfg.vae.z_dim, cfg.vae.scale_factor_temporal,
                       cfg.vae.scale_factor_spatial)
    graph = build_graph(dit, vae, text, max_sequence_length=defaults.max_sequence_length,
                        shift=cfg.scheduler.flow_shift, num_train_timesteps=cfg.scheduler.num_train_timesteps,
                        decode_chunk_frames=defaults.decode_chunk_frames)
    return LoadedModel(name="wan", graph=graph, random_weights=preset is not None, prepare=prepare,
                       request_schema=prepare.schema, engine_settings=engine_settings(),
                       # (the tokenizer is not under "tokenizer": that key offers a model the chat routes)
                       extras={"config": cfg, "defaults": defaults, "transformer": dit, "vae": vae,
                               "text_encoder": text, "umt5_tokenizer": tokenizer, "checkpoint": str(directory)})


SPEC = ModelSpec(name="wan", load=load, presets=PRESETS, example=EXAMPLE,
                 description="Wan2.2 TI2V: UMT5 + flow-matching DiT (UniPC, CFG rows batched) + causal 3-D VAE decoded "
                             "chunk by chunk; text- and image-to-video")
