"""V-JEPA 2 configs: a wrong-typed key in `config.json` (HF) or the AC sidecar is a ConfigError naming it, at load."""

import json

import pytest
from mstar_vjepa.checkpoint import TINY_AC, TINY_AC_ENCODER, ac_configs, load_hf
from mstar_vjepa.config import VJEPA2Config

from mstar_core.errors import ConfigError


def test_hf_config_with_a_string_size_fails_at_load_naming_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**VJEPA2Config().to_dict(), "hidden_size": "1024"}))
    with pytest.raises(ConfigError, match=r"config\.json: key 'hidden_size' must be an integer like 1024, got \"1024\""):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**VJEPA2Config().to_dict(), "qkv_bias": "yes"}))
    with pytest.raises(ConfigError, match="key 'qkv_bias' must be true or false"):
        load_hf(tmp_path)


def test_ac_sidecar_is_type_checked_and_strict(tmp_path):
    def write(predictor):
        (tmp_path / "config.json").write_text(json.dumps({"encoder": TINY_AC_ENCODER.to_dict(), "predictor": predictor}))

    write(TINY_AC.to_dict())
    assert ac_configs(tmp_path) == (TINY_AC_ENCODER, TINY_AC)
    write({**TINY_AC.to_dict(), "depth": 2.5})
    with pytest.raises(ConfigError, match=r"key 'predictor\.depth' must be an integer like 24, got 2\.5"):
        ac_configs(tmp_path)
    write({**TINY_AC.to_dict(), "use_extrinsics": False})  # M* writes this file: an unknown key is a typo
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['predictor\.use_extrinsics'\]"):
        ac_configs(tmp_path)


def test_ac_sidecar_without_a_section_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"encoder": TINY_AC_ENCODER.to_dict()}))
    with pytest.raises(ConfigError, match=r"needs sections 'encoder' and 'predictor'; missing \['predictor'\]"):
        ac_configs(tmp_path)
