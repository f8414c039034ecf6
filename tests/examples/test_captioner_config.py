"""The captioner example's `config.json` reader: a wrong-typed, missing or unknown key is a ConfigError naming it."""

import copy

import pytest
from mstar_example_captioner.checkpoint import TINY_CONFIG
from mstar_example_captioner.config import CaptionerConfig

from mstar_core.errors import ConfigError


def test_the_tiny_config_reads_back():
    cfg = CaptionerConfig.from_dict(TINY_CONFIG)
    assert (cfg.vision.patch_size, cfg.vision.num_patches, cfg.text.vocab_size, cfg.image_token_id) == \
        (8, 16, 128, TINY_CONFIG["image_token_id"])


@pytest.mark.parametrize(("path", "value", "message"), [
    (("vision_config", "patch_size"), "8", r"config\.json: key 'vision_config\.patch_size' must be an integer"),
    (("vision_config", "num_heads"), 0, r"config\.json: key 'vision_config\.num_heads' must be a positive integer"),
    (("vision_config", "heads"), 4, r"config\.json: unknown key\(s\) \['vision_config\.heads'\]"),
    (("vision_config", "patch_size"), 7, r"'vision_config' needs image_size % patch_size == 0"),
    (("image_token_id",), True, r"config\.json: key 'image_token_id' must be an integer"),
    (("image_token_id",), 128, r"config\.json: key 'image_token_id' must be a token id below 128"),
    (("text_config",), None, r"config\.json: key 'text_config' must be an object, got null"),
    (("text_config", "hidden_size"), "64", r"config\.json: key 'text_config\.hidden_size' must be an integer"),
    (("text_config", "hidden_act"), "tanh", r"config\.json: key 'text_config\.hidden_act' is 'tanh'"),
    (("text_config", "num_key_value_heads"), 3,
     r"key 'text_config\.num_attention_heads' \(\d+\) must be a multiple of 'text_config\.num_key_value_heads'"),
    (("model_type",), "llama", r"config\.json: key 'model_type' must be 'example-captioner'"),
    (("image_size",), 32, r"config\.json: unknown key\(s\) \['image_size'\]"),
])
def test_a_bad_key_is_named(path, value, message):
    cfg = copy.deepcopy(TINY_CONFIG)
    *parents, key = path
    target = cfg
    for name in parents:
        target = target[name]
    target[key] = value
    with pytest.raises(ConfigError, match=message):
        CaptionerConfig.from_dict(cfg)


def test_a_missing_vision_key_is_named():
    cfg = copy.deepcopy(TINY_CONFIG)
    del cfg["vision_config"]["hidden_size"]
    with pytest.raises(ConfigError, match=r"missing required key 'vision_config\.hidden_size'"):
        CaptionerConfig.from_dict(cfg)
