"""BAGEL's three config files: a wrong-typed key is a ConfigError naming the file and the key, at load."""

import copy
import json

import pytest
from mstar_bagel.checkpoint import TINY_LLM, TINY_TOP, TINY_VIT
from mstar_bagel.config import BagelConfig

from mstar_core.errors import ConfigError


def _from_dir(tmp_path, top=None, llm=None, vit=None):
    for name, data in (("config.json", top or TINY_TOP), ("llm_config.json", llm or TINY_LLM),
                       ("vit_config.json", vit or TINY_VIT)):
        (tmp_path / name).write_text(json.dumps(data))
    return BagelConfig.from_dir(tmp_path)


def test_tiny_files_read_back():
    cfg = BagelConfig.from_dicts(copy.deepcopy(TINY_TOP), TINY_LLM, TINY_VIT)
    assert (cfg.num_timesteps, cfg.timestep_shift, cfg.vae.ch_mult) == (TINY_TOP["mstar_num_timesteps"], 3.0,
                                                                       tuple(TINY_TOP["mstar_vae"]["ch_mult"]))


@pytest.mark.parametrize(("part", "key", "value", "message"), [
    ("top", "mstar_num_timesteps", 1.5, r"config\.json: key 'mstar_num_timesteps' must be an integer like 50, got 1\.5"),
    ("top", "mstar_num_timesteps", 1, r"key 'mstar_num_timesteps' must be at least 2 \(it counts the schedule's points\)"),
    ("top", "latent_patch_size", 0, r"config\.json: key 'latent_patch_size' must be a positive integer"),
    ("top", "mstar_vae", {"ch": "16"}, r"config\.json: key 'mstar_vae\.ch' must be an integer"),
    ("llm", "num_attention_heads", "4", r"llm_config\.json: key 'num_attention_heads' must be an integer"),
    # a string is not a boolean: "false" must not switch qk-norm on (or off) by truthiness
    ("llm", "qk_norm", "false", r"llm_config\.json: key 'qk_norm' must be true or false, got \"false\""),
    ("vit", "num_hidden_layers", 1, r"vit_config\.json: key 'num_hidden_layers' must be at least 2"),
    ("vit", "image_size", 28.0, r"vit_config\.json: key 'image_size' must be an integer"),
])
def test_a_bad_key_fails_naming_file_and_key(tmp_path, part, key, value, message):
    files = {"top": copy.deepcopy(TINY_TOP), "llm": copy.deepcopy(TINY_LLM), "vit": copy.deepcopy(TINY_VIT)}
    files[part][key] = value
    with pytest.raises(ConfigError, match=message):
        _from_dir(tmp_path, **files)


def test_qk_norm_is_read_as_given_and_defaults_to_on():
    off = BagelConfig.from_dicts(copy.deepcopy(TINY_TOP), {**TINY_LLM, "qk_norm": False}, TINY_VIT)
    absent = BagelConfig.from_dicts(copy.deepcopy(TINY_TOP), {k: v for k, v in TINY_LLM.items() if k != "qk_norm"},
                                    TINY_VIT)
    assert (off.llm.qk_norm, absent.llm.qk_norm) == (False, True)
