"""The `tiny` preset: seeded random weights written in the real checkpoint layouts, then loaded like one.

Layout (the same as a real checkpoint dir): the LM in Hugging Face Llama layout at the root
(`config.json`, sharded `model-*.safetensors` + index, `tokenizer.json`), SNAC in `snac/`
(`config.json` + weights). The output head leans towards audio tokens (a shared offset along one
hidden direction that every embedding carries), and towards the next frame slot (a slot marker in
the embedding), so that random weights still emit decodable audio frames rather than text tokens;
everything else is plain seeded random init. The speech is noise; it ends by itself (`end_speech_by_itself`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint import save_hf_checkpoint
from mstar_core.checkpoint.presets import ensure_preset as write_once
from mstar_core.nn.llama import LlamaForCausalLM
from mstar_orpheus.codes import TOKENS_PER_FRAME, AudioTokenMap
from mstar_orpheus.prompt import EMOTION_TAGS, VOICES
from mstar_orpheus.snac import SNACConfig, SNACDecoder, save_snac

PRESET_VERSION = 5  # 5: speech ends by itself (`end_speech_by_itself`)
TINY_SNAC = SNACConfig(
    sampling_rate=24000, encoder_dim=8, encoder_rates=(2, 2), decoder_dim=16, decoder_rates=(2, 2),
    codebook_size=16, codebook_dim=4, vq_strides=(4, 2, 1), noise=True, depthwise=True,
)
TINY_LM = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2}
_CORPUS = [
    "{v}: Hey there, my name is {v}, and I am a speech generation model that can sound like a person.",
    "{v}: I've also been taught to understand and produce paralinguistic things {t} like sighing or laughing.",
    "{v}: The quick brown fox jumps over the lazy dog. How vexingly quick daft zebras jump!",
    "{v}: Streaming audio while the tokens are still being generated keeps the first sound early.",
]


def build_tokenizer(codebook_size: int, vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer with Orpheus' special tokens and `<custom_token_N>` audio range."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    lines = [line.format(v=v, t=t) for line in _CORPUS for v in VOICES for t in EMOTION_TAGS[:2]]
    tok.train_from_iterator(lines, trainer)
    audio = AudioTokenMap(base=0, codebook_size=codebook_size)
    specials = ["<|begin_of_text|>", "<|eot_id|>"] + [f"<custom_token_{k}>" for k in range(audio.end)]
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    return tok


def tiny_lm_config(tokenizer: Any, **overrides: Any) -> dict[str, Any]:
    """HF Llama `config.json` for the tiny LM (llama3 rope scaling as in Llama-3.2), sized to the tokenizer."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tokenizer.get_vocab_size(),
        **TINY_LM, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id("<|begin_of_text|>"),
        "eos_token_id": tokenizer.token_to_id("<custom_token_2>"), "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def random_lm_state(cfg: dict[str, Any], audio: AudioTokenMap, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random Llama weights in HF names, with the audio-leaning output head."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    residual_scale = (2 * cfg["num_hidden_layers"]) ** -0.5  # GPT-2's scaled init of residual outputs
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std *= residual_scale
        with torch.no_grad():
            p.normal_(0.0, std)
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        # every residual stream carries +3 along dim 0, and the audio rows of the head read it
        emb[:, 0] = 3.0
        head[:, 0] = -0.5
        head[audio.first : audio.end, 0] = 1.0
        # dims 1..7 mark an audio token's frame slot; the head favours the next slot, so random
        # weights still emit slot-correct (decodable) frames, starting after start-of-speech
        emb[:, 1:8] = 0.0
        head[:, 1:8] = 0.0
        for slot in range(TOKENS_PER_FRAME):
            rows = slice(audio.first + slot * audio.codebook_size, audio.first + (slot + 1) * audio.codebook_size)
            emb[rows, 1 + slot] = 6.0
            head[rows, 1 + (slot - 1) % TOKENS_PER_FRAME] = 3.0
        emb[audio.base + 1, TOKENS_PER_FRAME] = 6.0  # start-of-speech acts as the end of a frame
    end_speech_by_itself(model, audio)
    return model.state_dict()


