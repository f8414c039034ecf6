"""`prepare`: messages / prompt / input_ids plus sampling fields; bad requests name what to fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams


def test_prompt_and_input_ids(tiny):
    tok = tiny.extras["tokenizer"]
    env = tiny.prepare_inputs({"prompt": "Hello world", "max_tokens": 5, "temperature": 0.5, "seed": 3})
    assert env["input_ids"] == tok.encode("Hello world").ids
    assert env["sampling"] == SamplingParams(max_tokens=5, temperature=0.5, seed=3,
                                             stop_token_ids=tiny.extras["eos_token_ids"])
    env = tiny.prepare_inputs({"input_ids": [5, 6, 7], "stop_token_ids": [9], "ignore_eos": False})
    assert env["input_ids"] == [5, 6, 7] and env["sampling"].stop_token_ids == (9, *tiny.extras["eos_token_ids"])
    assert tiny.prepare_inputs({"input_ids": [5], "ignore_eos": True})["sampling"].stop_token_ids == ()


def test_chat_template_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    directory = Path(tiny.extras["checkpoint"])
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert tiny.prepare_inputs({"messages": messages})["input_ids"] == list(want)
    assert json.loads((directory / "tokenizer_config.json").read_text())["chat_template"] == tiny.extras["chat_template"]


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ({}, "exactly one of"),
        ({"prompt": "a", "input_ids": [1]}, "exactly one of"),
        ({"prompt": "a", "temprature": 1.0}, r"unknown field\(s\) \['temprature'\]"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"input_ids": [1, 10**6]}, "outside the vocabulary"),
        ({"input_ids": "abc"}, "'input_ids' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, r"messages\[0\]\.role"),
        ({"prompt": "a", "top_p": 0.0}, r"'top_p' must be in \(0, 1\]"),
        ({"prompt": "a", "max_tokens": 0}, r"'max_tokens' must be an integer in \[1, "),
        ({"prompt": "a", "max_tokens": 1.5}, "'max_tokens' must be an integer"),
        ({"prompt": "a", "seed": 2**64}, r"'seed' must be an integer in \[0, 2\*\*63 - 1\]"),
        ({"prompt": "a", "logprobs": 10**9}, "'logprobs' must be at most the vocabulary size"),
        ({"prompt": "a", "top_k": 10**6}, "'top_k' must be at most the vocabulary size"),
        ({"prompt": "a", "temperature": 1e-320}, "'temperature' must be 0 .greedy. or in \\[1e-05, 100000\\]"),
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
        ({"input_ids": [1] * 5000}, "at most"),
    ],
)
def test_bad_requests_raise_request_error(tiny, inputs, match):
    with pytest.raises(RequestError, match=match):
        tiny.prepare_inputs(inputs)
