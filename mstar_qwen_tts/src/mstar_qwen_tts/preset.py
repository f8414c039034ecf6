"""The `tiny` preset: seeded random weights in the published Qwen3-TTS layout, loaded like a real checkpoint.

The directory holds what a published `Qwen3-TTS-12Hz-*-CustomVoice` one does: `config.json` (talker_config with
its code predictor, speaker_encoder_config, the `im_*` / `tts_*` ids), `model.safetensors` (`talker.*`),
`generation_config.json`, `tokenizer.json` + `tokenizer_config.json` (a byte-level BPE trained here with Qwen's
special tokens: no download), and `speech_tokenizer/` (its config, `decoder.*` weights and preprocessor config).
Sizes are those of MODELS.md's tiny config; `tts_model_size` "1b7" keeps the instruct turn. `tiny-design` is
the same weights as a VoiceDesign checkpoint (no preset speakers), `tiny-base` as a Base one (cloning: plus the
speaker encoder's `speaker_encoder.*`). Every preset's `speech_tokenizer/` also holds the encoder (`encoder.*`, Mimi
at tiny widths), as the published tokenizer does. The speech is noise; it ends by itself with EOS after a few dozen
frames at most (`end_speech_by_itself`), and `generation_config.json` caps a reply at 48 frames (3.8 s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint import save_hf_checkpoint
from mstar_core.checkpoint.presets import byte_level_bpe, ensure_preset
from mstar_qwen_tts.checkpoint import SPEECH_TOKENIZER, QwenTTS
from mstar_qwen_tts.config import SpeechDecoderConfig, SpeechEncoderConfig, TTSConfig
from mstar_qwen_tts.speech_decoder import SpeechDecoder
from mstar_qwen_tts.speech_encoder import SpeechEncoder

# 2: the real 1,920 samples a frame (8·5·4·3 and 2·2), so a reply of 48 frames is 3.8 s; 3: the speech
# tokenizer's encoder (Mimi, `encoder.*`) for cloning with a transcript; 4: speech ends by itself
# (`end_speech_by_itself`)
PRESET_VERSION = 4
MAX_FRAMES = 48
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
ROLES = ["user", "assistant"]
SPEAKERS = {"ryan": 3061, "eric": 3062}
DIALECTS = {"ryan": False, "eric": "sichuan_dialect"}
LANGUAGES = {"english": 2050, "chinese": 2055, "sichuan_dialect": 2062}
_CORPUS = [
    "Hello there! The quick brown fox jumps over the lazy dog, and then it sings a short song.",
    "A warm, low voice that speaks slowly and clearly. Streaming speech keeps the first sound early.",
    "Voice design describes a speaker; a preset speaker needs no description at all.",
]


def build_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE with Qwen's special tokens; the role names are whole tokens, as in Qwen's vocabulary."""
    return byte_level_bpe(_CORPUS, SPECIALS, ROLES, vocab_size)


def tiny_config(tok: Any, kind: str = "custom_voice") -> dict[str, Any]:
    """`config.json` in the published form at tiny sizes, token ids from `tok`; kinds "voice_design" and "base"
    have no preset speakers (as the published checkpoints)."""
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    predictor = {"vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "hidden_act": "silu",
                 "rms_norm_eps": 1e-6, "num_code_groups": 4, "max_position_embeddings": 64, "rope_theta": 10000}
    talker = {"model_type": "qwen3_tts_talker", "code_predictor_config": predictor, "vocab_size": 3072,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "max_position_embeddings": 4096, "rope_theta": 1000000,
              "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
              "num_code_groups": 4, "text_vocab_size": tok.get_vocab_size(), "text_hidden_size": 32,
              "codec_eos_token_id": 2150, "codec_think_id": 2154, "codec_nothink_id": 2155,
              "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
              "spk_id": SPEAKERS if kind == "custom_voice" else {},
              "spk_is_dialect": DIALECTS if kind == "custom_voice" else {}, "codec_language_id": LANGUAGES}
    speaker_encoder = {"mel_dim": 128, "enc_dim": 64, "enc_channels": [32, 32, 32, 32, 96],
                       "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
                       "enc_attention_channels": 16, "enc_res2net_scale": 4, "enc_se_channels": 16,
                       "sample_rate": 24000}
    return {"architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
            "tts_model_type": kind, "tts_model_size": "1b7", "tokenizer_type": "qwen3_tts_tokenizer_12hz",
            "talker_config": talker, "speaker_encoder_config": speaker_encoder,
            "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
            "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"],
            "tts_eos_token_id": ids["<tts_text_eod>"], "torch_dtype": "float32"}


