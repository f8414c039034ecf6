"""Build a `tokenizers.Tokenizer` from the BPE vocabulary and merges embedded in a GGUF file."""

from __future__ import annotations

from typing import Any

from mstar_core.checkpoint.errors import CheckpointError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are whole special tokens, never BPE-split
# llama.cpp pre-tokenizers that split every digit apart before the byte-level regex (others: plain regex)
_DIGIT_SPLITTING = {"smollm"}


def gguf_tokenizer(metadata: dict[str, Any]):
    """A byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) equivalent to the GGUF's vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(metadata.get("tokenizer.ggml.add_space_prefix")))
    if metadata.get("tokenizer.ggml.pre") in _DIGIT_SPLITTING:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True)
               if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    return tok
