"""Loading a Wan2.2 checkpoint in diffusers layout, and the `tiny` preset written in the same layout.

    model_index.json
    transformer/   config.json, diffusion_pytorch_model.safetensors (or shards + .index.json)
    vae/           config.json, diffusion_pytorch_model.safetensors
    text_encoder/  config.json, model.safetensors (or shards + model.safetensors.index.json)   (UMT5EncoderModel)
    tokenizer/     tokenizer.json (+ the slow tokenizer's files, unread)
    scheduler/     scheduler_config.json

The tiny preset is diffusers' own fast-test config (`Wan225BPipelineFastTests`) with a tiny UMT5 in place
of the Hub's tiny T5, and a byte-level tokenizer; `diffusers.WanPipeline.from_pretrained` loads it too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mstar_core.checkpoint import RuleMapping, build_and_load, open_checkpoint
from mstar_core.checkpoint.presets import ensure_preset
from mstar_core.checkpoint.sources import SafetensorsSource
from mstar_core.errors import ConfigError
from mstar_wan.config import WanConfig
from mstar_wan.text_encoder import UMT5Encoder
from mstar_wan.tokenizer import tiny_tokenizer
from mstar_wan.transformer import WanTransformer
from mstar_wan.vae import WanVAE

PRESET_VERSION = 1
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"

TINY_TRANSFORMER = {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 2,
                    "attention_head_dim": 12, "in_channels": 48, "out_channels": 48, "text_dim": 32, "freq_dim": 256,
                    "ffn_dim": 32, "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                    "eps": 1e-6, "rope_max_seq_len": 32}
TINY_VAE = {"_class_name": "AutoencoderKLWan", "base_dim": 3, "z_dim": 48, "in_channels": 12, "out_channels": 12,
            "is_residual": True, "patch_size": 2, "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48,
            "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
            "temperal_downsample": [False, True, True]}
TINY_TEXT = {"architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 272, "d_model": 32, "d_kv": 8,
             "d_ff": 37, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
             "relative_attention_max_distance": 32, "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6,
             "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0, "tie_word_embeddings": False,
             "dense_act_fn": "gelu_new", "is_gated_act": True}
TINY_SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
                  "use_flow_sigmas": True, "num_train_timesteps": 1000, "flow_shift": 3.0}
#: What M* reads besides the diffusers files (absent from a published checkpoint: the defaults in `model.py`).
TINY_SERVING = {"max_sequence_length": 16, "height": 32, "width": 32, "num_frames": 9, "num_steps": 2,
                "guidance_scale": 6.0, "fps": 8, "size_scale": 0.05, "decode_chunk_frames": 2}
SERVING_FILE = "mstar_wan.json"


def _weights(directory: Path, stem: str):
    """A component's safetensors: one file or shards named by `{stem}.safetensors.index.json`."""
    single, index = directory / f"{stem}.safetensors", directory / f"{stem}.safetensors.index.json"
    if single.is_file():
        return SafetensorsSource(single)
    if index.is_file():
        return _ShardedSource(index)
    if stem == "model":
        return open_checkpoint(directory)
    raise ConfigError(f"wan: {directory} has neither {single.name} nor {index.name}")


class _ShardedSource(SafetensorsSource):
    """Shards named by a diffusers index (`diffusion_pytorch_model.safetensors.index.json`)."""

    def __init__(self, index: Path):
        shards: dict[Path, list[str]] = {}
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            shards.setdefault(index.parent / shard, []).append(name)
        self.where, self.shards = str(index.parent), shards
        self._count = sum(len(n) for n in shards.values())


#: Kept in float32 whatever the weights' dtype, as the references keep them (diffusers' and transformers'
#: `_keep_in_fp32_modules`): the timestep embedding, the modulation tables and norms, UMT5's FFN output.
DIT_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
TEXT_FP32 = ("wo",)


