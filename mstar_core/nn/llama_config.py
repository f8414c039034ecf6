"""`LlamaConfig`: the fields of a HF Llama / Qwen2 / Qwen3 `config.json` the decoder uses, read strictly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.config.hf import check, config_field, dotted, read_fields, section
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


def _defaults(file: str, where: str) -> dict[str, Any]:
    """Reader defaults for keys a HF config may leave out (the class has none: it is built from a config)."""

    def head_dim(values: dict[str, Any]) -> int:
        hidden, heads = values["hidden_size"], values["num_attention_heads"]
        if hidden % heads:
            raise ConfigError(f"{file}: key '{dotted(where, 'hidden_size')}' ({hidden}) is not divisible by "
                              f"'{dotted(where, 'num_attention_heads')}'")
        return hidden // heads

    return {"num_key_value_heads": lambda values: values["num_attention_heads"], "head_dim": head_dim,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "mlp_bias": False,
            "max_position_embeddings": 4096}


@attrs.frozen(kw_only=True)
class LlamaConfig:
    """Decoder hyper-parameters; build with `LlamaConfig.from_hf(config_dict)`."""

    model_type: str
    vocab_size: int = config_field(minimum=1)
    hidden_size: int = config_field(minimum=1)
    intermediate_size: int = config_field(minimum=1)
    num_hidden_layers: int = config_field(minimum=1)
    num_attention_heads: int = config_field(minimum=1)
    num_key_value_heads: int = config_field(minimum=1)
    head_dim: int = config_field(minimum=1)
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: Mapping[str, Any]
    max_position_embeddings: int = config_field(minimum=1)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], *, file: str = "config.json", where: str = "") -> LlamaConfig:
        """Read a HF config dict (section `where` of `file`, e.g. a VLM's 'text_config'); a bad key is a ConfigError naming it."""
        cfg = section(cfg, where, file=file)

        def key(name: str) -> str:
            return dotted(where, name)

        model_type = check(cfg.get("model_type", "llama"), str, key("model_type"), file=file, example="llama")
        if model_type not in _FAMILIES:
            raise ConfigError(f"{file}: key '{key('model_type')}' is {model_type!r}; supported: {sorted(_FAMILIES)}")
        qkv_default, o_default, qk_norm = _FAMILIES[model_type]
        attention_bias = check(cfg.get("attention_bias", False), bool, key("attention_bias"), file=file)
        if check(cfg.get("use_sliding_window", False), bool, key("use_sliding_window"), file=file):
            raise ConfigError(f"{file}: key '{key('use_sliding_window')}' is true; sliding-window attention is not "
                              f"supported")
        check(cfg.get("rope_theta"), float | None, key("rope_theta"), file=file)
        try:
            rope = rope_parameters(cfg)
        except ValueError as exc:
            raise ConfigError(f"{file}: {f'{where}: ' if where else ''}{exc}") from None
        eos = check(cfg.get("eos_token_id"), int | list[int] | None, key("eos_token_id"), file=file)
        out = read_fields(
            cls, cfg, where, file=file, defaults=_defaults(file, where), model_type=model_type, qk_norm=qk_norm,
            rope=rope, qkv_bias=attention_bias if qkv_default is None else qkv_default,
            o_bias=attention_bias if o_default is None else o_default,
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        )
        if out.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"{file}: key '{key('hidden_act')}' is {out.hidden_act!r}; supported: "
                              f"{sorted(_ACTIVATIONS)}")
        if out.num_attention_heads % out.num_key_value_heads:
            raise ConfigError(f"{file}: key '{key('num_attention_heads')}' ({out.num_attention_heads}) must be a "
                              f"multiple of '{key('num_key_value_heads')}' ({out.num_key_value_heads})")
        return out
