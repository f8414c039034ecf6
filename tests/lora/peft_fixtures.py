"""Tiny random Llama checkpoints and tiny random PEFT LoRA adapters over them (peft is the oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)


def make_base(directory: Path, seed: int = 0):
    """A random HF Llama written in checkpoint layout to `directory`; the transformers model."""
    import transformers

    from mstar_core.checkpoint import save_hf_checkpoint

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    save_hf_checkpoint(model, directory, model.config.to_dict())
    return model


def make_adapter(base, directory: Path, *, seed: int, r: int = 4, alpha: float = 8.0,
                 targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), rslora: bool = False):
    """A PEFT LoRA over `base` with random A and B (B is zero at PEFT's init: the delta would be nothing), saved to
    `directory`; returns the peft model (wrapping a copy of `base`)."""
    import copy

    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory)
    return model


def merged_logits(peft_model, ids: torch.Tensor) -> torch.Tensor:
    """The oracle: peft's adapter merged into a copy of the base weights, run by transformers."""
    import copy

    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    with torch.no_grad():
        return merged(input_ids=ids[None]).logits[0]
