"""pi0 / pi0.5 as a Walk Graph:

    prefix:  vision(cameras) -> vlm(image rows + prompt ids, one bidirectional block, written to the cache;
             pi0: + the state token on the expert's weights in the same call, seeing the block and itself)
    act:     noise(seed) -> Loop(num_steps){ expert(actions, t) read-only over vlm's pages -> euler }
             -> finish (unnormalise, slice to horizon x action_dim)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mstar_core.errors import RequestError
from mstar_core.graph import FromEnv, Graph, GraphNode, Loop, NodeCall, Sequential, Walk
from mstar_pi05.modeling import ActionExpert, Policy, PrefixWriter, VisionEncoder

WALKS = ("prefix", "act")


class BatchedVision(VisionEncoder):
    """Stateless node module: cameras `[n, 3, S, S]` (stacked `[B, n, 3, S, S]`) -> image rows `[n * P, W]` per call."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        lead = pixels.shape[:-3]
        tokens = self.policy.encode_images(pixels.reshape(-1, *pixels.shape[-3:]))
        return tokens.reshape(*lead[:-1], lead[-1] * tokens.shape[1], tokens.shape[2])


class Finish:
    """Function node: final latents `[H, A]` -> actions `[H, action_dim]` in the robot's units."""

    def __init__(self, unnormalize: Callable[[torch.Tensor], torch.Tensor]):
        self.unnormalize = unnormalize

    def __call__(self, latents: torch.Tensor, action_dim: int) -> torch.Tensor:
        with torch.no_grad():
            actions = self.unnormalize(latents.float().cpu())[:, :action_dim]
        if not torch.isfinite(actions).all():  # actions drive a robot: a NaN must fail the request, never reach it
            bad = int((~torch.isfinite(actions)).sum())
            raise RequestError(f"the policy produced {bad} non-finite action values (NaN or Inf); none are returned",
                               status=500)
        return actions


def build_graph(policy: Policy, unnormalize: Callable[[torch.Tensor], torch.Tensor], name: str) -> Graph:
    cfg = policy.config
    vlm_optional = ("input_embeds", "embeds_at") if cfg.pi05 else ("input_embeds", "embeds_at", "routing", "state")
    nodes = [
        GraphNode("vision", inputs="pixels", outputs="image_rows", engine="stateless",
                  module=lambda: BatchedVision(policy)),
        # outputs nothing: the expert reads its keys and values (see PrefixWriter)
        GraphNode("vlm", inputs=("input_ids",), optional_inputs=vlm_optional, outputs=(), engine="kvcache",
                  module=lambda: PrefixWriter(policy)),
        GraphNode("noise", engine="diffusion", inputs=("num_steps", "latent_shape"), optional_inputs=("seed",),
                  outputs=("latents", "timestep"),
                  options={"role": "init", "schedule": "flow_euler", "latent_shape": (None, cfg.max_action_dim),
                           "max_steps": 100, "inline": True}),
        GraphNode("expert", inputs=("input_embeds", "timestep"), outputs=("velocity",), engine="kvcache",
                  module=lambda: ActionExpert(policy), options={"share_cache_with": "vlm"}),
        GraphNode("euler", engine="diffusion", inputs=("latents", "step", "num_steps", "velocity"),
                  outputs=("latents", "timestep"),
                  options={"schedule": "flow_euler", "latent_shape": (None, cfg.max_action_dim), "max_steps": 100,
                           # a [H, 32] axpy: on the event loop, not a round trip through the device thread per step
                           "inline": True}),
        GraphNode("finish", inputs=("latents", "action_dim"), outputs="actions", engine="function",
                  module=lambda: Finish(unnormalize), options={"inline": True}),
    ]
    inputs = {"input_ids": "prefix_ids", "input_embeds": "image_rows", "embeds_at": "image_at"}
    prefix_inputs = ("pixels", "prefix_ids", "image_at")
    if cfg.pi05:
        prefix_call = NodeCall("vlm", inputs=inputs, options={"bidirectional": True, "output_rows": "last"})
    else:
        # pi0's state token rides in the same call, routed to the expert's weights. Its mask as frames of the
        # prefix's length: the prefix is frame 0 and sees itself; the state token opens frame 1 and sees all.
        inputs.update(input_ids="prefix_state_ids", routing="prefix_routing", state="prefix_state")
        prefix_call = NodeCall("vlm", inputs=inputs,
                               options={"frame_size": FromEnv("prefix_length"), "output_rows": "last"})
        prefix_inputs = ("pixels", "prefix_state_ids", "image_at", "prefix_routing", "prefix_state", "prefix_length")
    prefix = Walk(
        name="prefix", body=Sequential(NodeCall("vision"), prefix_call), inputs=prefix_inputs, outputs=(),
        description="cameras through SigLIP, then images + prompt as one bidirectional block into the VLM's cache",
    )
    act = Walk(
        name="act",
        body=Sequential(
            "noise",
            Loop(body=Sequential(
                NodeCall("expert", inputs={"input_embeds": "latents"},
                         options={"write_cache": False, "bidirectional": True}),
                NodeCall("euler", inputs={"step": "loop_index"}),
            ), iters="num_steps"),
            "finish",
        ),
        inputs=("num_steps", "latent_shape", "action_dim"),
        optional_inputs=("seed",),
        outputs=("actions",),
        description="noise, then num_steps Euler steps of the expert over the cached prefix, then unnormalise",
    )
    return Graph.build(name, nodes, [prefix, act], plan=lambda env: list(WALKS))
