"""`OmniConfig`: a Qwen3-Omni `config.json` (thinker, talker, code2wav) read into the sizes M* builds.

Defaults are the published Qwen3-Omni-30B-A3B values. Each section keeps only the keys it uses and checks
their types (`mstar_core.config.hf`), naming the offending key (`thinker_config.text_config.num_experts`). RoPE settings are read
from either layout: `rope_theta` + `rope_scaling` (the published JSON) or `rope_parameters` (transformers v5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.config.hf import check, config_field, read_fields, section
from mstar_core.errors import ConfigError
from mstar_core.nn.code_predictor import CodePredictorConfig

SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


def rope_settings(cfg: Mapping[str, Any], where: str, default_theta: float, kinds: tuple = ("default",)) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` / `rope_parameters` merged into one dict (theta, mrope_section, ...)."""
    params: dict[str, Any] = {"rope_theta": default_theta}
    if cfg.get("rope_theta") is not None:
        params["rope_theta"] = cfg["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        extra = cfg.get(key)
        if extra is None:
            continue
        if not isinstance(extra, Mapping):
            raise ConfigError(f"config.json: '{where}.{key}' must be an object or null")
        params.update(extra)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in kinds:
        raise ConfigError(f"config.json: '{where}' rope_type {kind!r} is not supported (here: {list(kinds)})")
    params["rope_theta"] = check(params["rope_theta"], float, f"{where}.rope_theta", example=default_theta)
    return params


def _head_dim(values: dict[str, Any]) -> int:
    # absent in the published JSON: hidden_size / heads, from the (checked) values read so far
    return values["hidden_size"] // values["num_attention_heads"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen(kw_only=True)
class TextConfig:
    """A Qwen3-MoE decoder: the Thinker's text model, and (with a shared expert) the Talker's."""

    vocab_size: int = 152064
    hidden_size: int = 2048
    intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = config_field(32, minimum=1)  # divides hidden_size: 0 would fail deep in the build
    num_key_value_heads: int = config_field(4, minimum=1)
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = 65536
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, ...] = (24, 20, 20)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | None, where: str, *, shared_expert: bool = False) -> TextConfig:
        cfg = section(cfg, where)
        rope = rope_settings(cfg, where, 10000.0 if shared_expert else 1000000.0)
        defaults: dict[str, Any] = {"head_dim": _head_dim}
        extra = {"rope_theta": rope["rope_theta"],
                 "mrope_section": check(rope.get("mrope_section", (24, 20, 20)), tuple[int, ...],
                                        f"{where}.rope_scaling.mrope_section", example=(24, 20, 20))}
        if not shared_expert:
            extra["shared_expert_intermediate_size"] = 0
        else:
            defaults["norm_topk_prob"] = False  # the Talker's default, unlike the Thinker's
        text = read_fields(cls, cfg, where, defaults=defaults, **extra)
        if sum(text.mrope_section) != text.head_dim // 2:
            raise ConfigError(f"config.json: '{where}' mrope_section {list(text.mrope_section)} must add up to "
                              f"head_dim / 2 = {text.head_dim // 2}")
        if text.num_attention_heads % text.num_key_value_heads:
            raise ConfigError(f"config.json: '{where}.num_attention_heads' must be a multiple of num_key_value_heads")
        return text

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


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
        text = TextConfig.from_hf(cfg.get("text_config"), "thinker_config.text_config")
        audio = read_fields(AudioConfig, cfg.get("audio_config"), "thinker_config.audio_config")
        vcfg = section(cfg.get("vision_config"), "thinker_config.vision_config")
        vision = read_fields(VisionConfig, vcfg, "thinker_config.vision_config",
                             rope_theta=rope_settings(vcfg, "thinker_config.vision_config", 10000.0,
                                                      ("default", "axial"))["rope_theta"])
        return read_fields(cls, cfg, "thinker_config", text=text, audio=audio, vision=vision)


@attrs.frozen(kw_only=True)
class TalkerConfig:
    text: TextConfig
    predictor: CodePredictorConfig
    num_code_groups: int = 16
    thinker_hidden_size: int = 2048
    accept_hidden_layer: int = 24
    codec_eos_token_id: int = 2150
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    # ids at or above this are never sampled as code0 (but EOS); the published rule is vocab_size - 1024
    suppress_from: int = -1
    speaker_id: dict = attrs.field(factory=lambda: dict(SPEAKERS))

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | None) -> TalkerConfig:
        cfg = section(cfg, "talker_config")
        text = TextConfig.from_hf(cfg.get("text_config"), "talker_config.text_config", shared_expert=True)
        pcfg = section(cfg.get("code_predictor_config"), "talker_config.code_predictor_config")
        predictor = read_fields(CodePredictorConfig, pcfg, "talker_config.code_predictor_config",
                                defaults={"head_dim": _head_dim},
                                rope_theta=rope_settings(pcfg, "talker_config.code_predictor_config",
                                                         10000.0)["rope_theta"])
        speakers = cfg.get("speaker_id") or dict(SPEAKERS)
        if not isinstance(speakers, Mapping) or not all(_is_int(v) for v in speakers.values()):
            raise ConfigError("config.json: 'talker_config.speaker_id' must map voice names to codec ids")
        talker = read_fields(cls, cfg, "talker_config", text=text, predictor=predictor,
                             speaker_id={str(k).lower(): v for k, v in speakers.items()})
        if talker.suppress_from < 0:
            talker = attrs.evolve(talker, suppress_from=max(0, text.vocab_size - 1024))
        ids = {k: getattr(talker, k) for k in ("codec_eos_token_id", "codec_nothink_id", "codec_think_bos_id",
                                                "codec_think_eos_id", "codec_pad_id", "codec_bos_id")}
        ids.update({f"speaker_id.{k}": v for k, v in talker.speaker_id.items()})
        bad = [f"{k}={v}" for k, v in ids.items() if not 0 <= v < text.vocab_size]
        if bad:
            raise ConfigError(f"config.json: talker codec ids {bad} must be below the talker vocab "
                              f"({text.vocab_size})")
        if predictor.num_code_groups != talker.num_code_groups:
            raise ConfigError("config.json: 'talker_config.num_code_groups' must equal the code predictor's")
        return talker


@attrs.frozen(kw_only=True)
class Code2WavConfig:
    codebook_size: int = 2048
    hidden_size: int = 1024
    max_position_embeddings: int = 8000
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        total = 1
        for r in (*self.upsample_rates, *self.upsampling_ratios):
            total *= r
        return total


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
