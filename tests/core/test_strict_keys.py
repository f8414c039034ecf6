"""One strict-keys check (issue 26): every config, settings and request mapping names its unknown key the same way."""

from __future__ import annotations

import re

import pytest

from mstar_core.errors import ConfigError, RequestError
from mstar_core.strict import reject_unknown


def test_known_keys_pass_and_an_unknown_one_is_named_with_the_known_ones():
    reject_unknown({"a": 1}, ("a", "b"), "x.yaml")
    with pytest.raises(ConfigError, match=re.escape("x.yaml: unknown key(s) ['c', 'd']; known: ['a', 'b']")):
        reject_unknown({"d": 1, "a": 2, "c": 3}, ("b", "a"), "x.yaml")


def test_the_error_kind_the_noun_and_how_a_name_is_shown_are_the_callers():
    with pytest.raises(RequestError, match=re.escape("sampling: unknown parameter(s) ['tmp']")) as err:
        reject_unknown({"tmp": 1}, ("temperature",), "sampling", what="parameter", error=RequestError, param="tmp")
    assert err.value.param == "tmp"
    with pytest.raises(ConfigError, match=re.escape("config.json: unknown key(s) ['vision.depthh']")):
        reject_unknown({"depthh": 1}, ("depth",), "config.json", shown=lambda k: f"vision.{k}")


@pytest.mark.parametrize("check", [
    lambda: __import__("mstar_kvcache.config", fromlist=["x"]).KVCacheSettings.from_mapping({"num_pagess": 4}),
    lambda: __import__("mstar_core.sampling", fromlist=["x"]).SamplingParams.from_mapping({"num_pagess": 4}),
    lambda: __import__("mstar_core.config", fromlist=["x"]).Placement.from_dict({"num_pagess": 4}, "p.yaml"),
    lambda: __import__("mstar_core.api.server.deploy", fromlist=["x"])._check("server", {"num_pagess": 4}, {"port"}),
])
def test_the_adopters_name_the_unknown_key_in_the_one_shape(check):
    with pytest.raises((ConfigError, RequestError), match=re.escape("unknown ") + r"\w+" + re.escape("(s) ['num_pagess']; known: [")):
        check()
