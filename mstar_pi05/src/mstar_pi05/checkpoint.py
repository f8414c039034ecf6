"""Loading a LeRobot-layout checkpoint directory, and the `tiny` preset written in that layout.

A directory holds `config.json` (`type: pi0 | pi05`), `model.safetensors` (keys under
`paligemma_with_expert.*`, `action_in_proj`, ...; a leading `model.` is stripped) and, optionally, the
normaliser stats (`stats.json`: per feature `q01`/`q99` or `mean`/`std`, see `normalize.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint import (
    RuleMapping,
    build_and_load,
    open_checkpoint,
    read_config,
    save_hf_checkpoint,
)
from mstar_core.checkpoint.presets import ensure_preset
from mstar_pi05.config import PolicyConfig
from mstar_pi05.modeling import Policy

PRESET_VERSION = 1
_TINY_SIZES = {
    "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 512},
    "expert": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 512},
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 14},
}


def tiny_config(kind: str) -> dict[str, Any]:
    return {"type": kind, "chunk_size": 5, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 3,
            "tokenizer_max_length": 200, "mstar_sizes": _TINY_SIZES}


def weight_mapping() -> RuleMapping:
    # lm_head: the tied embedding (PaliGemma) or unused (the expert); rotary tables are derived, not weights
    return RuleMapping(rename=[(r"^model\.", "")],
                       skip=[r"lm_head\.weight$", r"\.rotary_emb\.inv_freq$", r"gemma_expert\.model\.embed_tokens\."])


def load_policy(directory: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None,
                progress: bool = True) -> Policy:
    cfg = PolicyConfig.from_dict(read_config(directory))
    return build_and_load(lambda: Policy(cfg), open_checkpoint(directory), weight_mapping(), dtype=dtype,
                          device=device, progress=progress)


def tiny_stats(cfg: PolicyConfig) -> dict[str, Any]:
    """Quantile stats in LeRobot's shape (`observation.state`, `action`), seeded so unnormalising is not the identity."""
    g = torch.Generator().manual_seed(1)
    low = (-1.0 - torch.rand(cfg.max_action_dim, generator=g)).tolist()
    high = (1.0 + torch.rand(cfg.max_action_dim, generator=g)).tolist()
    return {"observation.state": {"q01": [-2.0] * cfg.max_state_dim, "q99": [2.0] * cfg.max_state_dim},
            "action": {"q01": low, "q99": high}}


def write_tiny(directory: Path, kind: str = "pi05", seed: int = 0) -> Path:
    config = tiny_config(kind)
    cfg = PolicyConfig.from_dict(config)
    torch.manual_seed(seed)
    policy = Policy(cfg)
    with torch.no_grad():
        for _, p in policy.named_parameters():
            p.normal_(0.0, 0.1)
    save_hf_checkpoint(policy, directory, config)
    (directory / "stats.json").write_text(json.dumps(tiny_stats(cfg)))
    return directory


def ensure_tiny(kind: str) -> Path:
    return ensure_preset(f"{kind}-tiny-v{PRESET_VERSION}", "stats.json", lambda d: write_tiny(d, kind))