def tiny_speech_tokenizer_config() -> dict[str, Any]:
    decoder = {"codebook_size": 2048, "codebook_dim": 16, "hidden_size": 16, "latent_dim": 16,
               "max_position_embeddings": 8000, "rope_theta": 10000, "num_attention_heads": 2,
               "num_key_value_heads": 2, "attention_bias": False, "sliding_window": 8, "intermediate_size": 32,
               "hidden_act": "silu", "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5, "num_hidden_layers": 1,
               "num_quantizers": 4, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
               "decoder_dim": 32}
    # Mimi at tiny widths with its real strides (8·6·5·4, then 2: 1920 samples a frame) and more quantizers than
    # the 4 kept, as the published 32 of which 16 are kept; the VQ width differs from the hidden one (input_proj)
    encoder = {"sampling_rate": 24000, "audio_channels": 1, "hidden_size": 16, "num_filters": 4,
               "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
               "residual_kernel_size": 3, "dilation_growth_rate": 2, "use_causal_conv": True, "pad_mode": "constant",
               "compress": 2, "trim_right_ratio": 1.0, "codebook_size": 2048, "codebook_dim": 8,
               "num_quantizers": 8, "use_conv_shortcut": False, "vector_quantization_hidden_dimension": 8,
               "num_semantic_quantizers": 1, "upsample_groups": 16, "num_hidden_layers": 1,
               "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
               "hidden_act": "gelu", "max_position_embeddings": 8000, "norm_eps": 1e-5, "use_cache": False,
               "use_streaming": False, "rope_theta": 10000.0, "sliding_window": 8, "attention_dropout": 0.0,
               "layer_scale_initial_scale": 0.01, "attention_bias": False, "frame_rate": 12.5}
    return {"model_type": "qwen3_tts_tokenizer_12hz", "encoder_config": encoder, "decoder_config": decoder,
            "encoder_valid_num_quantizers": 4, "input_sample_rate": 24000, "output_sample_rate": 24000,
            "decode_upsample_rate": 1920, "encode_downsample_rate": 1920}


