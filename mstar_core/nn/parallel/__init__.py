"""Tensor and expert parallelism: a node's layers split across the ranks of a group (heads, columns, rows,
vocabulary, experts)."""

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
    load_llama_for_rank,
    load_llama_tensor_parallel,
    shard_llama,
)
from mstar_core.nn.parallel.moe import ParallelMoE
from mstar_core.nn.parallel.shard import ShardPlan, shard_layers
from mstar_core.nn.parallel.sizes import check_divisible, llama_dimensions, workable_sizes
from mstar_core.nn.parallel.slices import Piece, SafetensorsSlices, Stack, StateDictSlices, read_pieces

__all__ = [
    "ColumnParallelLinear",
    "ParallelMoE",
    "Piece",
    "RowParallelLinear",
    "SafetensorsSlices",
    "ShardPlan",
    "Stack",
    "StateDictSlices",
    "TensorParallelGroup",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "check_divisible",
    "fill_from_plan",
    "llama_dimensions",
    "llama_shard_plan",
    "load_llama_for_rank",
    "load_llama_tensor_parallel",
    "read_pieces",
    "shard_layers",
    "shard_llama",
    "workable_sizes",
]
