"""Qwen3's multi-codebook code predictor (Qwen3-Omni's and Qwen3-TTS's "MTP"), the Talker's text resize MLP,
and the per-frame seed: the parts the two Talkers share.

`CodePredictor` predicts codes 1..G-1 of a frame from [Talker hidden, embed(code 0)]. It runs as an AR
LM over a *joined* vocabulary of `(G - 1) * codebook` ids: id `g * V + c` is code `c` of group `g + 1`,
so a sampled id is directly the next step's input (`embed` picks table `g`), and the row at position
`p` may only pick group `p - 1`'s ids. Its `forward` returns the hidden rows with one extra column
holding that group, which `compute_logits` reads to mask the other heads' ids (the engine hands it
only the rows it samples, without their positions). Checkpoint names: `model.{layers, norm, codec_embedding.N}`,
`lm_head.N`, and `small_to_mtp_projection` where the Talker is wider than the predictor.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.config.hf import config_field, head_dim_from_heads, read_fields, rope_settings, section
from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.llama import LlamaDecoderLayer
from mstar_core.nn.llama_config import LlamaConfig
from mstar_core.nn.mlp import activation
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.rotary import RotaryEmbedding


@attrs.frozen(kw_only=True)
class Qwen3DecoderSizes:
    """The sizes every Qwen3 decoder config has (attention, widths, RoPE), with the defaults of the published code
    predictor (1024 wide, 5 layers); `Qwen3TextConfig` (`mstar_core.nn.qwen3_talker`) adds experts and M-RoPE, and
    its models pass their own published sizes as read defaults."""

    vocab_size: int = 2048
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = config_field(16, minimum=1)  # divides hidden_size: 0 would fail deep in the build
    num_key_value_heads: int = config_field(8, minimum=1)
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0


@attrs.frozen(kw_only=True)
class CodePredictorConfig(Qwen3DecoderSizes):
    """`code_predictor_config` of a Qwen3-Omni or Qwen3-TTS Talker: a dense Qwen3 decoder and its group count."""

    num_code_groups: int = 16

    @classmethod
    def from_hf(cls, cfg: Any, where: str) -> CodePredictorConfig:
        """The section at dotted key `where` (`talker_config.code_predictor_config`); absent keys keep the defaults
        but `head_dim` (hidden_size / heads) and `rope_theta` (10000, the published value both Talkers use)."""
        cfg = section(cfg, where)
        return read_fields(cls, cfg, where, defaults={"head_dim": head_dim_from_heads},
                           rope_theta=rope_settings(cfg, where, 10000.0)["rope_theta"])


class ResizeMLP(nn.Module):
    """`fc2(silu(fc1(x)))`: text (or Thinker) width -> Talker width (`text_projection`, `hidden_projection`)."""

    def __init__(self, in_size: int, mid_size: int, out_size: int, act: str = "silu"):
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, mid_size)
        self.linear_fc2 = nn.Linear(mid_size, out_size)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class FrameSeed(nn.Module):
    """The code predictor's first input each frame: [Talker hidden, Talker embed(code 0)] `[2, H]`."""

    def __init__(self, talker: nn.Module):
        super().__init__()
        self.talker = talker

    def forward(self, hidden: torch.Tensor, code0: int) -> torch.Tensor:
        with torch.no_grad():
            code = torch.tensor([int(code0)], device=hidden.device)
            return torch.cat([hidden.view(1, -1), self.talker.embed(code).to(hidden.dtype)])


class CodePredictorModel(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, embedding_dim: int):
        super().__init__()
        llama = LlamaConfig.from_hf({
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
            "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias, "rope_theta": cfg.rope_theta,
            "model_type": "qwen3", "max_position_embeddings": cfg.max_position_embeddings,
        })
        self.layers = nn.ModuleList(LlamaDecoderLayer(llama, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, llama.rope)
        # the tables hold the Talker's width (its next input sums them); `small_to_mtp_projection` narrows them
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, embedding_dim)
                                             for _ in range(cfg.num_code_groups - 1))