def random_speech_encoder(cfg: SpeechEncoderConfig, seed: int) -> SpeechEncoder:
    """Seeded weights as `randomize`'s, and codebooks (buffers) whose entries are unit-ish and whose usage counts
    differ, so the nearest entry varies from frame to frame."""
    encoder = SpeechEncoder(cfg)
    randomize(encoder, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in encoder.named_buffers():
            if name.endswith("cluster_usage"):
                buf.copy_(1.0 + torch.rand(buf.shape, generator=g))
            elif name.endswith("embed_sum"):
                usage = encoder.get_buffer(name.replace("embed_sum", "cluster_usage"))
                buf.copy_(0.5 * torch.randn(buf.shape, generator=g) * usage[:, None])
    return encoder


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded init with unit-ish activations: weights ~ N(0, 1/fan_in), norms near 1, SnakeBeta and scales small,
    codebook usage counts positive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("cluster_usage"):
                p.copy_(1.0 + torch.rand(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
            elif name.endswith(("alpha", "beta")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


#: Talker residual channels: CODE is set on code rows only (the Talker's table for codes 0..2047, never a special
#: row of the prefix), EVERY on every row (each holds a projected text row: the projection's bias), SHARE says how far
#: speech is past its share of the sequence.
CODE, EVERY, SHARE = 0, 1, 2
#: CODE and EVERY hold this on their rows (about the tables' own scale).
LEVEL = 0.15
#: The share head's value is CODE - SHARE_COST * EVERY: its mean crosses zero when frames are a set share of the
#: sequence, so speech grows with its text.
SHARE_COST = 0.25  # "Hello there.": some ten frames; a sentence of ten words: some 25
#: The share head's output is scaled up by this, so it stands out of the layers' output: past a few frames from
#: the crossing it dominates the final norm, so the channel after the norm is bounded (at most 8, the root of the
#: width) while it flips sign within a frame or two of the crossing.
SHARE_GAIN = 200.0
#: EOS's row of the codec head reads SHARE with this weight: its logit stays under 8 * 8 * the norm's weight (about
#: 1.1), so `ignore_eos`'s bias of -100 still holds it off.
END_WEIGHT = 8.0


def end_speech_by_itself(model: torch.nn.Module, config: dict[str, Any]) -> None:
    """Random weights make EOS one code among 2,048, so replies ran to the frame cap. Here speech ends once its
    frames are a set share of the Talker's sequence (prompt included): longer text, longer speech.

    One head of the Talker's first layer has a zero query, so it attends evenly to every position so far; its value
    reads CODE less SHARE_COST times EVERY, and its output alone writes SHARE (no other layer output, table or
    projection does, nor a cloned voice's x-vector). SHARE is negative while the prompt dominates and turns
    positive as frames accumulate; only EOS's row of the codec head reads it. Only the weights change: the
    server reads them as any checkpoint's."""
    talker = model.talker
    attn = talker.model.layers[0].self_attn
    value_row = attn.q_size + attn.kv_size  # the first value dim of KV head 0, which query head 0 reads
    channels = [CODE, EVERY, SHARE]
    codes = config["talker_config"]["code_predictor_config"]["vocab_size"]
    with torch.no_grad():
        table = talker.model.codec_embedding.weight
        table[:, channels] = 0.0
        table[:codes, CODE] = LEVEL
        for predictor_table in talker.code_predictor.model.codec_embedding:
            predictor_table.weight[:, channels] = 0.0
        projection = talker.text_projection.linear_fc2
        projection.weight[channels] = 0.0
        projection.bias[channels] = 0.0
        projection.bias[EVERY] = LEVEL
        if getattr(model, "speaker_encoder", None) is not None:  # Base: the x-vector fills the speaker's slot
            model.speaker_encoder.fc.weight[channels] = 0.0
            model.speaker_encoder.fc.bias[channels] = 0.0
        attn.qkv_proj.weight[: attn.head_dim] = 0.0  # query head 0: even attention over the prefix
        attn.qkv_proj.weight[value_row] = 0.0
        attn.qkv_proj.weight[value_row, CODE] = 1.0
        attn.qkv_proj.weight[value_row, EVERY] = -SHARE_COST
        attn.o_proj.weight[SHARE] = 0.0
        attn.o_proj.weight[SHARE, 0] = SHARE_GAIN  # head 0's first dim
        for layer in talker.model.layers:
            layer.mlp.down_proj.weight[SHARE] = 0.0
        for layer in talker.model.layers[1:]:
            layer.self_attn.o_proj.weight[SHARE] = 0.0
        eos = config["talker_config"]["codec_eos_token_id"]
        talker.codec_head.weight[eos] = 0.0
        talker.codec_head.weight[eos, SHARE] = END_WEIGHT


def write_tiny(directory: Path, seed: int = 0, kind: str = "custom_voice") -> Path:
    tok = build_tokenizer()
    config = tiny_config(tok, kind)
    model = QwenTTS(TTSConfig.from_hf(config))
    randomize(model, seed)
    end_speech_by_itself(model, config)
    tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                        "model_max_length": 4096}
    save_hf_checkpoint(model.state_dict(), directory, config, extra_files={
        "tokenizer.json": tok.to_str(), "tokenizer_config.json": tokenizer_config,
        "generation_config.json": {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9,
                                   "repetition_penalty": 1.05, "subtalker_dosample": True, "subtalker_top_k": 50,
                                   "subtalker_top_p": 1.0, "subtalker_temperature": 0.9,
                                   "max_new_tokens": MAX_FRAMES},
    })
    speech = tiny_speech_tokenizer_config()
    decoder = SpeechDecoder(SpeechDecoderConfig.from_hf(speech))
    randomize(decoder, seed + 1)
    encoder = random_speech_encoder(SpeechEncoderConfig.from_hf(speech), seed + 2)
    save_hf_checkpoint({**{f"decoder.{k}": v for k, v in decoder.state_dict().items()},
                        **encoder.state_dict()}, directory / SPEECH_TOKENIZER,
                       speech, extra_files={"preprocessor_config.json": {
                           "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
                           "sampling_rate": 24000, "padding_side": "right", "padding_value": 0.0,
                           "return_attention_mask": True}})
    (directory / "mstar_preset.json").write_text(json.dumps({"version": PRESET_VERSION, "seed": seed}))
    return directory


#: preset name -> `tts_model_type`: the same seeded weights as a CustomVoice and as a VoiceDesign checkpoint
PRESETS = {"tiny": "custom_voice", "tiny-design": "voice_design", "tiny-base": "base"}


def ensure_tiny(preset: str = "tiny") -> Path:
    """The preset's directory, written once (atomically) under `$MSTAR_CACHE/presets`."""
    kind = PRESETS[preset]
    return ensure_preset(f"qwen3-tts-{preset}-v{PRESET_VERSION}", "mstar_preset.json",
                         lambda directory: write_tiny(directory, kind=kind))
