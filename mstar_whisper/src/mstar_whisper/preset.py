"""The `tiny` preset: a seeded random Whisper in the real multilingual layout (whisper-tiny's ids, 80 mels, 1500 source
and 448 target positions, 51865 tokens) at toy widths, written as a Hugging Face directory with a real byte-level BPE
`tokenizer.json` whose special and timestamp tokens sit at Whisper's ids. Built offline, once per cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint import save_hf_checkpoint
from mstar_core.checkpoint.presets import ensure_preset

PRESET_VERSION = 3  # 2: positions ramp toward end-of-text (replies end after ~55 tokens); 3: the empty text token
#: Whisper's 99 multilingual language codes, in token order (ids 50259 on; v3 appends "yue").
LANGUAGES = ("en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt "
             "la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af "
             "oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su").split()
TEXT_TOKENS = 50257  # ids below <|endoftext|>
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
    "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 80,
    "vocab_size": 51865, "max_source_positions": 1500, "max_target_positions": 448, "activation_function": "gelu",
    "decoder_start_token_id": 50258, "pad_token_id": 50257, "bos_token_id": 50257, "eos_token_id": 50257,
    "begin_suppress_tokens": [220, 50257], "suppress_tokens": [], "tie_word_embeddings": True, "dtype": "float32",
}
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, this is a tiny speech recognizer with random weights; its transcripts are noise.",
    "One two three four five six seven eight nine ten. Good morning, good evening, thank you.",
    "M* serves composite multimodal models: an encoder, a decoder and the pages between them.",
]


def special_tokens() -> list[str]:
    """Whisper's added tokens from id 50257 on, in id order."""
    return ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
            *(f"<|{i * 0.02:.2f}|>" for i in range(1501))]


def build_tokenizer() -> Any:
    """A byte-level BPE trained on a small corpus, its vocabulary filled to 50257 text tokens (unreachable by
    encoding but decodable: strings over the byte alphabet), then Whisper's added tokens at their real ids.

    The last text token (50256) is the empty string, as in the multilingual checkpoints' vocabulary (the
    tiktoken file's zero-byte entry): CTranslate2 4.7+ tells a multilingual vocabulary from an English-only one
    by it, and without it runs the checkpoint as English-only (no language or task token in its prompt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    raw = json.loads(tok.to_str())
    vocab: dict[str, int] = raw["model"]["vocab"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    letters = [c for c in alphabet if c.isalpha() and c.isascii()]
    n = 0
    while len(vocab) < TEXT_TOKENS - 1:  # "Ġ" + a deterministic letter string: a word of noise when decoded
        n += 1
        word, k = "", n
        while k:
            k, r = divmod(k, len(letters))
            word += letters[r]
        vocab.setdefault("Ġ" + word, len(vocab))
    vocab[""] = TEXT_TOKENS - 1
    raw["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(raw))
    specials = special_tokens()
    tok.add_special_tokens(specials[:-1501])
    tok.add_tokens(specials[-1501:])  # timestamps are added tokens but not special ones (as in Whisper's files)
    assert tok.token_to_id("<|endoftext|>") == TEXT_TOKENS and tok.token_to_id("<|30.00|>") == 51864
    assert tok.token_to_id("") == TEXT_TOKENS - 1
    return tok


def generation_config() -> dict[str, Any]:
    return {
        "decoder_start_token_id": 50258, "eos_token_id": 50257, "pad_token_id": 50257, "bos_token_id": 50257,
        "lang_to_id": {f"<|{code}|>": 50259 + i for i, code in enumerate(LANGUAGES)},
        "task_to_id": {"translate": 50358, "transcribe": 50359}, "is_multilingual": True,
        "no_timestamps_token_id": 50363, "prev_sot_token_id": 50361, "max_initial_timestamp_index": 50,
        "max_length": 448, "suppress_tokens": [], "begin_suppress_tokens": [220, 50257],
        "alignment_heads": [[1, 0], [1, 1]],
    }


def write_tiny(directory: Path, seed: int = 0) -> Path:
    return write_random(directory, TINY_CONFIG, seed)


def write_random(directory: Path, raw_config: dict[str, Any], seed: int = 0, ramp: float = 0.3) -> Path:
    """A seeded random Whisper of `raw_config`'s shape in the real layout (the tiny preset; the benchmark's
    whisper-base-size checkpoint). `ramp`: how fast positions lean toward end-of-text (0: replies never end)."""
    from mstar_whisper.config import WhisperConfig
    from mstar_whisper.modeling import WhisperForConditionalGeneration

    config = WhisperConfig.from_mapping(raw_config)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0.0, 0.05 if "embed" in name else 0.2)
        # random weights loop and never pick end-of-text: lean the final norm toward its embedding, and let each
        # position lean further (measured: replies end after ~55 tokens whatever the audio; a bias alone switched
        # from never to at once between 4.5 and 5)
        decoder = model.model.decoder
        eot = decoder.embed_tokens.weight[raw_config["eos_token_id"]]
        toward = eot / eot.norm()
        decoder.layer_norm.bias.copy_(toward * 3.0)
        decoder.embed_positions.weight.add_(ramp * torch.arange(config.max_target_positions)[:, None] * toward)
        model.model.encoder.embed_positions.weight.copy_(_sinusoids(1500, config.d_model))
    build_tokenizer().save(str(directory / "tokenizer.json"))
    preprocessor = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": 16000,
                    "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
                    "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False}
    save_hf_checkpoint(model, directory, raw_config, extra_files={
        "generation_config.json": generation_config(), "preprocessor_config.json": preprocessor,
        "tokenizer_config.json": {"tokenizer_class": "WhisperTokenizer", "model_max_length": 448,
                                  "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}})
    return directory


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's encoder positions: sines then cosines over log-spaced timescales up to 10000."""
    half = channels // 2
    scales = torch.exp(-torch.log(torch.tensor(10000.0)) / (half - 1) * torch.arange(half))
    angles = torch.arange(length)[:, None] * scales[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def ensure_tiny() -> Path:
    return ensure_preset(f"whisper-tiny-v{PRESET_VERSION}", "config.json", write_tiny)
