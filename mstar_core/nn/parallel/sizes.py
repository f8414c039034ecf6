"""Which tensor-parallel sizes a module can be split by: every sharded dimension must divide evenly."""

from __future__ import annotations

from collections.abc import Mapping

from mstar_core.errors import ConfigError


def workable_sizes(dimensions: Mapping[str, int], limit: int = 64) -> list[int]:
    """Group sizes up to `limit` that divide every dimension."""
    return [n for n in range(1, limit + 1) if all(value % n == 0 for value in dimensions.values())]


def check_divisible(module: str, dimensions: Mapping[str, int], size: int) -> None:
    """Raise a ConfigError naming `module`, the first dimension `size` does not divide, and the sizes that would work."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{module}: tensor_parallel must be a positive integer, got {size!r}")
    for name, value in dimensions.items():
        if value % size:
            raise ConfigError(
                f"{module}: tensor_parallel {size} does not divide {name} ({value}); sizes that divide every "
                f"sharded dimension ({', '.join(f'{k}={v}' for k, v in dimensions.items())}): "
                f"{workable_sizes(dimensions)}"
            )


def llama_dimensions(cfg) -> dict[str, int]:
    """The dimensions a Llama-family decoder is split along (KV heads are split, never replicated)."""
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
