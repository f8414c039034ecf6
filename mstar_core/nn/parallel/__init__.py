"""Tensor parallelism: a node's layers split across the ranks of a group (heads, columns, rows, vocabulary)."""

from mstar_core.nn.parallel.group import TensorParallelGroup
from mstar_core.nn.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from mstar_core.nn.parallel.llama import (
    fill_from_plan,
    llama_shard_plan,
    load_llama_tensor_parallel,
    shard_llama,
)
from mstar_core.nn.parallel.sizes import check_divisible, llama_dimensions, workable_sizes
from mstar_core.nn.parallel.slices import Piece, SafetensorsSlices, StateDictSlices, read_pieces

__all__ = [
    "ColumnParallelLinear",
    "Piece",
    "RowParallelLinear",
    "SafetensorsSlices",
    "StateDictSlices",
    "TensorParallelGroup",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "check_divisible",
    "fill_from_plan",
    "llama_dimensions",
    "llama_shard_plan",
    "load_llama_tensor_parallel",
    "read_pieces",
    "shard_llama",
    "workable_sizes",
]
