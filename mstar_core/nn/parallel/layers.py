"""Sharded layers: column- and row-parallel linears, a vocabulary-parallel embedding and LM head.

A column-parallel linear holds a slice of the output features and leaves its output sharded (the next
layer is row-parallel and reads exactly that slice); a row-parallel linear holds a slice of the input
features, so each rank's product is a partial sum that one all-reduce completes. Attention and MLP
therefore cost one all-reduce each per layer; the vocabulary layers one collective each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.parallel.group import TensorParallelGroup


class ColumnParallelLinear(nn.Linear):
    """`nn.Linear` over this rank's output features; the output stays sharded (no collective)."""

    def __init__(self, in_features: int, local_out_features: int, group: TensorParallelGroup, *, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, local_out_features, bias=bias, device=device, dtype=dtype)
        self.group = group

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.group.rank}/{self.group.world_size}"


class RowParallelLinear(nn.Module):
    """This rank's input-feature columns of a linear; partial products summed by all-reduce, bias added once."""

    def __init__(self, local_in_features: int, out_features: int, group: TensorParallelGroup, *, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group = local_in_features, out_features, group
        self.weight = nn.Parameter(torch.empty(out_features, local_in_features, device=device, dtype=dtype))
        # replicated: added after the sum, or every rank's copy would be counted world_size times
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"local_in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.group.rank}/{self.group.world_size}")


class VocabParallelEmbedding(nn.Module):
    """Rows `[start, stop)` of the token table; ids outside them look up zeros, and an all-reduce fills them in."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: TensorParallelGroup, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.start, self.stop = group.shard(num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, embedding_dim, device=device, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local = (input_ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return self.group.all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.start}, {self.stop})"


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary rows, all-gathered to the full vocabulary (rank order = vocab order).

    With `tied_to` the weight is that embedding's shard (same rows, no parameter of its own), as a tied
    head's weight is the embedding's in the unsplit model.
    """

    def __init__(self, hidden: int, vocab_size: int, group: TensorParallelGroup, *,
                 tied_to: VocabParallelEmbedding | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group
        self.start, self.stop = group.shard(vocab_size)
        if tied_to is not None:
            self.__dict__["tied_to"] = tied_to  # a plain attribute: the weight is saved with the embedding
            self.weight = None
        else:
            self.__dict__["tied_to"] = None
            self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden, device=device, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.tied_to is None else self.tied_to.weight
        return self.group.all_gather_last(F.linear(hidden, weight))

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows=[{self.start}, {self.stop}), tied={self.tied_to is not None}"