class CodePredictor(nn.Module):
    """Joined-vocabulary AR decoder: `forward` -> `[T, H + 1]` (hidden, head index); `compute_logits` -> `[N, (G-1)V]`.

    Inputs (the seed rows, `embed`'s code rows) are in the Talker's width `talker_hidden_size` (default: the
    predictor's own); `config["hidden_size"]` is that width, the one the engine checks spliced embeddings against.
    """

    def __init__(self, cfg: CodePredictorConfig, talker_hidden_size: int | None = None):
        super().__init__()
        width = cfg.hidden_size if talker_hidden_size is None else talker_hidden_size
        self.predictor_config = cfg
        self.codebook = cfg.vocab_size
        self.heads = cfg.num_code_groups - 1
        self.config = {"num_hidden_layers": cfg.num_hidden_layers, "num_key_value_heads": cfg.num_key_value_heads,
                       "head_dim": cfg.head_dim, "hidden_size": width,
                       "vocab_size": self.heads * cfg.vocab_size, "num_attention_heads": cfg.num_attention_heads}
        self.model = CodePredictorModel(cfg, width)
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(self.heads))
        # Qwen3-TTS 1.7B: a Talker wider than the predictor; its inputs (seed and codes) are narrowed on the way in
        self.small_to_mtp_projection = (nn.Linear(width, cfg.hidden_size) if width != cfg.hidden_size
                                        else nn.Identity())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Joined ids -> embeddings from table `id // codebook`."""
        ids = ids.view(-1)
        code = ids % self.codebook
        if torch.compiler.is_compiling():  # a compiled step: no host read of the ids (every table, then pick)
            every = torch.stack([emb(code) for emb in self.model.codec_embedding])  # [G-1, T, H], small T
            table = (ids // self.codebook).view(1, -1, 1).expand(1, -1, every.shape[-1])
            return every.gather(0, table).squeeze(0)
        # eager: an AR step's one id is one lookup; a frame's G - 1 ids (one per table) are one row each
        tables, codes = (ids // self.codebook).tolist(), code.tolist()
        if len(set(tables)) == 1:
            return self.model.codec_embedding[tables[0]](code)
        return torch.stack([self.model.codec_embedding[t].weight[c] for t, c in zip(tables, codes, strict=True)])

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: AttentionContext,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = self.layer_inputs(input_ids, positions, input_embeds)
        return self.layer_outputs(self.run_layers(inputs, context), inputs)

    def layer_inputs(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                     input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Embeddings, rotary tables and each row's head: what the layers read (a replayed step's inputs)."""
        x = self.small_to_mtp_projection(self.embed(input_ids) if input_embeds is None else input_embeds)
        head = (positions.view(-1) - 1).clamp(0, self.heads - 1).to(x.dtype)
        return (x, *self.model.rotary_emb(positions), head)

    def run_layers(self, inputs: tuple[torch.Tensor, ...], context: AttentionContext) -> torch.Tensor:
        """The layers and the final norm -> hidden `[T, H]` (the part a replayed step records)."""
        x, cos, sin, _ = inputs
        for layer in self.model.layers:
            x = layer(x, (cos, sin), context)
        return self.model.norm(x)

    def layer_outputs(self, hidden: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The hidden rows with each row's head as one more column (`compute_logits` reads it)."""
        return torch.cat([hidden, inputs[3][:, None]], dim=-1)

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row's own head only (the other heads' ids stay -inf): one `[V, H]` matmul per head present.

        Computing every head for every row and masking afterwards cost (G-1)x the matmul plus a copy of all
        heads' weights per call, most of a frame's CPU time. Grouping reads the heads back to the host once
        per call, as the sampler does with its tokens.
        """
        hidden, head = rows[:, :-1], rows[:, -1].long()
        out = hidden.new_full((rows.shape[0], self.heads * self.codebook), float("-inf"))
        picked = head.tolist()
        for h in sorted(set(picked)):
            at = [i for i, g in enumerate(picked) if g == h]
            cols = slice(h * self.codebook, (h + 1) * self.codebook)
            if len(at) == rows.shape[0]:
                out[:, cols] = F.linear(hidden, self.lm_head[h].weight)
            else:
                index = torch.tensor(at, device=rows.device)
                out[index, cols] = F.linear(hidden[index], self.lm_head[h].weight)
        return out
