"""What of pi0 / pi0.5 a tensor-parallel group splits: both decoders' layers, and the tied vocabulary by rows.

Its own module so that both sides read one list without importing each other: the node modules
(`modeling`) report the sizes a group must divide, and `parallel` splits and loads by the same list.
"""

from __future__ import annotations

from torch import nn

from mstar_core.nn.parallel.shard import layer_dimensions

#: the two decoders inside LeRobot's `Policy` (its checkpoint names, less a leading `model.`)
LANGUAGE_MODEL = "paligemma_with_expert.paligemma.model.language_model"
ACTION_EXPERT = "paligemma_with_expert.gemma_expert.model"
#: both decoders' layers, and the language model's (tied) vocabulary
POLICY_SPLIT = {"split": (f"{LANGUAGE_MODEL}.layers", f"{ACTION_EXPERT}.layers"),
                "vocab": (f"{LANGUAGE_MODEL}.embed_tokens",)}


def policy_dimensions(policy: nn.Module) -> dict[str, int]:
    """The sizes a group must divide to split the VLM and the action expert of `policy` (a `Policy`): heads, KV
    heads, columns, vocabulary."""
    return layer_dimensions(policy, **POLICY_SPLIT)
