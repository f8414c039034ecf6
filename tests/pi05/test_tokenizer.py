"""A checkpoint's SentencePiece tokenizer, from a configured path: the prompt ids are openpi's (BOS, the prompt with
the binned state for pi0.5; the cleaned task then the newline on its own for pi0). The model file is trained here,
a small stand-in in PaliGemma's form (pad 0, eos 1, bos 2, unk 3, byte fallback, no normalisation)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from mstar_pi05.checkpoint import write_tiny
from mstar_pi05.model import SPECS
from mstar_pi05.prepare import pi05_prompt

from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions

spm = pytest.importorskip("sentencepiece")
SPEC = {s.name: s for s in SPECS}


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    lines = [f"Task: pick up the {c} cube, State: {' '.join(str(i * 7 % 256) for i in range(32))};\nAction: "
             for c in ("red", "green", "blue", "yellow")] + ["put the bowl on the plate", "open the top drawer"]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines * 20), model_writer=out, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3, add_dummy_prefix=False,
                                   remove_extra_whitespaces=False, user_defined_symbols=["\n"])
    path = tmp_path_factory.mktemp("tok") / "paligemma_tokenizer.model"
    path.write_bytes(out.getvalue())
    return str(path)


def _checkpoint(tmp_path, kind: str, **extra) -> str:
    directory = write_tiny(tmp_path / kind, kind)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **extra}))
    return str(directory)


def _text_ids(loaded, inputs) -> list[int]:
    env = loaded.prepare_inputs(inputs)
    return env["prefix_ids"][env["image_at"].numel():].tolist()


REQUEST = {"images": [torch.zeros(28, 28, 3, dtype=torch.uint8)], "prompt": " stack_the blocks\n",
           "state": torch.tensor([-1.0, 0.0, 0.5, 1.0])}


@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_the_configured_sentencepiece_model_tokenizes_the_prompt_as_openpi(tmp_path, sp_model, kind):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    loaded = SPEC[kind].load(LoadOptions(checkpoint=_checkpoint(tmp_path, kind, mstar_tokenizer=sp_model)))
    got = _text_ids(loaded, REQUEST)
    if kind == "pi05":  # tiny stats map the state from [-2, 2] to [-1, 1] before binning
        state = np.pad(REQUEST["state"].double().numpy() / 2.0, (0, 28))
        text = pi05_prompt("stack the blocks", state)
        assert got == [2, *sp.encode(text)] and sp.decode(got[1:]) == text
        assert "State: 64 128 160 192 128" in text
    else:
        assert got == [2, *sp.encode("stack the blocks"), *sp.encode("\n")]
    assert max(got) < sp.get_piece_size() and loaded.random_weights is False


def test_tokenizer_paths_in_order_and_errors_that_name_them(tmp_path, sp_model, monkeypatch):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    want = [2, *sp.encode("stack the blocks"), *sp.encode("\n")]
    monkeypatch.delenv("MSTAR_PALIGEMMA_TOKENIZER", raising=False)
    plain = _checkpoint(tmp_path, "pi0")
    with pytest.raises(ConfigError, match="MSTAR_PALIGEMMA_TOKENIZER"):
        SPEC["pi0"].load(LoadOptions(checkpoint=plain))
    monkeypatch.setenv("MSTAR_PALIGEMMA_TOKENIZER", sp_model)
    assert _text_ids(SPEC["pi0"].load(LoadOptions(checkpoint=plain)), REQUEST) == want
    monkeypatch.setenv("MSTAR_PALIGEMMA_TOKENIZER", str(tmp_path / "missing.model"))
    with pytest.raises(ConfigError, match="missing.model"):
        SPEC["pi0"].load(LoadOptions(checkpoint=plain))
    (tmp_path / "pi0" / "tokenizer.model").write_bytes(open(sp_model, "rb").read())  # in the checkpoint: wins
    assert _text_ids(SPEC["pi0"].load(LoadOptions(checkpoint=plain)), REQUEST) == want
    with pytest.raises(ConfigError, match="not a file"):
        SPEC["pi0"].load(LoadOptions(checkpoint=_checkpoint(tmp_path / "b", "pi0", mstar_tokenizer="nope.model")))
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="not a SentencePiece model"):
        SPEC["pi0"].load(LoadOptions(checkpoint=_checkpoint(tmp_path / "c", "pi0", mstar_tokenizer=str(junk))))
