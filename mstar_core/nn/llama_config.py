"""`LlamaConfig`: the fields of a HF Llama / Qwen2 / Qwen3 `config.json` the decoder uses, read strictly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.nn.mlp import _ACTIVATIONS
from mstar_core.nn.rotary import rope_parameters

# model_type -> (q/k/v bias default, o_proj bias default, per-head qk-norm)
_FAMILIES: dict[str, tuple[bool | None, bool | None, bool]] = {
    "llama": (None, None, False),  # None: follow `attention_bias`
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (None, None, True),
}


def _get(cfg: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = attrs.NOTHING) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is attrs.NOTHING:
            raise ConfigError(f"config.json: missing required key '{key}'")
        return default
    value = cfg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        want = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"config.json: key '{key}' must be {want}, got {type(value).__name__} {value!r}")
    return value


def _positive(cfg: Mapping[str, Any], key: str, default: Any = attrs.NOTHING) -> int:
    value = _get(cfg, key, int, default)
    if value <= 0:
        raise ConfigError(f"config.json: key '{key}' must be a positive integer, got {value}")
    return value


@attrs.frozen(kw_only=True)
class LlamaConfig:
    """Decoder hyper-parameters; build with `LlamaConfig.from_hf(config_dict)`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: Mapping[str, Any]
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Read a HF config dict; any bad or missing key raises `ConfigError` naming it."""
        model_type = _get(cfg, "model_type", str, "llama")
        if model_type not in _FAMILIES:
            raise ConfigError(f"config.json: key 'model_type' is {model_type!r}; supported: {sorted(_FAMILIES)}")
        qkv_default, o_default, qk_norm = _FAMILIES[model_type]
        attention_bias = _get(cfg, "attention_bias", bool, False)
        heads = _positive(cfg, "num_attention_heads")
        kv_heads = _positive(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(
                f"config.json: key 'num_attention_heads' ({heads}) must be a multiple of 'num_key_value_heads' ({kv_heads})"
            )
        hidden = _positive(cfg, "hidden_size")
        if "head_dim" not in cfg and hidden % heads:
            raise ConfigError(f"config.json: key 'hidden_size' ({hidden}) is not divisible by 'num_attention_heads'")
        act = _get(cfg, "hidden_act", str, "silu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"config.json: key 'hidden_act' is {act!r}; supported: {sorted(_ACTIVATIONS)}")
        if _get(cfg, "use_sliding_window", bool, False):
            raise ConfigError("config.json: key 'use_sliding_window' is true; sliding-window attention is not supported")
        try:
            rope = rope_parameters(cfg)
        except ValueError as exc:
            raise ConfigError(f"config.json: {exc}") from None
        eos = _get(cfg, "eos_token_id", (int, list), None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            model_type=model_type,
            vocab_size=_positive(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive(cfg, "intermediate_size"),
            num_hidden_layers=_positive(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_positive(cfg, "head_dim", hidden // heads),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps", (int, float), 1e-6)),
            hidden_act=act,
            tie_word_embeddings=_get(cfg, "tie_word_embeddings", bool, False),
            qkv_bias=attention_bias if qkv_default is None else qkv_default,
            o_bias=attention_bias if o_default is None else o_default,
            mlp_bias=_get(cfg, "mlp_bias", bool, False),
            qk_norm=qk_norm,
            rope=rope,
            max_position_embeddings=_positive(cfg, "max_position_embeddings", 4096),
            bos_token_id=_get(cfg, "bos_token_id", int, None),
            eos_token_ids=eos_ids,
        )
