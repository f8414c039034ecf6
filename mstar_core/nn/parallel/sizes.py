"""Which tensor-parallel sizes a module can be split by: every sharded dimension must divide evenly (KV heads may
also be a divisor of the size: each is then replicated)."""

from __future__ import annotations

from collections.abc import Mapping

from mstar_core.errors import ConfigError

#: Dimensions a group may also outnumber: KV heads, which the ranks then replicate when the group's size is a
#: multiple of them (`TensorParallelGroup.kv_shard`: each rank keeps the KV head its query heads read).
REPLICABLE = ("num_key_value_heads",)


def fits(name: str, value: int, size: int) -> bool:
    """Whether a group of `size` splits dimension `name` (`"path: name"` too) of `value`."""
    if value % size == 0:
        return True
    return name.rpartition(": ")[2] in REPLICABLE and size % value == 0


def workable_sizes(dimensions: Mapping[str, int], limit: int = 64) -> list[int]:
    """Group sizes up to `limit` that divide every dimension (or replicate KV heads, a multiple of them)."""
    return [n for n in range(1, limit + 1) if all(fits(k, v, n) for k, v in dimensions.items())]


def check_divisible(module: str, dimensions: Mapping[str, int], size: int) -> None:
    """Raise a ConfigError naming `module`, the first dimension `size` does not divide, and the sizes that would work."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{module}: tensor_parallel must be a positive integer, got {size!r}")
    for name, value in dimensions.items():
        if not fits(name, value, size):
            replicable = " nor is a multiple of it (KV heads are replicated then)" if name.rpartition(": ")[2] in \
                REPLICABLE else ""
            raise ConfigError(
                f"{module}: tensor_parallel {size} does not divide {name} ({value}){replicable}; sizes that split "
                f"every sharded dimension ({', '.join(f'{k}={v}' for k, v in dimensions.items())}): "
                f"{workable_sizes(dimensions)}"
            )


def llama_dimensions(cfg) -> dict[str, int]:
    """The dimensions a Llama-family decoder is split along (KV heads split, or replicated where ranks outnumber
    them)."""
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
