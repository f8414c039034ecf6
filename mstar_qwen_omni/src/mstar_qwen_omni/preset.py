"""The `tiny` preset: seeded random weights in the published Qwen3-Omni layout, loaded like a real checkpoint.

The directory holds what the published one does: `config.json` (the older `rope_scaling` + `rope_theta`
form), 15 `model-000NN-of-00015.safetensors` shards plus `model.safetensors.index.json`, per-expert MoE
weights, `tokenizer.json` + `tokenizer_config.json` (with the chat template), and
`preprocessor_config.json` (Whisper feature-extractor and Qwen-VL image-processor settings). Sizes follow
transformers' own tiny test config, with the talker's vocab at `codebook + 1024` so the published
suppression rule (the top 1024 ids but EOS) leaves exactly the codebook samplable. The speech is noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint.presets import byte_level_bpe, ensure_preset
from mstar_qwen_omni.checkpoint import QwenOmni, save_omni
from mstar_qwen_omni.config import OmniConfig

PRESET_VERSION = 6  # 4: the Thinker ends its turns by itself (`end_turns_by_themselves`)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<tts_pad>", "<tts_text_bos>",
            "<tts_text_eod>"]
ROLES = ["system", "user", "assistant"]
CODEBOOK = 16
CODEC = {"codec_pad_id": 20, "codec_bos_id": 21, "codec_eos_token_id": 22, "codec_nothink_id": 23,
         "codec_think_bos_id": 24, "codec_think_eos_id": 25}
SPEAKER_IDS = {"chelsie": 30, "ethan": 31, "aiden": 32}
_CORPUS = [
    "You are Qwen, a virtual human developed by the Qwen Team, capable of perceiving auditory and visual inputs.",
    "Hello! What is in this picture? Please describe the sound you hear.",
    "The quick brown fox jumps over the lazy dog, and then it sings a short song.",
    "Streaming speech while the text is still being written keeps the first sound early.",
]

#: The chat template: Qwen's turn format; audio and image parts become one placeholder each, which
#: `mstar_qwen_omni.prompt` expands to the encoder's token count.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m['role'] }}\n"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('audio', 'input_audio') -%}<|audio_start|><|audio_pad|><|audio_end|>"
    "{%- elif part['type'] in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

PREPROCESSOR = {
    "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000,
    "hop_length": 160, "n_fft": 400, "chunk_length": 300, "padding_value": 0.0, "padding_side": "right",
    "return_attention_mask": True, "dither": 0.0,
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "min_pixels": 4096, "max_pixels": 65536,
}


def build_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE with Qwen's special tokens; the role names are whole tokens (the Talker finds turns by them)."""
    return byte_level_bpe(_CORPUS, SPECIALS, ROLES, vocab_size)


