"""A tiny transformer node for the paged-attention engine tests, with a dense reference to compare against.

It takes everything a non-LM node may take: token ids or embeddings, `[T]` or `[3, T]` positions,
routing ids choosing one of two MLP experts per token (mixture-of-transformers), a per-token tensor
`noise` and a per-sequence tensor `timestep`; it returns hidden states, logits and a `velocity`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar_core.graph import GraphNode
from mstar_core.nn.attention import DenseAttention
from mstar_core.nn.rotary import RotaryEmbedding
from mstar_core.nn.self_attention import GroupedQueryAttention
from mstar_core.runtime.engine import EngineContext, Invocation

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 32, 4, 2, 2


class TinyNode(nn.Module):
    call_inputs = {"noise": "token", "timestep": "sequence"}

    def __init__(self, seed: int = 0, axes: int = 1, layers: int = LAYERS, kv_heads: int = KV_HEADS):
        super().__init__()
        torch.manual_seed(seed)
        self.position_axes = axes
        head_dim = HIDDEN // HEADS
        self.config = dict(num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim,
                           vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.attn = nn.ModuleList(GroupedQueryAttention(HIDDEN, HEADS, kv_heads, head_dim, i) for i in range(layers))
        self.experts = nn.ModuleList(nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)) for _ in range(2))
        self.rope = RotaryEmbedding(head_dim)
        self.noise_in = nn.Linear(4, HIDDEN, bias=False)  # zeros (a call without noise) add nothing
        self.time_in = nn.Linear(1, HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.vel = nn.Linear(HIDDEN, 4)
        self.calls = 0
        self.eval()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def forward(self, input_ids, positions, context, *, input_embeds=None, routing=None, noise=None, timestep=None,
                sequence_index=None):
        self.calls += 1
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        if noise is not None:
            x = x + self.noise_in(noise)
        if timestep is not None:
            x = x + self.time_in(timestep.reshape(-1, 1))[sequence_index]
        if positions.dim() == 2:  # a toy multi-axis rotary: each axis weighs differently
            positions = positions[0] + 3 * positions[1] + 7 * positions[2]
        rope = self.rope(positions)
        for i, attn in enumerate(self.attn):
            x = x + attn(x, rope, context)
            y0, y1 = self.experts[0][i](x), self.experts[1][i](x)
            x = x + (y0 if routing is None else torch.where((routing == 1)[:, None], y1, y0)).tanh()
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def compute_velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vel(hidden)


ROW_NODE = GraphNode("dit", inputs=(), optional_inputs=("input_ids", "input_embeds", "embeds_at", "positions", "routing",
                                                         "noise", "timestep", "output_index"),
                     outputs=("hidden", "velocity"), engine="kvcache")
LM_NODE = GraphNode("lm", inputs=("input_ids",), optional_inputs=("sampling", "input_embeds"),
                    outputs=("next_token", "finish_reason", "hidden"), engine="kvcache")


def engine_for(module: Any, node: GraphNode = ROW_NODE, **settings: Any):
    from mstar_kvcache import KVCacheEngine

    settings = {"page_size": 4, "num_pages": 64, **settings}
    return KVCacheEngine(node, module, EngineContext("test", torch.device("cpu"), settings))


def run(engine, rid: str, inputs: dict[str, Any], **options: Any) -> dict[str, Any]:
    """One call, stepped to completion."""
    engine.add(Invocation(rid, engine.node.name, inputs, options))
    return drain(engine)[rid]


def drain(engine) -> dict[str, Any]:
    out: dict[str, Any] = {}
    while engine.has_work():
        for inv, res in engine.step():
            if isinstance(res, BaseException):
                raise res
            out[inv.request_id] = res
    return out


def dense(module, ids=None, positions=None, mask=None, **kwargs) -> torch.Tensor:
    """The module over all tokens at once, no cache: the reference."""
    n = len(ids) if ids is not None else kwargs["input_embeds"].shape[0]
    if positions is None:
        positions = torch.arange(n)
    ctx = DenseAttention(mask=mask) if mask is not None else DenseAttention()
    with torch.no_grad():
        return module(None if ids is None else torch.tensor(ids), positions, ctx, **kwargs)


def causal_then_block(prefix: int, block: int) -> torch.Tensor:
    """Mask: a causal prefix, then one bidirectional block that sees the whole prefix."""
    n = prefix + block
    mask = torch.ones(n, n).tril().bool()
    mask[prefix:, prefix:] = True
    return mask
