"""A tiny flow-matching DiT and the two ways a walk runs a denoising loop on the `diffusion` engine.

Both walks start with an `init` node (noise from the request's seed) and keep the loop visible:

    # (a) the DiT is the diffusion node's own module: one node call per step
    Sequential("noise",
               Loop(body=NodeCall("denoise", inputs={"step": "loop_index"}), iters="num_steps"))

    # (b) another node computes the velocity (here on the stateless engine; BAGEL's LLM or pi0.5's
    #     expert on kvcache), the diffusion node only applies guidance and the Euler update
    Sequential("noise",
               Loop(body=Sequential(
                        NodeCall("velocity_model"),                          # cond
                        NodeCall("velocity_model", inputs={"context": "context_uncond"},
                                 outputs={"velocity": "velocity_uncond"}),     # uncond
                        NodeCall("euler", inputs={"step": "loop_index"})),
                    iters="num_steps"))

The latents, and the `timestep` the velocity node reads, flow through the env under their own
names, so each iteration reads what the previous one wrote without a `carry`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mstar_core.graph import Graph, GraphNode, Loop, NodeCall, Parallel, Sequential, Walk

SETTINGS = ("seed", "shift", "guidance_scale", "cfg_interval", "cfg_renorm", "cfg_renorm_min")


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of `t` `[B]` -> `[B, dim]`."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.to(torch.float32)[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class _Block(nn.Module):
    """Self-attention + MLP over latent tokens, each modulated (scale, shift, gate) by the conditioning (adaLN)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(approximate="tanh"), nn.Linear(2 * hidden, hidden))
        self.ada = nn.Linear(hidden, 6 * hidden)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        s1, b1, g1, s2, b2, g2 = self.ada(nn.functional.silu(c))[:, None].chunk(6, dim=-1)
        q, k, v = self.qkv(self.norm1(h) * (1 + s1) + b1).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = h + g1 * self.proj(a.transpose(1, 2).reshape(b, n, d))
        return h + g2 * self.mlp(self.norm2(h) * (1 + s2) + b2)


class TinyFlowDiT(nn.Module):
    """A few DiT blocks over `[C, H, W]` latents (one token per position), conditioned on `context` `[L, Dc]`.

    Meets `DenoiserModule`: `forward(x [B, C, H, W], t [B], *, context [B, L, Dc]) -> v [B, C, H, W]`.
    Weights are seeded random: the output is noise, what matters is that every path computes the same.
    """

    def __init__(self, channels: int = 4, hidden: int = 32, layers: int = 2, heads: int = 2, context_dim: int = 8,
                 seed: int = 0):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.hidden = hidden
        self.inp = nn.Linear(channels, hidden)
        self.time = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.ctx = nn.Linear(context_dim, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.out = nn.Linear(hidden, channels)
        torch.random.set_rng_state(generator_state)

    def forward(self, x: torch.Tensor, t: torch.Tensor, /, *, context: torch.Tensor) -> torch.Tensor:
        b, c, hgt, wid = x.shape
        h = self.inp(x.flatten(2).transpose(1, 2))
        cond = self.time(timestep_embedding(t, self.hidden)) + self.ctx(context).mean(dim=1)
        for block in self.blocks:
            h = block(h, cond)
        return self.out(h).transpose(1, 2).reshape(b, c, hgt, wid)


class VelocityModel(nn.Module):
    """The same DiT as a separate node (on the `stateless` engine): it reads the env's latents and timestep."""

    def __init__(self, dit: TinyFlowDiT):
        super().__init__()
        self.dit = dit

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.dit(latents, timestep, context=context)


def _noise_node(channels: int, schedule: str, timestep_scale: float) -> GraphNode:
    return GraphNode(
        "noise", engine="diffusion", inputs=("num_steps", "latent_shape"), optional_inputs=("seed", "shift"),
        outputs=("latents", "timestep", "seed"),
        options={"role": "init", "schedule": schedule, "timestep_scale": timestep_scale,
                 "latent_shape": (channels, None, None)},
    )


def dit_graph(dit: TinyFlowDiT, *, schedule: str = "diffusers_flow_match_euler", timestep_scale: float = 1000.0,
              name: str = "tiny-dit") -> Graph:
    """Use (a): the diffusion node runs the DiT itself; guidance rows of every request share its forwards."""
    channels = dit.out.out_features
    denoise = GraphNode(
        "denoise", engine="diffusion", inputs=("latents", "step", "num_steps", "context"),
        optional_inputs=("context_uncond", *SETTINGS[1:]), outputs=("latents", "timestep"), module=lambda: dit,
        options={"schedule": schedule, "timestep_scale": timestep_scale, "latent_shape": (channels, None, None),
                 "uncond_inputs": {"context": "context_uncond"}},
    )
    walk = Walk(
        name="generate",
        body=Sequential(
            "noise",
            Loop(body=NodeCall("denoise", inputs={"step": "loop_index"}), iters="num_steps"),
        ),
        inputs=("num_steps", "latent_shape", "context"),
        optional_inputs=("context_uncond", *SETTINGS),
        outputs=("latents", "seed"),
        description="noise from the seed, then num_steps Euler steps of the DiT (batched across requests)",
    )
    return Graph.build(name, [_noise_node(channels, schedule, timestep_scale), denoise], [walk])


def velocity_graph(dit: TinyFlowDiT, *, schedule: str = "diffusers_flow_match_euler",
                   timestep_scale: float = 1000.0, name: str = "tiny-dit-velocity") -> Graph:
    """Use (b): a separate node computes the cond and uncond velocities; the diffusion node guides and steps."""
    channels = dit.out.out_features
    velocity = GraphNode("velocity_model", engine="stateless", inputs=("latents", "timestep", "context"),
                         outputs=("velocity",), module=lambda: VelocityModel(dit))
    euler = GraphNode(
        "euler", engine="diffusion",
        inputs=("latents", "step", "num_steps", "velocity"),
        optional_inputs=("velocity_uncond", *SETTINGS[1:]), outputs=("latents", "timestep"),
        options={"schedule": schedule, "timestep_scale": timestep_scale, "latent_shape": (channels, None, None)},
    )
    walk = Walk(
        name="generate",
        body=Sequential(
            "noise",
            Loop(
                body=Sequential(
                    Parallel(  # cond and uncond velocities side by side (batched into one step when they meet)
                        NodeCall("velocity_model"),
                        NodeCall("velocity_model", inputs={"context": "context_uncond"},
                                 outputs={"velocity": "velocity_uncond"}),
                    ),
                    NodeCall("euler", inputs={"step": "loop_index"}),
                ),
                iters="num_steps",
            ),
        ),
        inputs=("num_steps", "latent_shape", "context", "context_uncond"),
        optional_inputs=SETTINGS,
        outputs=("latents", "seed"),
        description="noise, then per step: cond and uncond velocities from another node, guidance and the Euler update",
    )
    return Graph.build(name, [_noise_node(channels, schedule, timestep_scale), velocity, euler], [walk])
