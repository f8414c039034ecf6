"""Qwen3-Omni `config.json`: a wrong-typed key in any section is a ConfigError naming its dotted key, at load."""

import copy
import json

import pytest
from mstar_qwen_omni.checkpoint import load_omni
from mstar_qwen_omni.preset import build_tokenizer, tiny_config

from mstar_core.errors import ConfigError


@pytest.fixture(scope="module")
def config():
    return tiny_config(build_tokenizer())


@pytest.mark.parametrize(("path", "value", "message"), [
    ("thinker_config.text_config.num_experts", "8",
     r"key 'thinker_config\.text_config\.num_experts' must be an integer like 128, got \"8\""),
    ("thinker_config.text_config.hidden_size", "32", r"key 'thinker_config\.text_config\.hidden_size'"),
    ("thinker_config.text_config.rope_scaling.mrope_section", [1, 1.5, 2],
     r"key 'thinker_config\.text_config\.rope_scaling\.mrope_section' must be a list of integers"),
    ("talker_config.code_predictor_config.num_attention_heads", 0,
     r"key 'talker_config\.code_predictor_config\.num_attention_heads' must be a positive integer"),
    ("code2wav_config.upsample_rates", [2, "2"], r"key 'code2wav_config\.upsample_rates'"),
    ("enable_audio_output", "yes", r"key 'enable_audio_output' must be true or false"),
])
def test_a_bad_key_fails_at_load_naming_it(tmp_path, config, path, value, message):
    cfg = copy.deepcopy(config)
    *parents, last = path.split(".")
    section = cfg
    for key in parents:
        section = section[key]
    section[last] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        load_omni(tmp_path, device="meta", progress=False)
