"""Wan's prompts: cleaned as the reference cleans them, tokenized by the checkpoint's UMT5 `tokenizer/tokenizer.json`."""

from __future__ import annotations

import html
import re
from pathlib import Path

from mstar_core.checkpoint import load_tokenizer

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"


def clean_prompt(text: str) -> str:
    """HTML entities unescaped (twice) and whitespace collapsed, as diffusers' `prompt_clean` without `ftfy`."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


def open_tokenizer(directory: str | Path):
    return load_tokenizer(Path(directory) / "tokenizer")


def encode_prompt(tokenizer, text: str, max_length: int) -> list[int]:
    """Token ids, at most `max_length` with the closing </s> kept (as the reference's padded call, minus the pads)."""
    if (tokenizer.truncation or {}).get("max_length") != max_length:
        tokenizer.enable_truncation(max_length)  # the text is cut, then </s> appended: the reference's truncation
    return tokenizer.encode(clean_prompt(text)).ids


def tiny_tokenizer():
    """A byte-level tokenizer in T5's shape: <pad> 0, </s> 1, <unk> 2, then the 256 bytes; '$A </s>' appended."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {PAD: 0, EOS: 1, UNK: 2, **{ch: i + 3 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in (PAD, EOS, UNK)])
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return tok
