"""Loading a BAGEL checkpoint directory, and the `tiny` preset written in the same layout.

A directory holds `ema.safetensors` (every non-VAE weight: `language_model.*` with its `_moe_gen` twins,
`vit_model.vision_model.*`, `connector.*`, `vit_pos_embed.*`, `vae2llm.*`, `llm2vae.*`, `time_embedder.*`,
`latent_pos_embed.*`), `ae.safetensors` (FLUX's autoencoder), `config.json`, `llm_config.json`,
`vit_config.json` and the Qwen2 `tokenizer.json`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mstar_bagel.config import BagelConfig
from mstar_bagel.modeling import Bagel
from mstar_bagel.tokenizer import BOS, EOS, tiny_tokenizer
from mstar_core.checkpoint import RuleMapping, build_and_load, open_checkpoint
from mstar_core.checkpoint.presets import ensure_preset
from mstar_core.errors import ConfigError
from mstar_core.nn.flux_vae import FluxAutoEncoder
from mstar_core.nn.siglip_navit import conv_to_linear

PRESET_VERSION = 4  # 4: text replies end by themselves (`end_text_by_itself`)
EMA, AE = "ema.safetensors", "ae.safetensors"

TINY_LLM = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "hidden_act": "silu", "qk_norm": True,
            "tie_word_embeddings": False, "layer_module": "Qwen2MoTDecoderLayer"}
TINY_VIT = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 2, "image_size": 112, "patch_size": 14, "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh"}
#: BAGEL's own grid (a FLUX VAE downsampling 8x, 2x2 latent patches, 64 patches a side): the tiny preset draws
#: what the published model does, OpenAI's 256x256, 512x512 and 1024x1024 included, with few channels; without a
#: size it draws 256x256 (seconds on a CPU; a checkpoint's default is 1024x1024)
TINY_TOP = {"latent_patch_size": 2, "max_latent_size": 64, "vit_max_num_patch_per_side": 8,
            "connector_act": "gelu_pytorch_tanh", "mstar_timestep_shift": 3.0, "mstar_num_timesteps": 4,
            "mstar_default_image_size": 256, "mstar_vae": {"ch": 8, "ch_mult": [1, 2, 2, 2], "num_res_blocks": 1, "z_channels": 4, "norm_groups": 8}}


def ema_mapping(cfg: BagelConfig, skip: tuple[str, ...] = ()) -> RuleMapping:
    """Checkpoint names are the module's; the ViT's dropped last layer and a conv patch embedding are handled.

    `skip`: more name patterns left unread (a tensor-parallel rank reads the LLM's slices on its own).
    """
    dropped = cfg.vit.num_hidden_layers  # index of the layer BAGEL never builds
    return RuleMapping(
        skip=[rf"^vit_model\.vision_model\.encoder\.layers\.{dropped}\.", r"^vit_model\.vision_model\.head\.",
              r"\.rotary_emb\.inv_freq$", *skip],
        transform={r"vit_model\.vision_model\.embeddings\.patch_embedding\.weight$": lambda _n, t: conv_to_linear(t)},
    )


def _file(directory: Path, name: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise ConfigError(f"bagel: {path} is missing; a BAGEL checkpoint holds {EMA} and {AE}")
    return path


def load_bagel(directory: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None,
               progress: bool = True) -> tuple[Bagel, FluxAutoEncoder]:
    d = Path(directory)
    cfg = BagelConfig.from_dir(d, table_sides(_file(d, EMA)))
    bagel = build_and_load(lambda: Bagel(cfg), open_checkpoint(_file(d, EMA)), ema_mapping(cfg), dtype=dtype,
                           device=device, progress=progress)
    # the VAE stays float32: its decode is cheap next to the LLM and bf16 convolutions band the image
    vae = build_and_load(lambda: FluxAutoEncoder(cfg.vae), open_checkpoint(_file(d, AE)), RuleMapping(),
                         dtype=torch.float32, device=device, progress=progress)
    return bagel, vae


def table_sides(path: Path) -> dict[str, int]:
    """The sin-cos tables' grid sides as the checkpoint stores them (`max_latent_size`, `vit_max_num_patch_per_side`)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for key, name in (("max_latent_size", "latent_pos_embed.pos_embed"),
                          ("vit_max_num_patch_per_side", "vit_pos_embed.pos_embed")):
            if name in names:
                rows = f.get_slice(name).get_shape()[0]
                side = round(math.sqrt(rows))
                if side * side != rows:
                    raise ConfigError(f"bagel: {path} tensor {name} has {rows} rows, not a square grid")
                out[key] = side
    return out


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Seeded weights: normal(0, 0.1) matrices and biases, norm scales near 1; sin-cos tables stay exact."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("pos_embed"):
                continue
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))


