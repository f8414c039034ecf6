"""Where tiny presets live, writing one exactly once even when several processes load it at once, and the small
byte-level BPE tokenizer the Qwen presets train for themselves (no download)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def preset_root() -> Path:
    """`$MSTAR_CACHE/presets`, else `~/.cache/mstar/presets`."""
    return Path(os.environ.get("MSTAR_CACHE", Path.home() / ".cache" / "mstar")) / "presets"


def ensure_preset(name: str, marker: str, write: Callable[[Path], Any]) -> Path:
    """The directory of preset `name`, written by `write(dir)` on first use.

    `write` fills a private staging directory that is renamed into place, so a concurrent loader
    (a server and its worker processes, parallel tests) sees either nothing or the whole preset;
    `marker` is a file whose presence means the preset is complete.
    """
    target = preset_root() / name
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write(staging)
        if not (staging / marker).is_file():
            raise RuntimeError(f"preset writer for '{name}' did not produce {marker}")
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical (same seed)
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def byte_level_bpe(corpus: Sequence[str], specials: Sequence[str], whole_words: Sequence[str],
                   vocab_size: int = 320) -> Any:
    """A byte-level BPE of `vocab_size` ids trained on `corpus` (seen four times), with `whole_words` (role names:
    single tokens, as in Qwen's vocabulary) and then the `specials` added last, in order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials) - len(whole_words),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus) * 4, trainer)
    tok.add_tokens([AddedToken(w, single_word=True) for w in whole_words])
    tok.add_special_tokens(list(specials))
    return tok
