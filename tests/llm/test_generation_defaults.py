"""A checkpoint's generation_config.json gives the Llama family's default sampling (vLLM's behaviour): read into
`SamplingDefaults`, applied by `prepare` under what a request sets, reported by `request_defaults()`; `none` (and
vLLM's `vllm`) keeps `SamplingParams`' greedy defaults; a directory of its own can stand in; a bad value fails the
load naming the file and the field."""

from __future__ import annotations

import json
import shutil

import pytest

from mstar_core.checkpoint.errors import CheckpointError
from mstar_core.checkpoint.hf import read_sampling_defaults
from mstar_core.model import LoadOptions

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
              "max_new_tokens": 7, "min_p": 0.05}
HELLO = {"messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, preset_cache):
    from mstar_llm.preset import ensure_tiny

    directory = tmp_path_factory.mktemp("ckpt") / "llama"
    shutil.copytree(ensure_tiny(), directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, **GENERATION}))
    return directory


def _load(checkpoint, source="auto"):
    from mstar_llm import load_llm

    return load_llm(LoadOptions(checkpoint=str(checkpoint), generation_config=source), progress=False)


def test_read_sampling_defaults(checkpoint, tmp_path):
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 7, "min_p": 0.05}
    assert read_sampling_defaults(checkpoint).values == want
    assert read_sampling_defaults(checkpoint, "none").values == {} == read_sampling_defaults(checkpoint, "vllm").values
    assert read_sampling_defaults(tmp_path).values == {}  # no file: no defaults
    assert read_sampling_defaults(tmp_path, str(checkpoint)).values == want  # a directory of its own
    assert read_sampling_defaults(checkpoint, fields=("temperature", "top_k")).values == {"temperature": 0.6,
                                                                                         "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: 'temperature' must be 0 \(greedy\)"):
        read_sampling_defaults(tmp_path)
    with pytest.raises(CheckpointError, match="no generation_config.json there"):
        read_sampling_defaults(checkpoint, str(tmp_path / "nowhere"))


def test_prepare_applies_them_under_the_request(checkpoint):
    loaded = _load(checkpoint)
    sampling = loaded.prepare_inputs(HELLO)["sampling"]
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.6, 0.9, 20, 0.05)
    assert (sampling.repetition_penalty, sampling.max_tokens) == (1.05, 7)
    asked = loaded.prepare_inputs({**HELLO, "temperature": 0, "max_tokens": 3, "top_k": 0})["sampling"]
    assert (asked.temperature, asked.max_tokens, asked.top_k, asked.top_p) == (0.0, 3, 0, 0.9)
    defaults = loaded.request_defaults()
    assert {k: defaults[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos")} == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7, "ignore_eos": False}


def test_none_keeps_greedy(checkpoint):
    loaded = _load(checkpoint, "none")
    sampling = loaded.prepare_inputs(HELLO)["sampling"]
    assert sampling.greedy and sampling.max_tokens == 256 and sampling.top_p == 1.0
    assert loaded.request_defaults()["temperature"] == 0.0


def test_the_tiny_preset_has_none(tiny):
    """The preset's generation_config.json names only its EOS: greedy, as before."""
    assert tiny.sampling_defaults.values == {} and tiny.prepare_inputs(HELLO)["sampling"].greedy
