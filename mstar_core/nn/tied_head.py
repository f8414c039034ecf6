"""The LM head of a model with tied embeddings: logits from the token embedding's weight, packed where wide linears are.

The weight stays the embedding's (one parameter, saved once under its checkpoint name). `pack_linears` asks
this head to pack a copy like any wide linear: SmolLM2's 576 x 49152 head through MKL repacks 113 MB of
weight in every decode step, about a third of a batch-8 step on this CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TiedLMHead(nn.Module):
    """`F.linear(hidden, embed.weight)`; with a packed copy while that weight is the one packed."""

    #: Pack the head like every other linear (nn/packed.py): oneDNN's packed GEMM computes a row the same
    #: whatever the batch's row count, so the faster head keeps "a row draws the same alone or batched".
    #: (It was off for a while on the belief that the pack broke that invariant; it is MKL's one-row GEMV that does.)
    PACK = True

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        # plain attributes, not submodules: the weight belongs to (and is saved with) the embedding
        self.__dict__["embed"] = embed
        self.__dict__["linear"] = None
        self.__dict__["quantized"] = None  # (quantized head, the weight it was made from): see quantize_own_linears

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight
        linear = self.linear
        if linear is not None and linear.weight is weight:  # (a reload that replaced the parameter drops it)
            return linear(hidden)
        quantized = self.quantized
        if quantized is not None and quantized[1] is weight:
            return quantized[0](hidden)
        return F.linear(hidden, weight)

    def quantize_own_linears(self, build) -> int:
        """Quantize a copy of the embedding's weight for the logits (called by `quantize_linears`); how many (0 or 1)."""
        weight = self.embed.weight
        if weight.is_meta:
            return 0
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = weight
        self.__dict__["quantized"] = (build(linear), weight)  # the lookup table stays full precision
        self.__dict__["linear"] = None  # (a packed copy of the weight would outrank the quantized one)
        return 1

    def pack_own_linears(self, min_out: int) -> int:
        """Pack the embedding's weight as a linear's (called by `pack_linears`); how many were packed (0 or 1)."""
        from mstar_core.nn.packed import pack_linears

        if not self.PACK or self.quantized is not None:  # (off: see PACK) / the logits run on the quantized copy
            return 0
        weight = self.embed.weight
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = weight
        packed = pack_linears(linear, min_out)
        self.__dict__["linear"] = linear if packed else None
        return packed
