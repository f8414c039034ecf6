"""BAGEL's text side: a Qwen2 byte-level BPE `tokenizer.json` and the four special tokens BAGEL uses."""

from __future__ import annotations

from pathlib import Path

import attrs

from mstar_core.checkpoint import load_tokenizer
from mstar_core.errors import ConfigError

BOS, EOS, BOI, EOI = "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"
SPECIALS = ("<|endoftext|>", BOS, EOS, BOI, EOI)


@attrs.frozen
class SpecialIds:
    bos: int  # <|im_start|>: opens every text block, and the first token fed to decode
    eos: int  # <|im_end|>: closes a text block; decoding stops on it
    boi: int  # <|vision_start|>: first row of every image block
    eoi: int  # <|vision_end|>: last row of every image block


def special_ids(tokenizer) -> SpecialIds:
    ids = {}
    for name, token in (("bos", BOS), ("eos", EOS), ("boi", BOI), ("eoi", EOI)):
        tid = tokenizer.token_to_id(token)
        if tid is None:
            raise ConfigError(f"bagel: tokenizer.json has no {token} token; BAGEL's Qwen2 tokenizer defines it")
        ids[name] = tid
    return SpecialIds(**ids)


def tiny_tokenizer():
    """A byte-level BPE in Qwen2's shape (no merges: every byte a token), the specials after the 256 bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def open_tokenizer(directory: str | Path):
    return load_tokenizer(directory)
