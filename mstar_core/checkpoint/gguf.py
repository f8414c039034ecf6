"""GGUF (llama.cpp) checkpoints: dequantized tensors, a HF-style config from metadata, names mapped to HF.

Only the `llama` architecture is mapped. llama.cpp stores Q and K projection rows permuted for
its interleaved RoPE; `gguf_llama_mapping` undoes that so the tensors fit HF's half-split RoPE.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint.errors import CheckpointError
from mstar_core.checkpoint.mapping import RuleMapping

_LLAMA_NAMES = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
]


def _reader(path: str | Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct.error on foreign files
        raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from None


class GGUFSource:
    """Tensors of a GGUF file, dequantized to fp32 one at a time, under their GGUF names."""

    def __init__(self, path: str | Path):
        self.where = str(path)
        self.reader = _reader(path)
        self.metadata: dict[str, Any] = {name: field.contents() for name, field in self.reader.fields.items()}

    def __len__(self) -> int:
        return len(self.reader.tensors)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest-varying dim first
            array = dequantize(t.data, t.tensor_type).reshape(shape)
            yield t.name, torch.from_numpy(array.astype("float32", copy=True))


def _meta(meta: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key in meta:
        return meta[key]
    if default is ...:
        raise CheckpointError(f"GGUF metadata lacks '{key}'")
    return default


def gguf_llama_config(source: GGUFSource) -> dict[str, Any]:
    """A HF-style Llama `config.json` dict built from GGUF metadata."""
    meta = source.metadata
    arch = _meta(meta, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{source.where}: GGUF architecture {arch!r} is not supported (only 'llama')")
    names = set(source.tensor_names())
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{source.where}: per-frequency RoPE factors (rope_freqs.weight) are not supported")
    hidden = int(_meta(meta, "llama.embedding_length"))
    heads = int(_meta(meta, "llama.attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(_meta(meta, "llama.vocab_size", len(_meta(meta, "tokenizer.ggml.tokens")))),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_meta(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(meta, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_meta(meta, "llama.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_meta(meta, "llama.context_length", 4096)),
        "rms_norm_eps": float(_meta(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_meta(meta, "llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"{source.where}: GGUF rope scaling {scaling!r} is not supported")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(_meta(meta, "llama.rope.scaling.factor"))}
    return config


def _unpermute(num_heads: int):
    """Inverse of llama.cpp's row permutation of Q/K weights (interleaved pairs -> half-split halves)."""

    def fix(name: str, w: torch.Tensor) -> torch.Tensor:
        rows = w.shape[0]
        return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    return fix


def gguf_llama_mapping(config: dict[str, Any]) -> RuleMapping:
    """GGUF llama tensor names -> HF names, with the Q/K row permutation undone."""
    heads = config["num_attention_heads"]
    return RuleMapping(
        rename=_LLAMA_NAMES,
        transform={
            r"\.q_proj\.weight$": _unpermute(heads),
            r"\.k_proj\.weight$": _unpermute(config["num_key_value_heads"]),
        },
    )
