"""Generic Llama / Qwen2 / Qwen3-style causal LM over packed tokens, configured from a HF `config.json`.

Parameter names equal the HF checkpoint names, so a HF state dict loads without renaming. With
tied embeddings there is no `lm_head` parameter at all: logits use `embed_tokens.weight`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar_core.nn import cpu_elementwise
from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.llama_config import LlamaConfig
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.replayable import has_forward_hooks
from mstar_core.nn.rotary import RotaryEmbedding
from mstar_core.nn.self_attention import GroupedQueryAttention
from mstar_core.nn.tied_head import TiedLMHead


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            layer_idx,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: AttentionContext) -> torch.Tensor:
        # the residual add and the second norm in one pass, over the attention's output (this call's own tensor)
        x, h = self.post_attention_layernorm.add_forward(self.self_attn(self.input_layernorm(x), rope, context), x)
        out = self.mlp(h)  # (this call's own tensor: the residual is added into it where the CPU kernel runs)
        return out if cpu_elementwise.add_(out, x) else x + out

    def forward_normed(self, x: torch.Tensor, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       context: AttentionContext, next_norm: RMSNorm,
                       rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` over `h = input_layernorm(x)` given, ending in the next norm: `(out, next_norm(out))`.

        The block's closing residual add and the norm after it (the next layer's input norm, or the final norm) are
        one pass where the CPU kernel runs (`add_forward`), not an add and a norm: one kernel call and one read of
        the rows fewer a layer. The same roundings as `forward` then `next_norm`. With `rows` (a last layer whose
        caller reads only those rows), every row's keys and values reach the cache and the rest of the block runs
        over `rows` alone: each of its ops computes a row by itself, so those rows come out with the same bits.
        """
        attended = self.self_attn(h, rope, context, rows)
        x, h = self.post_attention_layernorm.add_forward(attended, x if rows is None else x[rows])
        return next_norm.add_forward(self.mlp(h), x)


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF prefix `model.`)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)


class LlamaForCausalLM(nn.Module):
    """The decoder the engines run: `forward` on packed tokens -> hidden `[T, H]`; `compute_logits` on chosen rows."""

    #: `forward` takes `rows=` (the kvcache engine's optional declaration: see `mstar_kvcache.contract`)
    forward_rows = True

    def __init__(self, cfg: LlamaConfig | Mapping[str, Any]):
        super().__init__()
        self.config = cfg if isinstance(cfg, LlamaConfig) else LlamaConfig.from_hf(cfg)
        self.model = LlamaModel(self.config)
        self.lm_head = None
        if not self.config.tie_word_embeddings:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        else:  # no parameter of its own; packed like a wide linear when the engine packs (see nn/tied_head.py)
            self.tied_head = TiedLMHead(self.model.embed_tokens)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[T, H]` (models that splice in image/audio embeddings start here)."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: AttentionContext,
        input_embeds: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed `input_ids` `[T]` (or `input_embeds` `[T, H]`) at `positions` `[T]` -> final hidden `[T, H]`
        (with `rows`, indices into T: those rows' alone, `[len(rows), H]`; see `run_layers`)."""
        return self.run_layers(self.layer_inputs(input_ids, positions, input_embeds), context, rows)

    def layer_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                     input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """What the decoder layers read besides the cache: the embeddings `[T, H]` and the rotary tables (cos, sin).

        With `run_layers` this splits `forward` where a recorded step (`mstar_core.nn.tape`) starts: these are
        computed every step, the layers may be replayed over them.
        """
        if input_embeds is None:
            if input_ids is None:
                raise ValueError("forward needs input_ids or input_embeds")
            input_embeds = self.embed(input_ids)
        return (input_embeds, *self.model.rotary_emb(positions))

    def run_layers(self, inputs: tuple[torch.Tensor, ...], context: AttentionContext,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers and the final norm over `layer_inputs`' tensors -> final hidden `[T, H]`.

        `rows` (indices into T): the rows the caller reads (a prompt's last row, to sample from). Every token still
        goes through every layer's attention, so its keys and values reach the cache; after the last layer's
        attention only `rows` go on (output projection, MLP, final norm), and `[len(rows), H]` comes out.
        """
        x, cos, sin = inputs
        layers, final = self.model.layers, self.model.norm
        if not len(layers) or has_forward_hooks(final) or any(has_forward_hooks(layer) for layer in layers):
            # (a hook sees each layer's and the final norm's own call)
            for layer in layers:
                x = layer(x, (cos, sin), context)
            return final(x) if rows is None else final(x)[rows]
        # each layer's closing add joined to the norm after it (see `LlamaDecoderLayer.forward_normed`)
        h = layers[0].input_layernorm(x)
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            x, h = layer.forward_normed(x, h, (cos, sin), context, layers[i + 1].input_layernorm if i < last else final,
                                        rows if i == last else None)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden `[N, H]` -> logits `[N, vocab]`."""
        if self.lm_head is not None:
            return self.lm_head(hidden)  # (the module, so a packed LM head runs packed, see nn/packed.py)
        return self.tied_head(hidden)


def llama_weight_mapping(cfg: LlamaConfig):
    """HF names already match; drop stale rotary buffers and a duplicated `lm_head` when embeddings are tied."""
    from mstar_core.checkpoint.mapping import RuleMapping

    skip = [r"\.rotary_emb\.inv_freq$"]
    if cfg.tie_word_embeddings:
        skip.append(r"^lm_head\.weight$")
    return RuleMapping(skip=skip)


def load_llama(
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> LlamaForCausalLM:
    """Load a HF Llama/Qwen2/Qwen3 checkpoint directory (config + safetensors or torch files)."""
    from mstar_core.checkpoint import build_and_load, open_checkpoint, read_config

    cfg = LlamaConfig.from_hf(read_config(directory))
    return build_and_load(
        lambda: LlamaForCausalLM(cfg),
        open_checkpoint(directory),
        llama_weight_mapping(cfg),
        dtype=dtype,
        device=device,
        progress=progress,
    )
