"""transformers' PI0 at a tiny size, and its weights renamed into the LeRobot layout M* loads."""

from __future__ import annotations

import re

import torch

TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 8,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300}
EXPERT = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 8,
          "num_key_value_heads": 1, "head_dim": 16}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "patch_size": 4, "image_size": 16}
IMAGE_TOKEN = 299
LEROBOT_CONFIG = {"type": "pi0", "chunk_size": 5, "max_state_dim": 8, "max_action_dim": 8, "num_inference_steps": 3,
                  "mstar_sizes": {"text": TEXT, "expert": EXPERT, "vision": VISION}}

_RENAMES = [
    (r"^model\.vlm\.language_model\.", "paligemma_with_expert.paligemma.model.language_model."),
    (r"^model\.vlm\.vision_tower\.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
    (r"^model\.vlm\.multi_modal_projector\.", "paligemma_with_expert.paligemma.model.multi_modal_projector."),
    (r"^model\.dit\.", "paligemma_with_expert.gemma_expert.model."),
    (r"^embed_action_time\.", ""),
]


def hf_pi0(seed: int = 0):
    from transformers import PI0Config, PI0ForConditionalGeneration

    cfg = PI0Config(
        vlm_config={"text_config": {"model_type": "gemma", **TEXT},
                    "vision_config": {"model_type": "siglip_vision_model", **VISION, "projection_dim": 64,
                                      "vision_use_head": False},
                    "projection_dim": 64, "image_token_id": IMAGE_TOKEN},
        dit_config={"model_type": "gemma", **EXPERT}, chunk_size=5, max_state_dim=8, max_action_dim=8,
        num_inference_steps=3)
    torch.manual_seed(seed)
    model = PI0ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.1)
    return model


def lerobot_state_dict(model) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.dit.embed_tokens") or "sinusoid" in key:
            continue
        for pattern, repl in _RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value.clone()
    return out