def tiny_config(tok: Any) -> dict[str, Any]:
    """`config.json` in the published form at tiny sizes, token ids from `tok`."""
    ids = {t: tok.token_to_id(t) for t in [*SPECIALS, *ROLES]}
    vocab = tok.get_vocab_size()
    text = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 4096,
            "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2], "interleaved": True,
                             "mrope_interleaved": True}}
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
             "d_model": 32, "activation_function": "gelu", "max_source_positions": 1500, "n_window": 50,
             "n_window_infer": 800, "output_dim": 32, "downsample_hidden_size": 8, "conv_chunksize": 500}
    vision = {"depth": 2, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64,
              "num_heads": 4, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "out_hidden_size": 32, "num_position_embeddings": 64, "deepstack_visual_indexes": [1]}
    thinker = {"model_type": "qwen3_omni_moe_thinker", "text_config": text, "audio_config": audio,
               "vision_config": vision, "audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
               "video_token_id": ids["<|video_pad|>"], "audio_start_token_id": ids["<|audio_start|>"],
               "audio_end_token_id": ids["<|audio_end|>"], "vision_start_token_id": ids["<|vision_start|>"],
               "vision_end_token_id": ids["<|vision_end|>"], "position_id_per_seconds": 13,
               "user_token_id": ids["user"]}
    talker_text = {"vocab_size": CODEBOOK + 1024, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
                   "rms_norm_eps": 1e-6, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 24, "norm_topk_prob": False, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "max_position_embeddings": 4096, "rope_theta": 1000000.0,
                   "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2], "interleaved": True}}
    predictor = {"vocab_size": CODEBOOK, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
                 "rms_norm_eps": 1e-6, "num_code_groups": 4, "max_position_embeddings": 64, "rope_theta": 1000000.0}
    talker = {"model_type": "qwen3_omni_moe_talker", "text_config": talker_text, "code_predictor_config": predictor,
              "num_code_groups": 4, "thinker_hidden_size": 32, "accept_hidden_layer": 2, **CODEC,
              "audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
              "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
              "audio_start_token_id": ids["<|audio_start|>"], "position_id_per_seconds": 13,
              "spatial_merge_size": 2, "speaker_id": SPEAKER_IDS}
    code2wav = {"codebook_size": CODEBOOK, "hidden_size": 32, "max_position_embeddings": 8000, "num_attention_heads": 4,
                "num_key_value_heads": 4, "sliding_window": 8, "intermediate_size": 64, "hidden_act": "silu",
                "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5, "num_hidden_layers": 2, "num_quantizers": 4,
                "upsample_rates": [2, 2], "upsampling_ratios": [2], "decoder_dim": 32, "rope_theta": 10000.0}
    return {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
            "thinker_config": thinker, "talker_config": talker, "code2wav_config": code2wav,
            "enable_audio_output": True, "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
            "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"],
            "tts_eos_token_id": ids["<tts_text_eod>"], "system_token_id": ids["system"], "user_token_id": ids["user"],
            "assistant_token_id": ids["assistant"], "torch_dtype": "float32"}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded init with unit-ish activations: weights ~ N(0, 1/fan_in), norms near 1, SnakeBeta and scales small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel() if "experts" not in name else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * fan_in**-0.5)
            elif name.endswith(("alpha", "beta")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name or name.endswith(("ln_q.weight", "ln_post.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def speak_past_the_first_frame(model: torch.nn.Module, code_scale: float = 3.0) -> None:
    """Random weights make an end token as likely as any other: for some prompts the Thinker's first (greedy)
    token was <|im_end|> (an empty reply), and for some seeds the Talker's first code was EOS (0 frames). The
    preset zeroes both end rows and scales the Talker's code rows: replies run to `max_tokens`, speech ends
    after seconds (codec EOS about 1 % a frame). The weights stay a checkpoint's: every path reads them as it
    would a real one, nothing in the server is special-cased."""
    with torch.no_grad():
        head = model.talker.codec_head.weight
        head[:CODEBOOK] *= code_scale
        head[CODEC["codec_eos_token_id"]] = 0.0
        im_end = model.config.im_end_token_id
        model.thinker.lm_head.weight[im_end] = 0.0


#: The residual-stream channel that carries "the turn may end": constant in every token's embedding, written by no
#: layer, read only by <|im_end|>'s row of the LM head.
END_CHANNEL = 0
#: <|im_end|>'s logit is END_WEIGHT times the normalized channel (about 0.46 with these widths): near the top of the
#: other logits (their maximum is 2.4 to 3.5), so a sampled turn ends within a few dozen tokens (3 to 40 at
#: temperature 0.8 in the seeds tried) and a greedy one within a few.
END_WEIGHT = 6.0


def _shows_text(tokenizer: Any, token: int) -> bool:
    """Whether a token alone decodes to visible text (not a special or role token, whitespace, or part of a UTF-8
    character)."""
    if tokenizer.id_to_token(token) in (*SPECIALS, *ROLES) or token >= tokenizer.get_vocab_size():
        return False
    text = tokenizer.decode([token], skip_special_tokens=True)
    return bool(text.strip()) and "\ufffd" not in text


def end_turns_by_themselves(model: torch.nn.Module, tokenizer: Any) -> None:
    """Random weights never end a turn: <|im_end|> is one token among hundreds, so replies (realtime turns too) ran
    to their token limit. The preset gives the Thinker a constant channel in its residual stream: every token's
    embedding holds +1 there (tokens that show nothing alone, special and role tokens and pieces of a UTF-8
    character, hold -1: a prompt ends in `assistant`, so a reply never ends before its first token, nor right
    after a token that leaves its text empty) and no attention or expert output
    writes to it, so after the final norm it has that sign at every position; <|im_end|>'s LM-head row reads only
    that channel. Its logit sits
    among the highest at every step, so a reply ends by itself within a few dozen tokens. These are a
    checkpoint's weights: the server reads them as any other, nothing in it is special-cased."""
    thinker, end = model.thinker, model.config.im_end_token_id
    with torch.no_grad():
        visible = torch.tensor([_shows_text(tokenizer, i) for i in range(thinker.config.vocab_size)])
        thinker.model.embed_tokens.weight[:, END_CHANNEL] = torch.where(visible, 1.0, -1.0)
        for layer in thinker.model.layers:
            layer.self_attn.o_proj.weight[END_CHANNEL, :] = 0.0
            layer.mlp.experts.down_proj[:, END_CHANNEL, :] = 0.0
        thinker.lm_head.weight[:, END_CHANNEL] = 0.0
        thinker.lm_head.weight[end] = 0.0
        thinker.lm_head.weight[end, END_CHANNEL] = END_WEIGHT


def write_tiny(directory: Path, seed: int = 0) -> Path:
    tok = build_tokenizer()
    config = tiny_config(tok)
    model = QwenOmni(OmniConfig.from_hf(config))
    randomize(model, seed)
    speak_past_the_first_frame(model)
    end_turns_by_themselves(model, tok)
    tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE,
                        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}
    save_omni(model, directory, config, extra_files={
        "tokenizer.json": tok.to_str(), "tokenizer_config.json": tokenizer_config,
        "preprocessor_config.json": PREPROCESSOR,
        "generation_config.json": {"eos_token_id": [tok.token_to_id("<|im_end|>")]},
    })
    (directory / "mstar_preset.json").write_text(json.dumps({"version": PRESET_VERSION, "seed": seed}))
    return directory


def ensure_tiny() -> Path:
    """The preset's directory, written once (atomically) under `$MSTAR_CACHE/presets`."""
    return ensure_preset(f"qwen3-omni-tiny-v{PRESET_VERSION}", "mstar_preset.json", write_tiny)
