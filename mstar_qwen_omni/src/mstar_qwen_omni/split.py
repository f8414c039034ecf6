"""What of the Thinker and the Talker a tensor-parallel group splits: each decoder's layers, its LM head by rows.

Its own module so that both sides read one table without importing each other: the parts (`thinker`,
`talker`) report the sizes a group must divide, and `parallel` splits and loads them by the same table.
"""

from __future__ import annotations

from torch import nn

from mstar_core.nn.parallel.shard import layer_dimensions

#: what is split in each part: its decoder layers, and its LM head by vocabulary rows
SPLITS = {"thinker": {"split": ("model.layers",), "vocab": ("lm_head",)},
          "talker": {"split": ("model.layers",), "vocab": ("codec_head",)}}


def part_dimensions(module: nn.Module, part: str, expert_parallel: bool = False) -> dict[str, int]:
    """The sizes a group must divide to split `module`, the `part` (`"thinker"` or `"talker"`): heads, KV heads,
    experts or their columns, vocabulary."""
    return layer_dimensions(module, **SPLITS[part], expert_parallel=expert_parallel)
