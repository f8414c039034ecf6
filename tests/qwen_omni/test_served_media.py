"""Audio and image parts in, served on the shared engines: equal transformers' generate with the same inputs."""

import asyncio

import numpy as np
import pytest
import torch

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.qwen_omni.test_served_speech import GREEDY, run

WAVE = np.random.default_rng(3).standard_normal(16000 + 4000).astype(np.float32) * 0.1  # 1.25 s at 16 kHz
IMAGE = np.random.default_rng(4).integers(0, 256, (64, 96, 3), dtype=np.uint8)


AUDIO = {"type": "audio", "audio": torch.from_numpy(WAVE)}
PICTURE = {"type": "image", "image": torch.from_numpy(IMAGE)}


def messages(*media):
    return [{"role": "system", "content": "You are Qwen, a virtual human."},
            {"role": "user", "content": [*media, {"type": "text", "text": "What is this?"}]}]


def hf_inputs(loaded, msgs):
    prompt = loaded.prepare.build(msgs)
    inputs = {"input_ids": torch.tensor([prompt.ids])}
    if prompt.audio:
        feats = prompt.audio[0]
        inputs.update(input_features=feats[None], feature_attention_mask=torch.ones(1, feats.shape[1], dtype=torch.long))
    if prompt.patches:
        inputs.update(pixel_values=torch.cat(prompt.patches), image_grid_thw=torch.tensor(prompt.grids))
    return prompt, inputs


def test_media_prompts_text_and_speech_equal_transformers(hf, monkeypatch):
    thinker_max, talker_max = 4, 12
    cases = {"both": (AUDIO, PICTURE), "audio": (AUDIO,), "image": (PICTURE,)}

    async def main():
        async with AsyncEngine(discover()) as engine:
            loaded = await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"))
            # transformers' Talker cannot take audio and images together (its rope index reads a config the
            # Talker lacks), so the mixed prompt is checked on text; each modality alone also with speech
            results = await asyncio.gather(
                run(engine, {"messages": messages(*cases["both"]), "max_tokens": thinker_max}),
                *(run(engine, {"messages": messages(*cases[k]), "max_tokens": thinker_max, "speaker": "aiden",
                               "talker_max_tokens": talker_max, **GREEDY}) for k in ("audio", "image")))
            return loaded, results

    loaded, (both, audio, image) = asyncio.run(main())
    cfg = loaded.extras["config"]
    seen = []
    decode = hf.code2wav.chunked_decode
    monkeypatch.setattr(hf.code2wav, "chunked_decode", lambda c, **kw: seen.append(c) or decode(c, **kw))
    prompt, inputs = hf_inputs(loaded, messages(*cases["both"]))
    assert cfg.thinker.audio_token_id in prompt.ids and cfg.thinker.image_token_id in prompt.ids
    with torch.no_grad():
        seqs = hf.thinker.generate(**inputs, max_new_tokens=thinker_max, eos_token_id=cfg.im_end_token_id,
                                   do_sample=False)
    assert both["next_token"] == seqs[0, len(prompt.ids):].tolist()
    for key, got in (("audio", audio), ("image", image)):
        prompt, inputs = hf_inputs(loaded, messages(*cases[key]))
        with torch.no_grad():
            seqs, _ = hf.generate(**inputs, speaker="aiden", return_audio=True, thinker_max_new_tokens=thinker_max,
                                  thinker_eos_token_id=cfg.im_end_token_id, thinker_do_sample=False,
                                  talker_do_sample=False, talker_repetition_penalty=1.0,
                                  talker_max_new_tokens=talker_max)
        assert got["next_token"] == seqs[0, len(prompt.ids):].tolist(), key
        codes = torch.stack([c for c in got["codes"] if c is not None], dim=1)
        assert torch.equal(codes, seen[-1][0]), key  # the Talker read the accept-layer states of the media


def test_bad_media_parts_are_refused_naming_the_part(preset_cache):
    from mstar_qwen_omni.model import load

    from mstar_core.errors import RequestError

    loaded = load(LoadOptions(preset="tiny"))
    bad = [{"role": "user", "content": [{"type": "audio", "audio": torch.zeros(10)}]}]
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[0\]\.audio"):
        loaded.prepare({"messages": bad, "talker_max_tokens": 1, "talker_temperature": 0.9, "talker_top_k": 50,
                        "talker_repetition_penalty": 1.05})
    bad = [{"role": "user", "content": [{"type": "image", "image": torch.zeros(4, 4)}]}]
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[0\]\.image"):
        loaded.prepare({"messages": bad, "talker_max_tokens": 1, "talker_temperature": 0.9, "talker_top_k": 50,
                        "talker_repetition_penalty": 1.05})
