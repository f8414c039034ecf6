"""`OmniConfig`: a Qwen3-Omni `config.json` (thinker, talker, code2wav) read into the sizes M* builds.

Defaults are the published Qwen3-Omni-30B-A3B values. Each section keeps only the keys it uses and checks
their types (`mstar_core.config.hf`), naming the offending key (`thinker_config.text_config.num_experts`). RoPE settings are read
from either layout: `rope_theta` + `rope_scaling` (the published JSON) or `rope_parameters` (transformers v5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.config.hf import read_fields, rope_settings, section
from mstar_core.errors import ConfigError
from mstar_core.nn.codec_vocoder import CodecDecoderConfig
from mstar_core.nn.qwen3_talker import Qwen3TalkerConfig, Qwen3TextConfig

SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The Thinker's text model and the Talker's decoder: a Qwen3-MoE stack, the config TTS's dense Talker shares
TextConfig = Qwen3TextConfig
# its published sizes (the Thinker's), read where a key is absent; the Talker reads the same
TEXT_DEFAULTS = {"vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 65536}


@attrs.frozen(kw_only=True)
class AudioConfig:
    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    activation_function: str = "gelu"
    max_source_positions: int = 1500
    n_window: int = 50
    n_window_infer: int = 800
    output_dim: int = 2048
    downsample_hidden_size: int = 480


@attrs.frozen(kw_only=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0


@attrs.frozen(kw_only=True)
class ThinkerConfig:
    text: TextConfig
    audio: AudioConfig
    vision: VisionConfig
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    position_id_per_seconds: int = 13

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | None) -> ThinkerConfig:
        cfg = section(cfg, "thinker_config")
        text = Qwen3TextConfig.from_hf(cfg.get("text_config"), "thinker_config.text_config", default_theta=1000000.0,
                                       defaults=TEXT_DEFAULTS, shared_expert_intermediate_size=0)
        audio = read_fields(AudioConfig, cfg.get("audio_config"), "thinker_config.audio_config")
        vcfg = section(cfg.get("vision_config"), "thinker_config.vision_config")
        vision = read_fields(VisionConfig, vcfg, "thinker_config.vision_config",
                             rope_theta=rope_settings(vcfg, "thinker_config.vision_config", 10000.0,
                                                      ("default", "axial"))["rope_theta"])
        return read_fields(cls, cfg, "thinker_config", text=text, audio=audio, vision=vision)


@attrs.frozen(kw_only=True)
class TalkerConfig(Qwen3TalkerConfig):
    """Omni's `talker_config`: the shared Talker keys plus the Thinker layer it listens to and its voices."""

    thinker_hidden_size: int = 2048
    accept_hidden_layer: int = 24
    speaker_id: dict = attrs.field(factory=lambda: dict(SPEAKERS))

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | None) -> TalkerConfig:
        cfg = section(cfg, "talker_config")
        # MoE with a shared expert; unlike the Thinker's, its router weights are not renormalized by default
        text = Qwen3TextConfig.from_hf(cfg.get("text_config"), "talker_config.text_config", default_theta=10000.0,
                                       defaults={**TEXT_DEFAULTS, "norm_topk_prob": False})
        speakers = cfg.get("speaker_id") or dict(SPEAKERS)
        if not isinstance(speakers, Mapping) or not all(_is_int(v) for v in speakers.values()):
            raise ConfigError("config.json: 'talker_config.speaker_id' must map voice names to codec ids")
        return cls.read(cfg, "talker_config", text, speaker_id={str(k).lower(): v for k, v in speakers.items()})

    def codec_ids(self) -> dict[str, Any]:
        return {**super().codec_ids(), **{f"speaker_id.{k}": v for k, v in self.speaker_id.items()}}


@attrs.frozen(kw_only=True)
class Code2WavConfig(CodecDecoderConfig):
    """`code2wav_config`: the shared codec sizes at Omni's widths; `head_dim` is derived (the key is not read)."""

    hidden_size: int = 1024
    intermediate_size: int = 3072
    max_position_embeddings: int = 8000

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@attrs.frozen(kw_only=True)
class OmniConfig:
    thinker: ThinkerConfig
    talker: TalkerConfig
    code2wav: Code2WavConfig
    enable_audio_output: bool = True
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    system_token_id: int = 8948
    user_token_id: int = 872
    assistant_token_id: int = 77091
    raw: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> OmniConfig:
        if not isinstance(cfg, Mapping):
            raise ConfigError("config.json must hold an object")
        thinker = ThinkerConfig.from_hf(cfg.get("thinker_config"))
        talker = TalkerConfig.from_hf(cfg.get("talker_config"))
        c2w = section(cfg.get("code2wav_config"), "code2wav_config")
        code2wav = read_fields(Code2WavConfig, c2w, "code2wav_config",
                               rope_theta=rope_settings(c2w, "code2wav_config", 10000.0)["rope_theta"])
        omni = read_fields(cls, cfg, thinker=thinker, talker=talker, code2wav=code2wav, raw=dict(cfg))
        if talker.accept_hidden_layer > thinker.text.num_hidden_layers:
            raise ConfigError(f"config.json: 'talker_config.accept_hidden_layer' ({talker.accept_hidden_layer}) must "
                              f"be at most the thinker's {thinker.text.num_hidden_layers} layers")
        if talker.thinker_hidden_size != thinker.text.hidden_size:
            raise ConfigError("config.json: 'talker_config.thinker_hidden_size' must equal the thinker's hidden_size")
        if code2wav.num_quantizers != talker.num_code_groups:
            raise ConfigError("config.json: 'code2wav_config.num_quantizers' must equal talker num_code_groups")
        return omni
