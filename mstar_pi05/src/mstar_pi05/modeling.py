"""pi0 / pi0.5 components, named as LeRobot's checkpoint names them, and the node modules built on them.

`Policy` holds every weight under the LeRobot names (`paligemma_with_expert.paligemma.model.*`,
`paligemma_with_expert.gemma_expert.model.*`, `action_in_proj`, ...). The graph's nodes wrap parts of it:

- `VisionEncoder` (stateless): SigLIP + projector, pixels -> image tokens in the language model's width;
- `PrefixWriter` (kvcache): the language model writing the prefix's keys and values (for pi0 also the
  continuous state token, through the expert's weights: routing id 1), and nothing else;
- `ActionExpert` (kvcache, read-only over the prefix's pages): noisy actions + flow time -> velocity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.gemma import AdaRMSNorm, GemmaDecoder
from mstar_core.nn.rotary import apply_rotary
from mstar_core.nn.siglip import SiglipVisionTransformer
from mstar_pi05.config import PolicyConfig
from mstar_pi05.split import policy_dimensions


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
        self._time_freqs: dict[torch.device, torch.Tensor] = {}  # the time features' frequencies, per device
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

    def time_features(self, t: torch.Tensor) -> torch.Tensor:
        """Sine-cosine features of flow times `t` `[S]` -> `[S, expert width]` (fp32), periods geometric from
        `min_period` to `max_period`; the frequencies are built once per device, not at every step."""
        freqs = self._time_freqs.get(t.device)
        if freqs is None:
            cfg = self.config
            fraction = torch.linspace(0.0, 1.0, cfg.expert.hidden_size // 2, dtype=torch.float32, device=t.device)
            freqs = self._time_freqs[t.device] = 2 * math.pi / (cfg.min_period * (cfg.max_period / cfg.min_period) ** fraction)
        angles = freqs[None, :] * t.float()[:, None]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    def expert_inputs(self, actions: torch.Tensor, t: torch.Tensor,
                      index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Noisy actions `[T, A]`, flow times `t` `[S]` and each row's sequence `index` `[T]` (None: `t` has one
        time per row) -> (expert input rows `[T, W]`, pi0.5's adaRMS conditioning `[S, W]` or None for pi0).

        The time features and pi0.5's time MLP run once per sequence, not once per action row."""
        dtype = self.action_in_proj.weight.dtype
        x = self.action_in_proj(actions.to(dtype))
        feats = self.time_features(t).to(dtype)
        if self.config.pi05:  # time conditions every norm; the action tokens carry no time
            return x, F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(feats))))
        feats = feats if index is None else feats[index]
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

    @property
    def tensor_parallel(self):
        """The policy's rank group when it was loaded split (`mstar_pi05.parallel`), else None."""
        return getattr(self.policy, "tensor_parallel", None)

    def kv_cache_spec(self):
        c = self.config
        group = self.tensor_parallel
        # this rank's KV heads (the prefix's pages it reads hold the VLM's heads split the same way): its share, or
        # the one head its query heads read where the ranks outnumber them (PaliGemma's single KV head)
        kv_heads = group.local_kv_heads(c.num_key_value_heads) if group is not None else c.num_key_value_heads
        return c.num_hidden_layers, kv_heads, c.head_dim, None, None  # inputs: actions, any width

    def tensor_parallel_dimensions(self, expert_parallel: bool = False) -> dict[str, int]:
        """The sizes a group must divide to split the VLM and the action expert together (`mstar_pi05.split`)."""
        return policy_dimensions(self.policy)

    def forward(self, input_ids, positions, context, /, *, input_embeds=None, timestep=None, sequence_index=None):
        if input_embeds is None:
            raise ValueError("the action expert takes the noisy actions as input_embeds")
        t = timestep.reshape(-1) if timestep is not None else torch.zeros(1, device=input_embeds.device)
        index = sequence_index if sequence_index is not None else \
            torch.zeros(input_embeds.shape[0], dtype=torch.long, device=input_embeds.device)
        x, cond = self.policy.expert_inputs(input_embeds, t, index)
        ex = self.policy.expert
        if cond is None:
            return ex(None, positions, context, input_embeds=x)
        # pi0.5: GemmaDecoder's layers with each adaRMS projection on one row per sequence (all of a sequence's
        # rows share its time), not on every row: at pi0.5's widths that projection is ~1/4 of a step's compute
        rope = ex.rotary_emb(positions.reshape(-1))
        for layer in ex.layers:
            h, gate = _modulated(layer.input_layernorm, x, cond, index)
            x = x + gate * layer.self_attn(h, rope, context)
            h, gate = _modulated(layer.post_attention_layernorm, x, cond, index)
            x = x + gate * layer.mlp(h)
        return _modulated(ex.norm, x, cond, index)[0]

    def compute_velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.policy.action_out_proj(hidden)


