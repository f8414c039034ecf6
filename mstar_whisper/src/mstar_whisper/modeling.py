"""Whisper's encoder (a stateless node) and decoder (a kvcache node whose layers cross-attend the encoder's output).

State-dict names follow Hugging Face's `WhisperForConditionalGeneration` (`model.encoder.*`, `model.decoder.*`); the
output projection is tied to the token embedding and never stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import cpu_elementwise, encoder_attention, gelu
from mstar_core.nn.cross_attention import CrossAttention
from mstar_core.nn.layer_norm import layer_norm_rows
from mstar_core.nn.packed import PackedLinear, pack_linears
from mstar_core.nn.tied_head import TiedLMHead
from mstar_whisper.config import WhisperConfig, WhisperTokens
from mstar_whisper.rules import WhisperLogitsRules


def _gelu(h: torch.Tensor) -> torch.Tensor:
    """GELU of a fresh activation, in place when nothing records it for a backward pass (the encoder's [1500, ffn]
    activations: one pass over memory instead of a read, a write and a new allocation's page faults); a decode
    step's few rows through `mstar_core.nn.gelu` (torch's op starts cold between the step's weight streams)."""
    if torch.is_grad_enabled():
        return F.gelu(h)
    done = gelu.gelu_(h)
    return done if done is not None else torch.ops.aten.gelu_(h)


def _add_residual(delta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x + delta`, written into `delta` (a linear's fresh output; the same sum, no new tensor) when not recording; a
    decode step's rows by `cpu_elementwise.add_` (the same IEEE sums; torch's add starts cold there, as `_gelu`)."""
    if torch.is_grad_enabled():
        return x + delta
    return delta if cpu_elementwise.add_(delta, x) else delta.add_(x)


class _Projections(nn.Module):
    """q, k (no bias), v and out projections, HF names; the encoder's attention and the decoder's self-attention."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)


class _MLP(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return _add_residual(self.fc2(_gelu(self.fc1(self.final_layer_norm(x)))), x)


class _FusedProjections(_Projections):
    """Projections whose q, k and v run as one GEMM: the encoder's over a 30-second window's 1500 rows, the decoder's
    self-attention's over a step's rows (one linear call instead of three).

    The checkpoint's three linears stay the module's parameters (names, loading, `state_dict`); `pack_own_linears`
    (called by `pack_linears` at load) derives one `[3d, d]` linear from them, k's missing bias as zeros, so each
    window's normed rows are read once instead of three times. Each output is the same FMA chain over its inputs as in
    its own linear (M*'s fp32 panels sum an output in input order whatever the panel holds), and adding k's zero bias
    changes no bit, so the fused outputs equal the three linears' exactly. The derived copy is used only while the
    three weights are the ones it was made from.
    """

    def pack_own_linears(self, min_out: int) -> int:
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if any(type(p) not in (nn.Linear, PackedLinear) for p in parts):  # (wrapped, e.g. by an adapter: run them)
            return 0
        with torch.no_grad():
            fused = nn.Linear(self.q_proj.in_features, 3 * self.q_proj.out_features, device=self.q_proj.weight.device,
                              dtype=self.q_proj.weight.dtype).requires_grad_(False)
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            fused.bias.copy_(torch.cat([self.q_proj.bias, torch.zeros_like(self.q_proj.bias), self.v_proj.bias]))
        packed = pack_linears(fused, min_out)
        # a plain attribute, not a submodule: no second copy in `state_dict`, never loaded into
        self.__dict__["fused_qkv"] = (fused, tuple((p.weight, p.weight.data_ptr(), p.weight._version) for p in parts))
        return packed

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fused = self.__dict__.get("fused_qkv")
        parts = (self.q_proj, self.k_proj, self.v_proj)
        # (the same parameters, unchanged in place and not given new data, as by `.to(dtype)`)
        if fused is not None and not torch.is_grad_enabled() and all(
                p.weight is w and p.weight.data_ptr() == ptr and p.weight._version == v
                for p, (w, ptr, v) in zip(parts, fused[1], strict=True)):
            return fused[0](h).chunk(3, dim=-1)
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)


class EncoderLayer(_MLP):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__(d, ffn)
        self.self_attn = _FusedProjections(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, (b, t, d) = self.self_attn, x.shape
        q, k, v = a.qkv(self.self_attn_layer_norm(x))
        # (M*'s kernel reads the fused GEMM's chunks in place and writes the out projection's layout; None: torch's)
        out = encoder_attention.attend(q, k, v, a.heads)
        if out is None:
            q, k, v = (p.view(b, t, a.heads, a.head_dim).transpose(1, 2) for p in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        return self.mlp(_add_residual(a.out_proj(out), x))


class WhisperEncoder(nn.Module):
    """Log-mel `[B, n_mels, 2 * max_source_positions]` -> encoder states `[B, max_source_positions, d_model]`."""

    def __init__(self, config: WhisperConfig):
        super().__init__()
        d = config.d_model
        self.frames = 2 * config.max_source_positions
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(d, config.encoder_attention_heads, config.encoder_ffn_dim)
                                    for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        if input_features.shape[-1] != self.frames:
            raise ValueError(f"whisper's encoder takes {self.frames} mel frames (30 s), got {input_features.shape[-1]}")
        x = _gelu(self.conv2(_gelu(self.conv1(input_features.to(self.conv1.weight.dtype)))))
        # (a blocked transposing copy, then the positions added in place: the same sums; torch's add straight from the
        # transposed view ran ~2.1 ms a window against ~0.8, reading across rows)
        x = x.transpose(1, 2).contiguous().add_(self.embed_positions.weight)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderLayer(_MLP):
    def __init__(self, d: int, heads: int, ffn: int, index: int):
        super().__init__(d, ffn)
        self.index = index
        self.self_attn = _FusedProjections(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = CrossAttention(d, heads, index)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, context) -> torch.Tensor:
        # (every op here is a kernel call for a decode step's rows: a recorded step replays them, mstar_kvcache.replay)
        a, t = self.self_attn, x.shape[0]
        q, k, v = (p.view(t, a.heads, a.head_dim) for p in a.qkv(layer_norm_rows(self.self_attn_layer_norm, x)))
        x = _add_residual(a.out_proj(context.attend(self.index, q, k, v, a.head_dim**-0.5).reshape(t, -1)), x)
        x = _add_residual(self.encoder_attn(layer_norm_rows(self.encoder_attn_layer_norm, x), context), x)
        return self.mlp(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """`_MLP.mlp` with the norm and GELU through the kernels at any row count (the encoder keeps torch's ops): a
        decode row shares steps with prompts, and its bits must not depend on how many rows a step has."""
        h = self.fc1(layer_norm_rows(self.final_layer_norm, x))
        done = None if torch.is_grad_enabled() else gelu.gelu_(h, max_rows=None)
        h = done if done is not None else _gelu(h)
        return _add_residual(self.fc2(h), x)


class WhisperDecoder(nn.Module):
    """The kvcache node: packed token ids at positions -> hidden rows; cross keys from `cross_kv`; tied logits.

    `process_logits` applies Whisper's decoding rules to the rows it samples (see `rules.py`), from each row's
    tokens so far; `compute_no_speech` is P(<|nospeech|>) from a row's raw logits (read at start-of-transcript).
    """

    def __init__(self, config: WhisperConfig, tokens: WhisperTokens | None = None):
        super().__init__()
        d = config.d_model
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(DecoderLayer(d, config.decoder_attention_heads, config.decoder_ffn_dim, i)
                                    for i in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        # the logits read the token embedding (tied, never stored twice); the engine packs (or quantizes) the head like
        # any wide linear: unpacked, a decode step's 51865-row GEMM repacked its whole weight every call
        self.lm_head = TiedLMHead(self.embed_tokens)
        self.rules = WhisperLogitsRules(tokens) if tokens is not None else None

    def kv_cache_spec(self) -> tuple[int, int, int, int, int]:
        c = self.config
        return (c.decoder_layers, c.decoder_attention_heads, c.head_dim, c.vocab_size, c.d_model)

    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """Encoder states `[B, F, d]` -> `[B, layers, 2, F, heads, head_dim]`, once per request and window."""
        states = states.to(self.embed_tokens.weight.dtype)
        if torch.is_grad_enabled():
            return torch.stack([layer.encoder_attn.project_kv(states) for layer in self.layers], dim=1)
        # each layer's keys and values written once into the result (stacking per layer, then over layers, copied
        # the 37 MB of a base-size window twice)
        first = self.layers[0].encoder_attn
        out = states.new_empty(*states.shape[:-2], len(self.layers), 2, states.shape[-2], first.num_heads,
                               first.head_dim)
        for i, layer in enumerate(self.layers):
            attn = layer.encoder_attn
            out[..., i, 0, :, :, :] = attn.k_proj(states).unflatten(-1, (attn.num_heads, attn.head_dim))
            out[..., i, 1, :, :, :] = attn.v_proj(states).unflatten(-1, (attn.num_heads, attn.head_dim))
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context) -> torch.Tensor:
        return self.run_layers(self.layer_inputs(input_ids, positions), context)

    def layer_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        """The rows the layers start from: token plus position embeddings `[T, d]`.

        With `run_layers` this splits `forward` where a recorded decode step starts (`mstar_kvcache.replay`): this runs
        every step, the layers (kernel calls only, for a decode step's rows) may be replayed from C over its result.
        """
        return (self.embed_tokens(input_ids) + self.embed_positions(positions),)

    def run_layers(self, inputs: tuple[torch.Tensor], context) -> torch.Tensor:
        """The decoder layers and the final norm over `layer_inputs`' rows -> final hidden `[T, d]`."""
        (x,) = inputs
        for layer in self.layers:
            x = layer(x, context)
        return layer_norm_rows(self.layer_norm, x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def compute_no_speech(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.rules is None:
            raise ValueError("this decoder was built without its generation config: it knows no <|nospeech|> id")
        return self.compute_logits(hidden).float().softmax(-1)[:, self.rules.tokens.no_speech]

    def process_logits(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> torch.Tensor:
        return logits if self.rules is None else self.rules(logits, histories)


class WhisperForConditionalGeneration(nn.Module):
    """The checkpoint's container: `model.encoder`, `model.decoder` (the names the safetensors file uses)."""

    def __init__(self, config: WhisperConfig, tokens: WhisperTokens | None = None):
        super().__init__()
        self.model = nn.Module()
        self.model.encoder = WhisperEncoder(config)
        self.model.decoder = WhisperDecoder(config, tokens)
