"""The three component configs of a Wan2.2 checkpoint in diffusers layout, read strictly (an unknown key names itself).

    model_index.json            which pipeline and components (checked: a WanPipeline with no transformer_2)
    transformer/config.json     WanTransformer3DModel
    vae/config.json             AutoencoderKLWan (the Wan2.2 residual variant)
    text_encoder/config.json    UMT5EncoderModel (transformers)
    scheduler/scheduler_config.json  UniPCMultistepScheduler (flow sigmas; its `flow_shift` is the default shift)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.strict import reject_unknown

#: Bookkeeping keys diffusers / transformers write into every config.
_META = ("_class_name", "_diffusers_version", "_name_or_path", "architectures", "transformers_version", "model_type",
         "torch_dtype", "dtype")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"wan: {path} is missing; a Wan2.2 diffusers checkpoint has transformer/, vae/, "
                          "text_encoder/, tokenizer/, scheduler/ and model_index.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"wan: {path} is not valid JSON: {exc}") from None


def _build(cls: type, data: dict[str, Any], where: str, ignored: tuple[str, ...] = ()) -> Any:
    known = [f.name for f in attrs.fields(cls)]
    reject_unknown(data, (*known, *_META, *ignored), where)
    return cls(**{k: v for k, v in data.items() if k in known})


@attrs.frozen(kw_only=True)
class TransformerConfig:
    patch_size: tuple[int, int, int] = attrs.field(default=(1, 2, 2), converter=tuple)
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    in_channels: int = 48
    out_channels: int = 48
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 14336
    num_layers: int = 30
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.qk_norm != "rms_norm_across_heads" or not self.cross_attn_norm:
            raise ConfigError("wan: transformer/config.json: only qk_norm 'rms_norm_across_heads' with cross_attn_norm "
                              f"true is supported (Wan2.2), got qk_norm={self.qk_norm!r}, cross_attn_norm={self.cross_attn_norm}")
        if self.image_dim is not None or self.added_kv_proj_dim is not None:
            raise ConfigError("wan: transformer/config.json: image_dim / added_kv_proj_dim (Wan2.1's CLIP image branch) "
                              "are not supported; Wan2.2 TI2V conditions on the first latent frame instead")

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


@attrs.frozen(kw_only=True)
class VAEConfig:
    base_dim: int = 160
    decoder_base_dim: int | None = None
    z_dim: int = 48
    dim_mult: tuple[int, ...] = attrs.field(default=(1, 2, 4, 4), converter=tuple)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = attrs.field(default=(), converter=tuple)
    temperal_downsample: tuple[bool, ...] = attrs.field(default=(False, True, True), converter=tuple)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = attrs.field(default=(0.0,) * 48, converter=tuple)
    latents_std: tuple[float, ...] = attrs.field(default=(1.0,) * 48, converter=tuple)
    is_residual: bool = True
    in_channels: int = 12
    out_channels: int = 12
    patch_size: int | None = 2
    scale_factor_temporal: int = 4
    scale_factor_spatial: int = 16
    clip_output: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.is_residual or self.attn_scales:
            raise ConfigError("wan: vae/config.json: only the Wan2.2 VAE (is_residual true, no attn_scales) is supported")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ConfigError(f"wan: vae/config.json: latents_mean and latents_std need z_dim={self.z_dim} values")

    @property
    def decoder_dim(self) -> int:
        return self.decoder_base_dim or self.base_dim


@attrs.frozen(kw_only=True)
class TextEncoderConfig:
    """UMT5's encoder: relative-position-bias attention in every layer, gated-GELU FFN, RMS norms."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    def __attrs_post_init__(self) -> None:
        if self.feed_forward_proj != "gated-gelu":
            raise ConfigError(f"wan: text_encoder/config.json: feed_forward_proj must be 'gated-gelu' (UMT5), "
                              f"got {self.feed_forward_proj!r}")


#: Decoder-side and training keys of a T5/UMT5 config that the encoder does not read.
_T5_UNUSED = ("num_decoder_layers", "dropout_rate", "initializer_factor", "is_encoder_decoder", "use_cache",
              "pad_token_id", "eos_token_id", "decoder_start_token_id", "tie_word_embeddings", "dense_act_fn",
              "is_gated_act", "scalable_attention", "tokenizer_class", "classifier_dropout", "output_past",
              "bos_token_id", "gradient_checkpointing", "n_positions", "is_decoder", "return_dict",
              "output_hidden_states", "output_attentions", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
              "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "layer_norm_eps",
              "task_specific_params", "initializer_range", "torchscript")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    flow_shift: float = 5.0
    num_train_timesteps: int = 1000


@attrs.frozen
class WanConfig:
    transformer: TransformerConfig
    vae: VAEConfig
    text_encoder: TextEncoderConfig
    scheduler: SchedulerConfig

    @classmethod
    def from_dir(cls, directory: str | Path) -> WanConfig:
        d = Path(directory)
        index = read_json(d / "model_index.json")
        if index.get("transformer_2") not in (None, [None, None]) or index.get("boundary_ratio") is not None:
            raise ConfigError(f"wan: {d}/model_index.json has transformer_2 / boundary_ratio (the two-expert A14B "
                              "models); this package serves the single-transformer TI2V-5B layout")
        tr = _build(TransformerConfig, read_json(d / "transformer" / "config.json"), "wan: transformer/config.json")
        vae = _build(VAEConfig, read_json(d / "vae" / "config.json"), "wan: vae/config.json")
        text = _build(TextEncoderConfig, read_json(d / "text_encoder" / "config.json"), "wan: text_encoder/config.json",
                      ignored=_T5_UNUSED)
        raw = read_json(d / "scheduler" / "scheduler_config.json")
        if raw.get("use_flow_sigmas") is False or raw.get("prediction_type", "flow_prediction") != "flow_prediction":
            raise ConfigError("wan: scheduler/scheduler_config.json must be a flow-prediction UniPC scheduler "
                              "(use_flow_sigmas true, prediction_type flow_prediction)")
        sched = SchedulerConfig(flow_shift=float(raw.get("flow_shift", 5.0)),
                                num_train_timesteps=int(raw.get("num_train_timesteps", 1000)))
        if tr.in_channels != vae.z_dim or tr.text_dim != text.d_model:
            raise ConfigError(f"wan: the transformer takes in_channels={tr.in_channels}, text_dim={tr.text_dim}; the VAE "
                              f"has z_dim={vae.z_dim} and the text encoder d_model={text.d_model}")
        return cls(tr, vae, text, sched)
