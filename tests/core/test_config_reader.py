"""The checkpoint config reader (`mstar_core.config.hf`): each type rule, bounds, strictness, the dotted key in errors,
and the shared nn configs (Gemma, SigLIP, FLUX VAE) read through it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from mstar_core.config.hf import check, config_field, describe, read_fields
from mstar_core.errors import ConfigError
from mstar_core.nn.flux_vae import FluxVAEConfig
from mstar_core.nn.gemma import GemmaConfig
from mstar_core.nn.siglip import SiglipVisionConfig


@attrs.frozen(kw_only=True)
class Inner:
    depth: int = config_field(2, minimum=1)
    scale: float = 1.0


@attrs.frozen(kw_only=True)
class Outer:
    width: int = config_field(minimum=1)  # required: no default
    ratio: float = 4.0
    bias: bool = True
    act: str = "gelu"
    strides: tuple[int, ...] = (2, 2)
    cond: int | None = None
    extra: Mapping[str, Any] | None = None
    steps: int = config_field(50, minimum=2, why="a schedule has two ends", key="mstar_steps")
    inner: Inner = attrs.Factory(Inner)


def read(cfg: Any, **kwargs: Any) -> Outer:
    return read_fields(Outer, cfg, "model", file="cfg.json", **kwargs)


def test_valid_values_convert_and_absent_or_null_keys_take_defaults():
    out = read({"width": 8, "ratio": 3, "strides": [1, 4], "cond": None, "act": None, "inner": {"scale": 2}})
    assert out == Outer(width=8, ratio=3.0, strides=(1, 4), inner=Inner(scale=2.0))
    assert type(out.ratio) is float and type(out.inner.scale) is float  # ints are numbers: stored as float
    assert read({"width": 8, "cond": 5, "mstar_steps": 2}).cond == 5


@pytest.mark.parametrize(("key", "value", "message"), [
    ("width", "8", r"cfg\.json: key 'model\.width' must be an integer, got \"8\""),
    ("width", True, r"key 'model\.width' must be an integer, got true"),  # a bool is not an int
    ("width", 8.0, r"key 'model\.width' must be an integer, got 8\.0"),
    ("ratio", "4", r"key 'model\.ratio' must be a number like 4\.0, got \"4\""),
    ("ratio", False, r"key 'model\.ratio' must be a number"),
    ("bias", 1, r"key 'model\.bias' must be true or false, got 1"),
    ("act", 3, r"key 'model\.act' must be a string like \"gelu\", got 3"),
    ("strides", [2, 2.5], r"key 'model\.strides' must be a list of integers like \[2, 2\], got \[2, 2\.5\]"),
    ("strides", "22", r"key 'model\.strides' must be a list of integers"),
    ("cond", "x", r"key 'model\.cond' must be an integer or null, got \"x\""),
    ("extra", [1], r"key 'model\.extra' must be an object or null"),
    ("inner", {"depth": "2"}, r"key 'model\.inner\.depth' must be an integer like 2, got \"2\""),  # nested section
    ("inner", 3, r"key 'model\.inner' must be an object, got 3"),
])
def test_a_wrong_type_names_the_file_the_dotted_key_and_the_shape(key, value, message):
    with pytest.raises(ConfigError, match=message):
        read({"width": 8, key: value})


def test_bounds_aliases_and_missing_keys():
    with pytest.raises(ConfigError, match=r"key 'model\.width' must be a positive integer, got 0"):
        read({"width": 0})
    with pytest.raises(ConfigError, match=r"key 'model\.inner\.depth' must be a positive integer, got -1"):
        read({"width": 1, "inner": {"depth": -1}})
    # read from its own key name; the bound's reason is in the message
    with pytest.raises(ConfigError, match=r"key 'model\.mstar_steps' must be at least 2 \(a schedule has two ends\)"):
        read({"width": 1, "mstar_steps": 1})
    assert read({"width": 1, "steps": 1}).steps == 50  # the field's own name is not its key
    with pytest.raises(ConfigError, match=r"cfg\.json: missing required key 'model\.width' \(an integer\)"):
        read({})
    with pytest.raises(ConfigError, match=r"cfg\.json: key 'model' must be an object, got \[\]"):
        read([])


def test_unknown_keys_are_ignored_unless_strict():
    assert read({"width": 4, "architectures": ["X"], "torch_dtype": "bfloat16"}).width == 4
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['model\.torch_dtype'\]; known: .*'mstar_steps'"):
        read({"width": 4, "torch_dtype": "bfloat16"}, strict=True)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['model\.inner\.deep'\]"):  # strict reaches nested sections
        read({"width": 4, "inner": {"deep": 1}}, strict=True)


def test_defaults_and_extra_fields():
    # a callable default sees the values read so far; `extra` fields are the caller's and are not read from cfg
    out = read({"ratio": 2, "width": "ignored"}, defaults={"steps": lambda v: int(v["ratio"]) * 10}, width=3)
    assert (out.width, out.steps) == (3, 20)


def test_check_one_key_and_describe():
    assert check([1, 2], int | list[int] | None, "eos") == [1, 2]
    assert check((1, 2), tuple[int, int], "pair") == (1, 2)
    with pytest.raises(ConfigError, match=r"config\.json: key 'pair' must be a list of integers"):
        check([1, 2, 3], tuple[int, int], "pair")
    assert describe(int | list[int] | None) == "an integer or a list of integers or null"


def test_gemma_config_names_the_section_key():
    good = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_parameters": {"rope_theta": 500.0}, "hidden_activation": "gelu_pytorch_tanh"}
    cfg = GemmaConfig.from_hf(good, adarms_cond_dim=8)
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta, cfg.adarms_cond_dim) == (
        257152, 4, 16, 500.0, 8)
    with pytest.raises(ConfigError, match=r"key 'mstar_sizes\.text\.intermediate_size' must be an integer"):
        GemmaConfig.from_hf({**good, "intermediate_size": 1.5}, "mstar_sizes.text")
    with pytest.raises(ConfigError, match=r"key 'text\.rope_parameters\.rope_theta' must be a number"):
        GemmaConfig.from_hf({**good, "rope_parameters": {"rope_theta": "big"}}, "text")
    with pytest.raises(ConfigError, match=r"missing required key 'num_attention_heads'"):
        GemmaConfig.from_hf({k: v for k, v in good.items() if k != "num_attention_heads"})


def test_siglip_and_vae_configs_name_the_key():
    good = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "image_size": 28, "patch_size": 14}
    assert SiglipVisionConfig.from_hf(good).num_patches == 4
    with pytest.raises(ConfigError, match=r"vit_config\.json: key 'num_attention_heads' must be a positive integer"):
        SiglipVisionConfig.from_hf({**good, "num_attention_heads": 0}, file="vit_config.json")
    with pytest.raises(ConfigError, match=r"key 'hidden_size' \(32\) must be a multiple of num_attention_heads \(3\)"):
        SiglipVisionConfig.from_hf({**good, "num_attention_heads": 3})
    assert FluxVAEConfig.from_dict(None) == FluxVAEConfig()  # absent: FLUX.1's sizes
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['mstar_vae\.channels'\]"):
        FluxVAEConfig.from_dict({"channels": 8}, "mstar_vae")
    with pytest.raises(ConfigError, match=r"key 'mstar_vae\.ch_mult' must be a list of integers like \[1, 2, 4, 4\]"):
        FluxVAEConfig.from_dict({"ch_mult": [1, "2"]}, "mstar_vae")


def test_a_derived_default_is_computed_only_when_its_key_is_absent():
    from mstar_core.nn.llama_config import LlamaConfig

    base = dict(vocab_size=10, hidden_size=12, intermediate_size=16, num_hidden_layers=1, num_attention_heads=5)
    # 12 / 5 heads has no whole head_dim: refused when it must be derived, fine when the config gives one
    with pytest.raises(ConfigError, match=r"key 'hidden_size' \(12\) is not divisible by 'num_attention_heads'"):
        LlamaConfig.from_hf(base)
    assert LlamaConfig.from_hf({**base, "head_dim": 4}).head_dim == 4
