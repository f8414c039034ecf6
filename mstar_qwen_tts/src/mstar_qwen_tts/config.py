"""`TTSConfig`: a Qwen3-TTS `config.json` (+ `speech_tokenizer/config.json`) read into the sizes M* builds.

Defaults are the published 12 Hz 0.6B values. Each section keeps the keys it uses and checks their types,
naming the offending key (`talker_config.code_predictor_config.num_code_groups`). The Talker's section is flat
(its decoder sizes sit beside the codec ids); `head_dim` and `text_vocab_size` are read although the upstream
config class does not declare them. RoPE: `rope_theta` + `rope_scaling` or `rope_parameters`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from mstar_core.config.hf import check, config_field, head_dim_from_heads, read_fields, section
from mstar_core.errors import ConfigError
from mstar_core.nn.codec_vocoder import CodecDecoderConfig
from mstar_core.nn.qwen3_talker import Qwen3TalkerConfig, Qwen3TextConfig

MODEL_TYPES = ("custom_voice", "voice_design", "base")


def _ids(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"config.json: '{key}' must be an object")
    return {str(k).lower(): v for k, v in value.items()}


# The Talker's decoder: a dense Qwen3 stack (no experts) with the published 0.6B sizes for absent keys
TALKER_TEXT_DEFAULTS = {"vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                        "num_experts_per_tok": 0, "moe_intermediate_size": 0, "norm_topk_prob": False}


@attrs.frozen(kw_only=True)
class TalkerConfig(Qwen3TalkerConfig):
    """TTS's `talker_config`: flat (the decoder's sizes beside the codec ids), with the Talker's own text table
    (`text_vocab_size` / `text_hidden_size`), a think id Omni's Talker lacks, and speakers, their dialects and
    the languages as codec ids."""

    CODEC_ID_KEYS: ClassVar[tuple[str, ...]] = (*Qwen3TalkerConfig.CODEC_ID_KEYS, "codec_think_id")

    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    codec_think_id: int = 2154
    spk_id: dict = attrs.field(factory=dict)
    spk_is_dialect: dict = attrs.field(factory=dict)
    codec_language_id: dict = attrs.field(factory=dict)

    @classmethod
    def from_hf(cls, cfg: Any) -> TalkerConfig:
        where = "talker_config"
        cfg = section(cfg, where)
        # dense whatever the section says: the checkpoint has no expert weights
        text = Qwen3TextConfig.from_hf(cfg, where, default_theta=10000.0, defaults=TALKER_TEXT_DEFAULTS,
                                       num_experts=0, shared_expert_intermediate_size=0)
        talker = cls.read(cfg, where, text,
                          spk_id=_ids(cfg.get("spk_id"), f"{where}.spk_id"),
                          spk_is_dialect=_ids(cfg.get("spk_is_dialect"), f"{where}.spk_is_dialect"),
                          codec_language_id=_ids(cfg.get("codec_language_id"), f"{where}.codec_language_id"))
        talker.check_speakers()
        return talker

    def codec_ids(self) -> dict[str, Any]:
        return {**super().codec_ids(), **{f"spk_id.{k}": v for k, v in self.spk_id.items()},
                **{f"codec_language_id.{k}": v for k, v in self.codec_language_id.items()}}

    def check_speakers(self) -> None:
        missing = [s for s in self.spk_id if s not in self.spk_is_dialect]
        if missing:
            raise ConfigError(f"config.json: 'talker_config.spk_is_dialect' needs an entry for every speaker; "
                              f"missing {missing}")
        for speaker, dialect in self.spk_is_dialect.items():
            if dialect is not False and dialect not in self.codec_language_id:
                raise ConfigError(f"config.json: 'talker_config.spk_is_dialect.{speaker}' names {dialect!r}, which "
                                  f"is not in codec_language_id")


@attrs.frozen(kw_only=True)
class TTSConfig:
    talker: TalkerConfig
    tts_model_type: str = "custom_voice"
    tts_model_size: str = "0b6"
    tokenizer_type: str = "qwen3_tts_tokenizer_12hz"
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    speaker_encoder: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def keeps_instruct(self) -> bool:
        """The 0.6B checkpoints drop the instruct turn (the upstream rule)."""
        return self.tts_model_size != "0b6"

    @classmethod
    def from_hf(cls, cfg: Any) -> TTSConfig:
        if not isinstance(cfg, Mapping):
            raise ConfigError("config.json must hold an object")
        talker = TalkerConfig.from_hf(cfg.get("talker_config"))
        out = read_fields(cls, cfg, talker=talker,
                          speaker_encoder=dict(section(cfg.get("speaker_encoder_config"), "speaker_encoder_config")))
        if out.tts_model_type not in MODEL_TYPES:
            raise ConfigError(f"config.json: 'tts_model_type' must be one of {list(MODEL_TYPES)}, "
                              f"got {out.tts_model_type!r}")
        if out.tokenizer_type != "qwen3_tts_tokenizer_12hz":
            raise ConfigError(f"config.json: 'tokenizer_type' {out.tokenizer_type!r} is not supported (here: the "
                              f"12 Hz tokenizer, 'qwen3_tts_tokenizer_12hz')")
        text_vocab = talker.text_vocab_size
        bad = [k for k in ("im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id",
                           "tts_eos_token_id") if not 0 <= getattr(out, k) < text_vocab]
        if bad:
            raise ConfigError(f"config.json: {bad} must be below talker_config.text_vocab_size ({text_vocab})")
        return out


@attrs.frozen(kw_only=True)
class SpeechDecoderConfig(CodecDecoderConfig):
    """`speech_tokenizer/config.json` `decoder_config`: the shared codec sizes at the tokenizer's widths, plus the
    split RVQ's `codebook_dim` and the transformer's projection to and from `latent_dim` (Omni's has neither)."""

    codebook_dim: int = 512
    hidden_size: int = 512
    latent_dim: int = 1024
    head_dim: int = 64
    intermediate_size: int = 1024

    @classmethod
    def from_hf(cls, cfg: Any) -> SpeechDecoderConfig:
        file = "speech_tokenizer/config.json"
        top = section(cfg, "", file=file)
        where = "decoder_config"
        dec = section(top.get(where), where, file=file)
        out = read_fields(cls, dec, where, file=file, defaults={"head_dim": head_dim_from_heads},
                          rope_theta=check(dec.get("rope_theta", 10000.0), float, f"{where}.rope_theta", file=file))
        rate = top.get("decode_upsample_rate")
        if rate is not None and rate != out.samples_per_frame:
            raise ConfigError(f"{file}: 'decode_upsample_rate' ({rate}) must equal the product of "
                              f"decoder_config.upsample_rates and upsampling_ratios ({out.samples_per_frame})")
        if out.codebook_dim % 2:
            raise ConfigError(f"{file}: 'decoder_config.codebook_dim' must be even (the RVQ works at half of it)")
        return out


@attrs.frozen(kw_only=True)
class SpeechEncoderConfig:
    """`speech_tokenizer/config.json` `encoder_config` (a transformers `MimiConfig`) and the tokenizer's own
    `encoder_valid_num_quantizers` / `encode_downsample_rate`: the sizes `mstar_core.nn.mimi_encoder` builds.
    Defaults are Mimi's (the published tokenizer keeps them, with 32 quantizers of which the first 16 are used)."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = config_field(1, minimum=0)
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = config_field(2, minimum=1)
    use_conv_shortcut: bool = False
    codebook_size: int = 2048
    codebook_dim: int = 256
    vector_quantization_hidden_dimension: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = config_field(1, minimum=1)
    num_hidden_layers: int = 8
    num_attention_heads: int = config_field(8, minimum=1)
    num_key_value_heads: int = config_field(8, minimum=1)
    head_dim: int = 64
    intermediate_size: int = 2048
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    sliding_window: int = config_field(250, minimum=1)
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    rope_theta: float = 10000.0
    frame_rate: float = 12.5
    valid_quantizers: int = 16  # `encoder_valid_num_quantizers`: the codes the Talker speaks
    samples_per_frame: int = 1920  # `encode_downsample_rate`

    @property
    def latent_stride(self) -> int:
        """The last conv's stride: the SEANet's frame rate over the codec's."""
        hop = 1
        for r in self.upsampling_ratios:
            hop *= r
        return round(self.sampling_rate / hop / self.frame_rate)

    @classmethod
    def from_hf(cls, cfg: Any) -> SpeechEncoderConfig:
        file = "speech_tokenizer/config.json"
        top = section(cfg, "", file=file)
        where = "encoder_config"
        enc = section(top.get(where), where, file=file)
        if not enc:
            raise ConfigError(f"{file}: no '{where}': this speech tokenizer has no encoder (cloning with a "
                              f"transcript needs it)")
        rope = enc.get("rope_parameters") or {}
        theta = enc.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, Mapping) else 10000.0)
        out = read_fields(cls, enc, where, file=file, defaults={"head_dim": head_dim_from_heads},
                          rope_theta=check(theta, float, f"{where}.rope_theta", file=file),
                          valid_quantizers=check(top.get("encoder_valid_num_quantizers", 16), int,
                                                 "encoder_valid_num_quantizers", file=file, minimum=1),
                          samples_per_frame=check(top.get("encode_downsample_rate", 1920), int,
                                                  "encode_downsample_rate", file=file, minimum=1))
        if not out.use_causal_conv or out.audio_channels != 1:
            raise ConfigError(f"{file}: '{where}' must be causal and mono (use_causal_conv true, audio_channels 1)")
        if out.pad_mode not in ("constant", "replicate"):
            raise ConfigError(f"{file}: '{where}.pad_mode' must be 'constant' or 'replicate', got {out.pad_mode!r}")
        if not out.num_semantic_quantizers <= out.valid_quantizers <= out.num_quantizers:
            raise ConfigError(f"{file}: 'encoder_valid_num_quantizers' ({out.valid_quantizers}) must be between "
                              f"{where}.num_semantic_quantizers and num_quantizers ({out.num_quantizers})")
        hop = 1
        for r in out.upsampling_ratios:
            hop *= r
        if hop * out.latent_stride != out.samples_per_frame or out.latent_stride < 1:
            raise ConfigError(f"{file}: 'encode_downsample_rate' ({out.samples_per_frame}) must equal the product of "
                              f"{where}.upsampling_ratios ({hop}) times the frame-rate stride (sampling_rate / "
                              f"that product / frame_rate = {out.latent_stride})")
        if out.num_attention_heads % out.num_key_value_heads:
            raise ConfigError(f"{file}: '{where}.num_attention_heads' must be a multiple of num_key_value_heads")
        return out
