"""A dense, single-request run of the policy with the same modules the engines serve (tests and benchmarks).

The cache is core's `DenseKVCache`: a writing forward stores each layer's keys and values, a reading forward
attends to them plus its own rows (never stored).
"""

from __future__ import annotations

import torch

from mstar_core.nn.attention import DenseKVCache
from mstar_pi05.modeling import ActionExpert, Policy, PrefixWriter


@torch.inference_mode()
def write_prefix(policy: Policy, image_tokens: torch.Tensor, input_ids: torch.Tensor,
                 state: torch.Tensor | None = None) -> DenseKVCache:
    """Images `[n, P, W]` then text ids `[L]` as one bidirectional block (pi0: and the state token after it, in
    the same forward, seeing the block and itself), written by the node's own module."""
    lm = policy.language_model
    embeds = torch.cat([image_tokens.reshape(-1, image_tokens.shape[-1]), lm.embed(input_ids)])
    n = embeds.shape[0]
    routing = state_rows = None
    if not policy.config.pi05:
        embeds = torch.cat([embeds, embeds.new_zeros(1, embeds.shape[1])])
        routing = torch.zeros(n + 1, dtype=torch.long)
        routing[n] = 1
        state_rows = torch.zeros(n + 1, state.numel())
        state_rows[n] = state.reshape(-1)
    total = embeds.shape[0]
    cache = DenseKVCache(bidirectional=True)  # without a mask every row sees every other
    cache.mask = torch.ones(total, total, dtype=torch.bool)
    cache.mask[:n, n:] = False
    PrefixWriter(policy)(torch.zeros(total, dtype=torch.long), torch.arange(total), cache, input_embeds=embeds,
                         routing=routing, state=state_rows)
    return cache


@torch.inference_mode()
def velocity(policy: Policy, cache: DenseKVCache, actions: torch.Tensor, t: float) -> torch.Tensor:
    """One expert forward over the cached prefix: actions `[H, A]` at flow time `t` -> velocity `[H, A]`."""
    n, h = len(cache), actions.shape[0]
    cache.write, cache.mask = False, None  # the suffix sees everything: prefix and all of itself
    expert = ActionExpert(policy)
    hidden = expert(None, torch.arange(n, n + h), cache, input_embeds=actions,
                    timestep=torch.tensor([t], dtype=torch.float32), sequence_index=torch.zeros(h, dtype=torch.long))
    return expert.compute_velocity(hidden)


@torch.inference_mode()
def sample_actions(policy: Policy, image_tokens: torch.Tensor, input_ids: torch.Tensor, noise: torch.Tensor,
                   state: torch.Tensor | None = None, num_steps: int = 10) -> torch.Tensor:
    """Euler from t=1 to 0 in `num_steps` steps (dt = -1/num_steps), the prefix computed once."""
    cache = write_prefix(policy, image_tokens, input_ids, state)
    x, dt = noise, -1.0 / num_steps
    for step in range(num_steps):
        x = x + dt * velocity(policy, cache, x, 1.0 + step * dt)
    return x