def _modulated(norm: AdaRMSNorm, x: torch.Tensor, cond: torch.Tensor, index: torch.Tensor):
    """`norm(x, cond[index])`, its projection `dense` applied to the `[S, W]` conditioning before the rows pick theirs."""
    scale, shift, gate = norm.dense(cond)[index].chunk(3, dim=-1)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (h * (1.0 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def _qkv(attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], queries: bool = True):
    """RoPE'd q, k, v of rows `x` (q None without `queries`: then only the key and value rows are projected)."""
    t = x.shape[0]
    if queries:
        q, k, v = attn.qkv_proj(x).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
        q = apply_rotary(q.view(t, attn.num_heads, attn.head_dim), *rope)
    else:
        bias = attn.qkv_proj.bias
        k, v = F.linear(x, attn.qkv_proj.weight[attn.q_size:], None if bias is None else bias[attn.q_size:]).split(
            attn.kv_size, dim=-1)
        q = None
    k = apply_rotary(k.view(t, attn.num_kv_heads, attn.head_dim), *rope)
    return q, k, v.view(t, attn.num_kv_heads, attn.head_dim)


class PrefixWriter(nn.Module):
    """The `vlm` node: writes the prefix's keys and values into the cache, layer by layer; outputs nothing.

    Only the keys and values are ever read (the expert attends to them), so the last layer projects keys and
    values alone: its queries, attention output, output projection, MLP and the final norm would only make hidden
    states nobody reads (openpi's jitted prefill drops them the same way, as dead code). The context stores keys
    and values as it attends, so that layer attends with its keys as one query head: the least attention that
    stores them. `forward` returns the residual stream before the last layer, which the node does not output.

    pi0: rows with routing id 1 (the continuous state token) run the expert's norms, projections and MLP and
    attend jointly with the language model's rows (one `context.attend` per layer over all rows). Its keys and
    values do not depend on the flow time, so the state token is written once here, in the prefix's own call,
    instead of at every step. The language model also runs over the state rows (their values are replaced by
    the expert's before attention and never read): no gather or scatter of the other rows.
    """

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy
        self.config = policy.config.text
        if not policy.config.pi05:
            self.call_inputs = {"state": "token"}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.policy.language_model.embed(ids)

    @property
    def tensor_parallel(self):
        """The policy's rank group when it was loaded split (`mstar_pi05.parallel`), else None."""
        return getattr(self.policy, "tensor_parallel", None)

    def tensor_parallel_dimensions(self, expert_parallel: bool = False) -> dict[str, int]:
        """The sizes a group must divide to split the VLM and the action expert together (`mstar_pi05.split`)."""
        return policy_dimensions(self.policy)

    def forward(self, input_ids, positions, context: AttentionContext, /, *, input_embeds=None, routing=None,
                state=None):
        lm, ex = self.policy.language_model, self.policy.expert
        x = lm.embed(input_ids) if input_embeds is None else input_embeds
        rope = lm.rotary_emb(positions.reshape(-1))
        ib = None if routing is None else (routing == 1).nonzero().flatten()
        if ib is not None and ib.numel() == 0:
            ib = None
        if ib is not None:
            xb = self.policy.state_proj(state[ib].to(x.dtype))
            rope_b = (rope[0][ib], rope[1][ib])
        t, last = x.shape[0], len(lm.layers) - 1
        for i, (la, lb) in enumerate(zip(lm.layers, ex.layers, strict=True)):
            attn, queries = la.self_attn, i < last
            q, k, v = _qkv(attn, la.attention_input(x)[0], rope, queries)
            if ib is not None:  # the state rows' projections replace the language model's
                qb, kb, vb = _qkv(lb.self_attn, lb.attention_input(xb)[0], rope_b, queries)
                k.index_copy_(0, ib, kb)
                v = v.index_copy(0, ib, vb)
                if queries:
                    q.index_copy_(0, ib, qb)
            if not queries:  # the last layer: store its keys and values, nothing more (see above)
                context.attend(attn.layer_idx, k, k, v, attn.scale)
                break
            out = context.attend(attn.layer_idx, q, k, v, attn.scale).reshape(t, -1)
            x = la.finish(x, attn.o_proj(out), None)
            if ib is not None:
                xb = lb.finish(xb, lb.self_attn.o_proj(out[ib]), None)
        return x
