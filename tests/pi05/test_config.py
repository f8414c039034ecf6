"""pi0 / pi0.5 `config.json`: a wrong-typed key is a ConfigError naming its dotted key, at load."""

import copy
import json

import pytest
from mstar_pi05.checkpoint import load_policy, tiny_config

from mstar_core.errors import ConfigError


def _load(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_policy(tmp_path, device="meta", progress=False)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c["mstar_sizes"]["text"].update(hidden_size="64"),
     r"key 'mstar_sizes\.text\.hidden_size' must be an integer, got \"64\""),
    (lambda c: c["mstar_sizes"]["vision"].update(patch_size=14.0), r"key 'mstar_sizes\.vision\.patch_size'"),
    (lambda c: c.update(chunk_size=0), r"key 'chunk_size' must be a positive integer, got 0"),
    (lambda c: c.update(max_period="4"), r"key 'max_period' must be a number like 4\.0"),
    (lambda c: c["mstar_sizes"].update(vison={}), r"unknown key\(s\) \['mstar_sizes\.vison'\]"),
])
def test_a_bad_key_fails_at_load_naming_it(tmp_path, edit, message):
    cfg = copy.deepcopy(tiny_config("pi05"))
    edit(cfg)
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, cfg)
