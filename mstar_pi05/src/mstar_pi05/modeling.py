"""pi0 / pi0.5 components, named as LeRobot's checkpoint names them, and the node modules built on them.

`Policy` holds every weight under the LeRobot names (`paligemma_with_expert.paligemma.model.*`,
`paligemma_with_expert.gemma_expert.model.*`, `action_in_proj`, ...). The graph's nodes wrap parts of it:

- `VisionEncoder` (stateless): SigLIP + projector, pixels -> image tokens in the language model's width;
- the language model (kvcache) writes the prefix; for pi0 it is a `Pi0Prefix`, which also runs the continuous
  state token through the expert's weights (routing id 1): the state token's keys and values do not depend on
  the flow time, so it is computed once with the prefix instead of at every step;
- `ActionExpert` (kvcache, read-only over the prefix's pages): noisy actions + flow time -> velocity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.gemma import GemmaDecoder
from mstar_core.nn.rotary import apply_rotary
from mstar_core.nn.siglip import SiglipVisionTransformer
from mstar_pi05.config import PolicyConfig


def time_features(t: torch.Tensor, width: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine-cosine features of the flow time `t` `[S]` -> `[S, width]`, periods geometric from min to max (fp32)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = (2 * math.pi / period)[None, :] * t.float()[:, None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Policy(nn.Module):
    """All weights of a pi0 / pi0.5 checkpoint, in its own layout."""

    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.config = cfg
        pwe = self.paligemma_with_expert = nn.Module()
        pwe.paligemma = nn.Module()
        pm = pwe.paligemma.model = nn.Module()
        pm.language_model = GemmaDecoder(cfg.text)
        pm.vision_tower = nn.Module()
        pm.vision_tower.vision_model = SiglipVisionTransformer(cfg.vision)
        pm.multi_modal_projector = nn.Module()
        pm.multi_modal_projector.linear = nn.Linear(cfg.vision.hidden_size, cfg.text.hidden_size)
        pwe.gemma_expert = nn.Module()
        pwe.gemma_expert.model = GemmaDecoder(cfg.expert, embeddings=False)
        width = cfg.expert.hidden_size
        self.action_in_proj = nn.Linear(cfg.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, cfg.max_action_dim)
        if cfg.pi05:
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:
            self.state_proj = nn.Linear(cfg.max_state_dim, width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)

    @property
    def language_model(self) -> GemmaDecoder:
        return self.paligemma_with_expert.paligemma.model.language_model

    @property
    def expert(self) -> GemmaDecoder:
        return self.paligemma_with_expert.gemma_expert.model

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        pm = self.paligemma_with_expert.paligemma.model
        return pm.multi_modal_projector.linear(pm.vision_tower.vision_model(pixels))

    def expert_inputs(self, actions: torch.Tensor, t_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Noisy actions `[T, A]` and each row's flow time `[T]` -> (expert input rows, adaRMS conditioning or None)."""
        dtype = self.action_in_proj.weight.dtype
        x = self.action_in_proj(actions.to(dtype))
        cfg = self.config
        feats = time_features(t_rows, cfg.expert.hidden_size, cfg.min_period, cfg.max_period).to(dtype)
        if cfg.pi05:  # time conditions every norm; the action tokens carry no time
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(feats))))
            return x, cond
        x = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([x, feats], dim=-1))))
        return x, None


class VisionEncoder(nn.Module):
    """The `vision` node: pixels `[B, 3, S, S]` in [-1, 1] -> image tokens `[B, patches, text width]`."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.policy.encode_images(pixels)


class ActionExpert(nn.Module):
    """The `expert` node (kvcache, read-only over the VLM's pages): noisy actions `[T, A]` as `input_embeds`,
    the flow time per call (`timestep`), velocity rows from `compute_velocity`."""

    call_inputs = {"timestep": "sequence"}

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy
        self.config = policy.config.expert

    def kv_cache_spec(self):
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim, None, None  # inputs are actions, any width

    def forward(self, input_ids, positions, context, /, *, input_embeds=None, timestep=None, sequence_index=None):
        if input_embeds is None:
            raise ValueError("the action expert takes the noisy actions as input_embeds")
        t = timestep if timestep is not None else torch.zeros(1, device=input_embeds.device)
        rows = t.reshape(-1)[sequence_index] if sequence_index is not None else t.reshape(-1).expand(input_embeds.shape[0])
        x, cond = self.policy.expert_inputs(input_embeds, rows)
        return self.policy.expert(None, positions, context, input_embeds=x, cond=cond)

    def compute_velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.policy.action_out_proj(hidden)


def _qkv(attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
    t = x.shape[0]
    q, k, v = attn.qkv_proj(x).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    q = apply_rotary(q.view(t, attn.num_heads, attn.head_dim), *rope)
    k = apply_rotary(k.view(t, attn.num_kv_heads, attn.head_dim), *rope)
    return q, k, v.view(t, attn.num_kv_heads, attn.head_dim)


class Pi0Prefix(nn.Module):
    """pi0's `vlm` node: the language model for rows with routing 0, the expert for the state rows (routing 1).

    Both towers attend jointly layer by layer (one `context.attend` per layer over all rows); each row runs
    its own tower's norms, projections and MLP. Hidden states come back in the language model's width (state
    rows zero-padded); nothing reads them but the cache.
    """

    call_inputs = {"state": "token"}

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy
        self.config = policy.config.text

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.policy.language_model.embed(ids)

    def forward(self, input_ids, positions, context: AttentionContext, /, *, input_embeds=None, routing=None,
                state=None):
        lm, ex = self.policy.language_model, self.policy.expert
        x = lm.embed(input_ids) if input_embeds is None else input_embeds
        if routing is None or not bool((routing == 1).any()):
            return lm(None, positions, context, input_embeds=x)
        expert_rows = routing == 1
        ia, ib = (~expert_rows).nonzero().flatten(), expert_rows.nonzero().flatten()
        xa = x[ia]
        xb = self.policy.state_proj(state[ib].to(x.dtype))
        cos, sin = lm.rotary_emb(positions.reshape(-1))
        ropes = ((cos[ia], sin[ia]), (cos[ib], sin[ib]))
        t = x.shape[0]
        for la, lb in zip(lm.layers, ex.layers, strict=True):
            ha, _ = la.attention_input(xa)
            hb, _ = lb.attention_input(xb)
            (qa, ka, va), (qb, kb, vb) = _qkv(la.self_attn, ha, ropes[0]), _qkv(lb.self_attn, hb, ropes[1])
            q = qa.new_empty(t, *qa.shape[1:]).index_copy_(0, ia, qa).index_copy_(0, ib, qb)
            k = ka.new_empty(t, *ka.shape[1:]).index_copy_(0, ia, ka).index_copy_(0, ib, kb)
            v = va.new_empty(t, *va.shape[1:]).index_copy_(0, ia, va).index_copy_(0, ib, vb)
            out = context.attend(la.self_attn.layer_idx, q, k, v, la.self_attn.scale).reshape(t, -1)
            xa = la.finish(xa, la.self_attn.o_proj(out[ia]), None)
            xb = lb.finish(xb, lb.self_attn.o_proj(out[ib]), None)
        out = x.new_zeros(t, x.shape[1])
        out[ia] = lm.norm(xa)
        hb = ex.norm(xb)
        out[ib, : hb.shape[1]] = hb
        return out
