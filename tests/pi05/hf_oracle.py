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


def hf_pi0(seed: int = 0, *, text: dict = TEXT, expert: dict = EXPERT, vision: dict = VISION,
           image_token: int = IMAGE_TOKEN, chunk_size: int = 5, state_dim: int = 8, action_dim: int = 8,
           num_steps: int = 3, std: float = 0.1):
    """transformers' PI0 at the given sizes, weights drawn from N(0, std)."""
    from transformers import PI0Config, PI0ForConditionalGeneration

    cfg = PI0Config(
        vlm_config={"text_config": {"model_type": "gemma", **text},
                    "vision_config": {"model_type": "siglip_vision_model", **vision,
                                      "projection_dim": text["hidden_size"], "vision_use_head": False},
                    "projection_dim": text["hidden_size"], "image_token_id": image_token},
        dit_config={"model_type": "gemma", **expert}, chunk_size=chunk_size, max_state_dim=state_dim,
        max_action_dim=action_dim, num_inference_steps=num_steps)
    torch.manual_seed(seed)
    model = PI0ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, std)
    return model


def lerobot_config(*, text: dict, expert: dict, vision: dict, chunk_size: int, state_dim: int, action_dim: int,
                   num_steps: int) -> dict:
    """The LeRobot `config.json` M* loads for those sizes (the byte tokenizer: PI0 itself takes ids)."""
    return {"type": "pi0", "chunk_size": chunk_size, "max_state_dim": state_dim, "max_action_dim": action_dim,
            "num_inference_steps": num_steps, "mstar_tokenizer": "bytes",
            "mstar_sizes": {"text": text, "expert": expert, "vision": vision}}


def lerobot_state_dict(model) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.dit.embed_tokens") or "sinusoid" in key:
            continue
        for pattern, repl in _RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value.clone()
    return out