#: The residual channel that carries "the text may end" (see `end_text_by_itself`).
END_CHANNEL = 0
#: Every token's embedding holds END_LEVEL there (the embedding's own scale); <|im_end|>'s LM-head row reads it
#: with END_WEIGHT, which puts its logit near the top of the others: a greedy reply (BAGEL's default) ends after
#: one token, a sampled one (temperature 1) after 2 to 26.
END_LEVEL = 0.1
END_WEIGHT = 40.0


def end_text_by_itself(bagel: Bagel) -> None:
    """Random weights make <|im_end|> one token among a thousand, so text replies (understanding, thinking) ran to
    `max_tokens`. As the tiny Qwen3-Omni and Llama presets do: a constant channel of the residual stream that no
    layer of either expert reads or writes (zero columns of the q/k/v and gate/up projections, zero rows of the
    output projections), held at END_LEVEL by every token's embedding and at -END_LEVEL by <|im_start|> (which
    opens a reply, so a reply has a first token); only <|im_end|>'s row of the LM head reads it."""
    lm, tok = bagel.language_model, tiny_tokenizer()
    with torch.no_grad():
        lm.model.embed_tokens.weight[:, END_CHANNEL] = END_LEVEL
        lm.model.embed_tokens.weight[tok.token_to_id(BOS), END_CHANNEL] = -END_LEVEL
        for name, p in lm.model.layers.named_parameters():
            if name.endswith(("qkv_proj.weight", "qkv_proj_moe_gen.weight", "gate_up_proj.weight")):
                p[:, END_CHANNEL] = 0.0
            elif name.endswith(("o_proj.weight", "o_proj_moe_gen.weight", "down_proj.weight")):
                p[END_CHANNEL] = 0.0
        head = lm.lm_head.weight
        head[:, END_CHANNEL] = 0.0
        head[tok.token_to_id(EOS)] = 0.0
        head[tok.token_to_id(EOS), END_CHANNEL] = END_WEIGHT


def write_tiny(directory: Path, seed: int = 0) -> Path:
    return write_preset(directory, TINY_TOP, TINY_LLM, TINY_VIT, seed, end_text=True)


def write_preset(directory: Path, top: dict, llm: dict, vit: dict, seed: int = 0, end_text: bool = False) -> Path:
    """Seeded random weights of the given sizes, written in the published layout (presets, benchmarks); with
    `end_text`, text replies end by themselves (`end_text_by_itself`)."""
    directory = Path(directory)
    cfg = BagelConfig.from_dicts(top, llm, vit)
    generator = torch.Generator().manual_seed(seed)
    bagel, vae = Bagel(cfg), FluxAutoEncoder(cfg.vae)
    _randomize(bagel, generator)
    _randomize(vae, generator)
    if end_text:
        end_text_by_itself(bagel)
    for module, name in ((bagel, EMA), (vae, AE)):
        state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
        save_file(state, str(directory / name), metadata={"format": "pt"})
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    for name, content in (("llm_config.json", llm), ("vit_config.json", vit), ("config.json", top)):
        (directory / name).write_text(json.dumps(content, indent=2))
    return directory


def ensure_tiny() -> Path:
    return ensure_preset(f"bagel-tiny-v{PRESET_VERSION}", "config.json", write_tiny)
