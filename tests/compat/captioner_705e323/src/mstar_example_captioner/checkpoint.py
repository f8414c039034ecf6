"""Weights: the `tiny` preset (seeded random, written as config.json + safetensors) and the loader both use."""

from __future__ import annotations

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
from mstar_example_captioner.config import CaptionerConfig
from mstar_example_captioner.modeling import Captioner
from mstar_example_captioner.tokenizer import BOS, EOS, IMAGE

PRESET_VERSION = 1
TINY_CONFIG: dict[str, Any] = {
    "model_type": "example-captioner",
    "image_token_id": IMAGE,
    "vision_config": {
        "image_size": 32, "patch_size": 8, "hidden_size": 48, "num_layers": 2, "num_heads": 4,
        "intermediate_size": 96,
    },
    "text_config": {
        "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": BOS, "eos_token_id": EOS,
    },
}


def write_tiny(directory: Path, seed: int = 0) -> Path:
    """Seeded random weights in the checkpoint layout the loader reads (so the loader is what a preset tests)."""
    cfg = CaptionerConfig.from_dict(TINY_CONFIG)
    torch.manual_seed(seed)
    model = Captioner(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # norms keep their identity init
                p.normal_(0.0, 0.2)  # wide enough that greedy captions vary with the image
    return save_hf_checkpoint(model, directory, TINY_CONFIG)


def ensure_tiny() -> Path:
    """The preset's directory under `$MSTAR_CACHE/presets`, written once (atomically) on first use."""
    return ensure_preset(f"example-captioner-tiny-v{PRESET_VERSION}", "config.json", write_tiny)


def load_captioner(directory: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None,
                   progress: bool = True) -> Captioner:
    """Build on the meta device and fill from the directory; missing or mis-shaped weights are one clear error."""
    cfg = CaptionerConfig.from_dict(read_config(directory))
    mapping = RuleMapping(skip=[r"\.rotary_emb\.inv_freq$"])  # a derived buffer some exporters save
    return build_and_load(lambda: Captioner(cfg), open_checkpoint(directory), mapping,
                          dtype=dtype, device=device, progress=progress)
