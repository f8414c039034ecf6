"""The Thinker never samples a media placeholder: a reply holding one could not come back as the next turn's history
(the prompt refuses placeholder ids in text), which failed a realtime turn on the tiny preset now and then."""

from __future__ import annotations

import torch

from mstar_core.model import LoadOptions


def test_media_placeholders_are_columns_the_engine_never_samples():
    from mstar_kvcache.no_token import NoTokenColumns
    from mstar_qwen_omni.model import SPEC

    loaded = SPEC.load(LoadOptions(preset="tiny"))
    thinker = loaded.graph.nodes["thinker"].module()
    t = loaded.extras["config"].thinker if "config" in (loaded.extras or {}) else thinker.thinker_config
    media = {t.audio_token_id, t.image_token_id, t.video_token_id}
    vocab = thinker.grammar_vocab
    assert media <= set(vocab.no_token_ids)
    columns = NoTokenColumns.of(vocab, t.text.vocab_size, torch.device("cpu"))
    logits = torch.zeros(2, t.text.vocab_size)
    logits[:, sorted(media)] = 100.0  # the model's favourites
    picked = columns.fill(logits).argmax(-1)
    assert not set(picked.tolist()) & media
