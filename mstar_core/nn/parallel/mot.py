"""Split BAGEL's mixture-of-transformers decoder (`mstar_core.nn.qwen2_mot`): both experts by heads and columns.

Each layer's und and gen attention share one `context.attend`, so both are split over the same heads (a
rank's KV pages hold its heads of both experts' keys); both MLPs by intermediate columns; the embedding and
LM head by vocabulary rows; the four norms per layer and `norm` / `norm_moe_gen` replicated.
"""

from __future__ import annotations

import attrs
from torch import nn

from mstar_core.nn.parallel.group import TensorParallelGroup
from mstar_core.nn.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mstar_core.nn.parallel.shard import ShardPlan, attention_entries, shard_layers
from mstar_core.nn.qwen2_mot import GEN, MoTAttention, MoTForCausalLM


def _mot_attention_splitter(cfg, group: TensorParallelGroup, checkpoint_prefix: str):
    n = group.world_size

    def split(name: str, sub: nn.Module):
        if not isinstance(sub, MoTAttention):
            return None
        local_cfg = attrs.evolve(cfg, num_attention_heads=sub.num_heads // n, num_key_value_heads=group.local_kv_heads(sub.num_kv_heads))
        local = MoTAttention(local_cfg, sub.layer_idx)
        local.scale = sub.scale
        entries: ShardPlan = {}
        ckpt = f"{checkpoint_prefix}{name}."
        for suffix in ("", GEN):
            setattr(local, f"qkv_proj{suffix}", ColumnParallelLinear(cfg.hidden_size, local.q_size + 2 * local.kv_size,
                                                                     group, bias=True))
            setattr(local, f"o_proj{suffix}", RowParallelLinear(local.q_size, cfg.hidden_size, group))
            entries.update(attention_entries(ckpt, group, sub.num_heads, sub.num_kv_heads, sub.head_dim, qkv_bias=True,
                                             o_bias=False, qk_norm=cfg.qk_norm, suffix=suffix))
        return local, entries

    return split


#: what is split: the decoder layers (both experts), the embedding and LM head by vocabulary rows
MOT_SPLIT = {"split": ("model.layers",), "vocab": ("model.embed_tokens", "lm_head")}


def shard_mot(model: MoTForCausalLM, group: TensorParallelGroup, *, module: str = "llm",
              checkpoint_prefix: str = "") -> ShardPlan:
    """Replace `model`'s layers by this rank's shards (on meta); the plan reads `checkpoint_prefix` + its names."""
    return shard_layers(model, group, module=module, checkpoint_prefix=checkpoint_prefix, **MOT_SPLIT,
                        extra=_mot_attention_splitter(model.config, group, checkpoint_prefix))