#: The residual channel that says how far speech is past its share of the sequence (see `end_speech_by_itself`).
SPEECH_SHARE_CHANNEL = 8
#: What a token adds to the share: its frame-slot marker (6 on audio tokens, after the first layer's norm about 4.8)
#: less SHARE_COST times the constant channel 0 (3 in every embedding, about 2.4 to 2.8 after the norm). The mean
#: over the sequence crosses zero when audio tokens are about five sixths of it: about five per prompt token.
SHARE_COST = 1.6
#: End-of-speech's logit reads the share with this gain: a few logits a frame near the crossing.
END_GAIN = 75.0


def end_speech_by_itself(model: LlamaForCausalLM, audio: AudioTokenMap) -> None:
    """Random weights never say end-of-speech, so every reply ran to `max_tokens` (1,200 by default). Here speech
    ends after about five audio tokens for each prompt token, at a frame's end, as real speech grows with its text.

    One attention head of the first layer has a zero query, so it attends evenly to every position so far; its
    value reads the frame-slot markers (channels 1..7, set only on audio tokens and start-of-speech) less
    SHARE_COST times the constant channel 0, and its output alone writes SPEECH_SHARE_CHANNEL (no other layer
    output does; no embedding holds it). So that channel is negative while speech is under about five sixths of
    the sequence and turns positive after, growing as speech goes on. End-of-speech's row of the head reads it
    (END_GAIN) and, as the next frame's first slot does, the last slot's marker, so it competes at a frame's end
    and wins there once the share is passed."""
    attn = model.model.layers[0].self_attn
    value_row = attn.q_size + attn.kv_size  # the first value dim of KV head 0, which query head 0 reads
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    end = audio.base + 2  # <custom_token_2>
    with torch.no_grad():
        attn.qkv_proj.weight[: attn.head_dim] = 0.0  # query head 0: even attention over the prefix
        attn.qkv_proj.weight[value_row] = 0.0
        attn.qkv_proj.weight[value_row, 1 : 1 + TOKENS_PER_FRAME] = 1.0
        attn.qkv_proj.weight[value_row, 0] = -SHARE_COST
        attn.o_proj.weight[SPEECH_SHARE_CHANNEL] = 0.0
        attn.o_proj.weight[SPEECH_SHARE_CHANNEL, 0] = 1.0  # head 0's first dim
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[SPEECH_SHARE_CHANNEL] = 0.0
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight[SPEECH_SHARE_CHANNEL] = 0.0
        emb[:, SPEECH_SHARE_CHANNEL] = 0.0
        head[end] = 0.0
        head[end, SPEECH_SHARE_CHANNEL] = END_GAIN
        head[end, TOKENS_PER_FRAME] = 3.0  # the last slot's marker, read as the first slot's rows read it


def write_tiny(directory: Path, seed: int = 0, snac: SNACConfig = TINY_SNAC, **lm_overrides: Any) -> Path:
    """Write the tiny Orpheus checkpoint (LM + SNAC) to `directory`."""
    tokenizer = build_tokenizer(snac.codebook_size)
    cfg = tiny_lm_config(tokenizer, **lm_overrides)
    audio = AudioTokenMap(base=tokenizer.token_to_id("<custom_token_0>"), codebook_size=snac.codebook_size)
    assert audio.end == cfg["vocab_size"] and TOKENS_PER_FRAME == 7
    state = random_lm_state(cfg, audio, seed)
    total = sum(t.numel() * t.element_size() for t in state.values())
    save_hf_checkpoint(state, directory, cfg, max_shard_bytes=total // 2 + 1,
                       extra_files={"tokenizer.json": tokenizer.to_str()})
    torch.manual_seed(seed + 1)
    decoder = SNACDecoder(snac)
    with torch.no_grad():
        for p in decoder.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_snac(decoder, directory / "snac")
    (directory / "orpheus_preset.json").write_text(json.dumps({"version": PRESET_VERSION, "seed": seed}))
    return directory


def ensure_preset(name: str = "tiny") -> Path:
    """The preset's directory, written once (atomically, so concurrent processes do not race)."""
    if name != "tiny":
        raise ValueError(f"unknown orpheus preset {name!r}; presets: tiny")
    return write_once(f"orpheus-tiny-v{PRESET_VERSION}", "orpheus_preset.json", write_tiny)