def _declared(module: torch.nn.Module, dtype: torch.dtype | None, keep: tuple[str, ...]) -> torch.nn.Module:
    """The module's parameters in `dtype`, except those under a name in `keep` (float32); free on meta."""
    if dtype is None:
        return module
    for name, param in module.named_parameters():
        if not any(part in keep for part in name.split(".")):
            param.data = param.data.to(dtype)
    return module


def load_wan(directory: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None, progress: bool = True
             ) -> tuple[WanConfig, WanTransformer, WanVAE, UMT5Encoder]:
    d = Path(directory)
    cfg = WanConfig.from_dir(d)
    # each tensor loads in the dtype its module declares (dtype=None below): `dtype` but for the float32 ones
    dit = build_and_load(lambda: _declared(WanTransformer(cfg.transformer), dtype, DIT_FP32),
                         _weights(d / "transformer", "diffusion_pytorch_model"), RuleMapping(skip=[r"norm_added_q"]),
                         device=device, progress=progress)
    # the VAE stays float32, as the reference runs it: bf16 causal convs band the video
    vae = build_and_load(lambda: WanVAE(cfg.vae), _weights(d / "vae", "diffusion_pytorch_model"), RuleMapping(),
                         dtype=torch.float32, device=device, progress=progress)
    # transformers saves the tied `encoder.embed_tokens` beside `shared`; the encoder reads `shared`
    text = build_and_load(lambda: _declared(UMT5Encoder(cfg.text_encoder), dtype, TEXT_FP32),
                          _weights(d / "text_encoder", "model"),
                          RuleMapping(skip=[r"^encoder\.embed_tokens\.weight$", r"^lm_head\."]),
                          device=device, progress=progress)
    return cfg, dit, vae, text


def serving_defaults(directory: str | Path) -> dict:
    path = Path(directory) / SERVING_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _randomize(module: torch.nn.Module, generator: torch.Generator, scale: float = 0.1) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "layer_norm.weight", "gamma")) or ".norm2." in name:
                p.copy_(1.0 + scale * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=generator))


def write_preset(directory: Path, transformer: dict, vae: dict, text: dict, scheduler: dict, serving: dict,
                 seed: int = 0) -> Path:
    """Seeded random weights of the given sizes in the diffusers layout (presets, tests, benchmarks)."""
    directory = Path(directory)
    generator = torch.Generator().manual_seed(seed)
    files = {"transformer": transformer, "vae": vae, "text_encoder": text}
    for sub, content in files.items():
        (directory / sub).mkdir(parents=True, exist_ok=True)
        (directory / sub / "config.json").write_text(json.dumps(content, indent=2))
    (directory / "scheduler").mkdir(exist_ok=True)
    (directory / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2))
    (directory / "tokenizer").mkdir(exist_ok=True)
    tiny_tokenizer().save(str(directory / "tokenizer" / "tokenizer.json"))
    (directory / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
         "model_max_length": 512}))
    (directory / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": "0.35.0", "boundary_ratio": None, "expand_timesteps": True,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None], "vae": ["diffusers", "AutoencoderKLWan"]}, indent=2))
    cfg = WanConfig.from_dir(directory)
    modules = {"transformer": WanTransformer(cfg.transformer), "vae": WanVAE(cfg.vae),
               "text_encoder": UMT5Encoder(cfg.text_encoder)}
    for sub, module in modules.items():
        _randomize(module, generator)
        state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
        name = "model.safetensors" if sub == "text_encoder" else DIFFUSERS_WEIGHTS
        save_file(state, str(directory / sub / name), metadata={"format": "pt"})
    (directory / SERVING_FILE).write_text(json.dumps(serving, indent=2))
    return directory


def write_tiny(directory: Path, seed: int = 0) -> Path:
    return write_preset(directory, TINY_TRANSFORMER, TINY_VAE, TINY_TEXT, TINY_SCHEDULER, TINY_SERVING, seed)


def ensure_tiny() -> Path:
    return ensure_preset(f"wan-tiny-v{PRESET_VERSION}", SERVING_FILE, write_tiny)
