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

PRESET_VERSION = 2  # 2: captions end by themselves (`end_captions_by_themselves`)
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


#: Residual channels of the decoder: TEXT is set on text rows only (every token embedding, no image row),
#: EVERY on every row (image rows through the projector's bias), SHARE says how far text is past its share.
TEXT, EVERY, SHARE = 0, 1, 2
#: TEXT and EVERY hold this on their rows (the embedding's own scale, so the norms barely change).
LEVEL = 0.2
#: The share head's value is TEXT - SHARE_COST * EVERY (image rows' EVERY is smaller after the norm: their other
#: channels are wider): its mean over the sequence crosses zero some 12 characters after the default prompt.
SHARE_COST = 0.82
#: The share head's output is scaled up by this, so it stands out of the layers' output.
SHARE_GAIN = 10.0
#: <eos>'s row reads SHARE with this weight: a few logits a character near the crossing, so greedy and sampled
#: captions end 12 to 16 characters in, under the default `max_tokens` of 32 (its embedding is tied: a row as
#: input only if a prompt held <eos>).
END_WEIGHT = 500.0


def end_captions_by_themselves(model: Captioner) -> None:
    """Random weights never say <eos>, so captions ran to `max_tokens`. Here a caption ends once text is a set share
    of the sequence (image rows included): a few dozen characters after the default prompt.

    One head of the decoder's first layer has a zero query, so it attends evenly to every position so far; its
    value reads TEXT less SHARE_COST times EVERY, and its output alone writes SHARE (no other layer output does,
    no image row or embedding holds it). So SHARE is negative while the image rows dominate and turns positive as
    the caption grows; the tied LM head's <eos> row reads it with END_WEIGHT. Only the weights change."""
    lm, projector = model.language_model, model.vision_tower.projector
    attn = lm.model.layers[0].self_attn
    value_row = attn.q_size + attn.kv_size  # the first value dim of KV head 0, which query head 0 reads
    embed = lm.model.embed_tokens.weight
    with torch.no_grad():
        embed[:, [TEXT, EVERY]] = LEVEL
        embed[:, SHARE] = 0.0
        embed[EOS, SHARE] = END_WEIGHT
        projector.fc2.weight[[TEXT, EVERY, SHARE]] = 0.0
        projector.fc2.bias[[TEXT, SHARE]] = 0.0
        projector.fc2.bias[EVERY] = LEVEL
        attn.qkv_proj.weight[: attn.head_dim] = 0.0  # query head 0: even attention over the prefix
        attn.qkv_proj.weight[value_row] = 0.0
        attn.qkv_proj.weight[value_row, TEXT] = 1.0
        attn.qkv_proj.weight[value_row, EVERY] = -SHARE_COST
        attn.o_proj.weight[SHARE] = 0.0
        attn.o_proj.weight[SHARE, 0] = SHARE_GAIN  # head 0's first dim
        for layer in lm.model.layers:
            layer.mlp.down_proj.weight[SHARE] = 0.0
        for layer in lm.model.layers[1:]:
            layer.self_attn.o_proj.weight[SHARE] = 0.0


def write_tiny(directory: Path, seed: int = 0) -> Path:
    """Seeded random weights in the checkpoint layout the loader reads (so the loader is what a preset tests)."""
    cfg = CaptionerConfig.from_dict(TINY_CONFIG)
    torch.manual_seed(seed)
    model = Captioner(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # norms keep their identity init
                p.normal_(0.0, 0.2)  # wide enough that greedy captions vary with the image
    end_captions_by_themselves(model)
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
