"""The `tiny` preset: seeded random weights written in the real checkpoint layouts, then loaded like one.

Layout (the same as a real checkpoint dir): the LM in Hugging Face Llama layout at the root
(`config.json`, sharded `model-*.safetensors` + index, `tokenizer.json`), SNAC in `snac/`
(`config.json` + weights). The output head leans towards audio tokens (a shared offset along one
hidden direction that every embedding carries), and towards the next frame slot (a slot marker in
the embedding), so that random weights still emit decodable audio frames rather than text tokens;
everything else is plain seeded random init. The speech is noise.
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

PRESET_VERSION = 4
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
    return model.state_dict()


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
