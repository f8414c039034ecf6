"""The dense greedy speech reference equals transformers' `generate(return_audio=True)` on the tiny preset."""

import pytest
import torch
from mstar_qwen_omni.reference import TextFeed, speak_greedy


def chat_ids(tokenizer, user_text):
    text = (f"<|im_start|>system\nYou are Qwen, a virtual human.<|im_end|>\n<|im_start|>user\n{user_text}<|im_end|>\n"
            "<|im_start|>assistant\n")
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from mstar_core.checkpoint import load_tokenizer

    return load_tokenizer(tiny_dir)


# slow: the served test (test_served_speech) compares the engines' output with transformers directly
CASES = [pytest.param("Hello! What is in this picture?", 5, 36, id="text-ends-first", marks=pytest.mark.slow),
         pytest.param("The quick brown fox", 3, 12, id="short", marks=pytest.mark.slow)]


@pytest.mark.parametrize("text,thinker_max,talker_max", CASES)
def test_dense_speech_equals_transformers_generate(omni, hf, tokenizer, text, thinker_max, talker_max, monkeypatch):
    cfg = omni.config
    ids = chat_ids(tokenizer, text)
    reply, codes, wav = speak_greedy(omni, ids, "ethan", thinker_max, talker_max)
    seen = []
    decode = hf.code2wav.chunked_decode
    monkeypatch.setattr(hf.code2wav, "chunked_decode", lambda c, **kw: seen.append(c) or decode(c, **kw))
    with torch.no_grad():
        seqs, hf_wav = hf.generate(torch.tensor([ids]), speaker="ethan", return_audio=True,
                                   thinker_max_new_tokens=thinker_max, thinker_eos_token_id=cfg.im_end_token_id,
                                   thinker_do_sample=False, talker_do_sample=False, talker_repetition_penalty=1.0,
                                   talker_max_new_tokens=talker_max)
    assert reply == seqs[0, len(ids):].tolist()
    assert codes.shape[1] > len(reply)  # speech outlasts the text: the tts_eos and tts_pad steps are covered
    assert torch.equal(codes, seen[0][0])  # every code group of every frame
    ref25 = hf.code2wav.chunked_decode(codes[None], chunk_size=25, left_context_size=25)[0, 0]
    assert (wav - ref25).abs().max() < 1e-4
    assert (hf.code2wav.chunked_decode(codes[None], chunk_size=300, left_context_size=25) - hf_wav).abs().max() < 1e-4


def test_text_feed_holds_back_the_last_token_then_eos_then_pad():
    feed = TextFeed()
    assert feed.next() is None
    feed.push(7)
    assert feed.next() is None  # 7 may be the last sampled token, which the Thinker never feeds back
    feed.push(8)
    assert feed.next() == 7
    feed.end()
    assert [feed.next(), feed.next(), feed.next()] == ["eos", "pad", "pad"]
