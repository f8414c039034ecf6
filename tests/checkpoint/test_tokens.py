"""`encode_ids`: the same ids as `Tokenizer.encode`, the GIL released while a long text is tokenized (a thread
beside it keeps running), and a text past the limit refused by its head alone, naming the field."""

from __future__ import annotations

import threading
import time

import pytest

from mstar_core.checkpoint.tokens import encode_ids
from mstar_core.errors import RequestError

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 50, trainer)
    return tok


@pytest.mark.parametrize("text", ["hello world", "the quick brown fox " * 2000, "é\u0301 ünïcode " * 3000])
def test_the_same_ids_as_encode(tokenizer, text):
    for special in (True, False):
        assert encode_ids(tokenizer, text, add_special_tokens=special) == \
            tokenizer.encode(text, add_special_tokens=special).ids
    n = len(tokenizer.encode(text).ids)
    assert encode_ids(tokenizer, text, add_special_tokens=True, most=n) == tokenizer.encode(text).ids


def test_past_the_limit_is_a_request_error_naming_the_field(tokenizer):
    text = "the quick brown fox " * 2000
    n = len(tokenizer.encode(text).ids)
    with pytest.raises(RequestError, match=f"has {n} tokens; this model takes at most {n - 1}") as caught:
        encode_ids(tokenizer, text, add_special_tokens=True, most=n - 1, param="prompt")
    assert caught.value.param == "prompt"


def test_a_text_far_past_the_limit_is_refused_by_its_head(tokenizer, monkeypatch):
    seen: list[int] = []
    real = type(tokenizer).encode_batch

    class Spy:
        def encode(self, text, add_special_tokens=True):
            seen.append(len(text))
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def encode_batch(self, texts, add_special_tokens=True):
            seen.append(len(texts[0]))
            return real(tokenizer, texts, add_special_tokens=add_special_tokens)

    text = "quick brown " * 200_000  # 2.4 M characters
    with pytest.raises(RequestError, match="has more than 100 tokens") as caught:
        encode_ids(Spy(), text, add_special_tokens=False, most=100, param="messages")
    assert caught.value.param == "messages"
    assert seen and max(seen) < 10_000  # only the head was tokenized


def test_a_long_text_leaves_other_threads_running(tokenizer):
    text = "the quick brown fox jumps " * 40_000  # ~1 MB
    done = threading.Event()
    worker = threading.Thread(target=lambda: (encode_ids(tokenizer, text, add_special_tokens=False), done.set()))
    gaps, last = [], time.monotonic()
    started = last
    worker.start()
    while not done.is_set():
        time.sleep(0.002)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    worker.join()
    took = time.monotonic() - started
    # `encode` holds the GIL throughout: one gap as long as the whole (a ratio, as this box's load varies)
    assert len(gaps) > 5 and max(gaps) < 0.5 * took, (max(gaps), took)
