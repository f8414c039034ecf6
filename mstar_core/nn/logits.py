"""Logits from an LM head's (or a tied embedding's) weight, completed over the vocabulary when that weight is split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def lm_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`F.linear(hidden, head.weight)` (the plain GEMM, never a packed copy); all-gathered if `head` is vocab-split.

    A vocabulary-parallel embedding or head (`mstar_core.nn.parallel`) carries its `group`: its weight holds
    this rank's rows only, so the local logits are one rank's columns of the full row.
    """
    logits = F.linear(hidden, head.weight)
    group = getattr(head, "group", None)
    return logits if group is None else group.all_gather_last(logits)
