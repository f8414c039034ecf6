"""pi0 / pi0.5 split across a tensor-parallel group: the PaliGemma language model and the action expert together.

The action expert attends over the language model's keys and values (and pi0's prefix writer runs the
expert's layers for the state token), so both decoders are split over the same heads: a rank's KV pages
hold its heads of both. The tied vocabulary is split by rows; the vision tower, projector and action / time
projections are replicated. PaliGemma's published sizes have one KV head (MQA): every rank then keeps that
head (its K/V rows replicated, as vLLM does) and splits the query heads, MLP columns and vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar_core.checkpoint import read_config
from mstar_core.checkpoint.meta import on_meta
from mstar_core.nn.parallel import SafetensorsSlices, TensorParallelGroup, fill_from_plan
from mstar_core.nn.parallel.shard import ShardPlan, shard_layers
from mstar_pi05.config import PolicyConfig
from mstar_pi05.modeling import Policy
from mstar_pi05.split import LANGUAGE_MODEL, POLICY_SPLIT


def shard_policy(policy: Policy, group: TensorParallelGroup, *, module: str = "vlm",
                 checkpoint_prefix: str = "") -> ShardPlan:
    """Split both decoders of `policy` in place (on meta); the plan reads `checkpoint_prefix` + LeRobot's names."""
    return shard_layers(policy, group, module=module, checkpoint_prefix=checkpoint_prefix, **POLICY_SPLIT)


def load_policy_tensor_parallel(directory: str | Path, group: TensorParallelGroup, *, dtype: torch.dtype | None = None,
                                device: str | torch.device = "cpu", module: str = "vlm") -> Policy:
    """This rank's `Policy` from a LeRobot checkpoint (names with or without the `model.` prefix), slices only."""
    cfg = PolicyConfig.from_dict(read_config(directory))
    with on_meta():
        policy = Policy(cfg)
    with SafetensorsSlices(directory) as source:
        prefix = "model." if f"model.{LANGUAGE_MODEL}.norm.weight" in source else ""
        plan = shard_policy(policy, group, module=module, checkpoint_prefix=prefix)
        fill_from_plan(policy, plan, source, dtype=dtype, device=device)
    return policy.eval()
