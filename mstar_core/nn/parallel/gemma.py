"""Split a Gemma decoder (`mstar_core.nn.gemma`: PaliGemma's language model, pi0's action expert) across a group."""

from __future__ import annotations

from mstar_core.nn.gemma import GemmaDecoder
from mstar_core.nn.parallel.group import TensorParallelGroup
from mstar_core.nn.parallel.shard import ShardPlan, shard_layers


def shard_gemma(decoder: GemmaDecoder, group: TensorParallelGroup, *, module: str = "gemma",
                checkpoint_prefix: str = "") -> ShardPlan:
    """Heads, MLP columns and (with embeddings) the tied vocabulary split; (adaptive) norms replicated."""
    vocab = ("embed_tokens",) if decoder.embed_tokens is not None else ()
    return shard_layers(decoder, group, module=module, checkpoint_prefix=checkpoint_prefix, split=("layers",),
                        vocab=vocab)
