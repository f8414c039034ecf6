"""Wan2.2 TI2V as a Walk Graph:

    t2v:  (text_encoder(prompt) || text_encoder(negative prompt))
          -> noise -> Loop(num_steps){ denoise }                       [one DiT forward: cond + uncond rows]
          -> Loop(decode_chunks){ vae_decode (chunk, its conv cache carried) }  [each chunk's frames emitted]
          -> join
    i2v:  the same, with encode_image(first frame) beside the text: the DiT sees it as latent frame 0 (at t = 0)
          and the decode replaces frame 0 with it

`denoise` is a DiT step node of the `diffusion` engine: it stacks every request's CFG branches (the negative
prompt's context swapped in) into one forward, and takes a UniPC step per request; the solver's two-step
history travels with the request (`solver_history`), as the VAE's conv cache does (`vae_cache`) and, when the
engine setting `step_cache_threshold` turns it on, the DiT's cached block residuals (`step_cache`).
"""

from __future__ import annotations

from mstar_core.graph import Graph, GraphNode, Loop, NodeCall, Parallel, Sequential, Walk
from mstar_wan.nodes import DecodeChunkNode, EncodeImageNode, join_frames
from mstar_wan.prepare import MAX_STEPS
from mstar_wan.text_encoder import TextEncoderNode, UMT5Encoder
from mstar_wan.transformer import WanTransformer
from mstar_wan.vae import WanVAE

WALKS = ("t2v", "i2v")
SETTINGS = ("num_steps", "latent_shape")
OPTIONAL = ("seed", "shift", "guidance_scale")


def diffusion_options(z_dim: int, shift: float, num_train_timesteps: int) -> dict:
    """The scheduler of the checkpoint's `scheduler/`: UniPC over flow sigmas, integer timesteps (sigma x T)."""
    return {"schedule": "unipc_flow", "timestep_scale": float(num_train_timesteps), "integer_timesteps": True,
            "latent_shape": (z_dim, None, None, None), "max_steps": MAX_STEPS, "shift": shift,
            "max_latent_numel": 2**26}


def _text() -> Parallel:
    return Parallel(NodeCall("text_encoder", inputs={"input_ids": "prompt_ids"}, outputs={"context": "context"}),
                    NodeCall("text_encoder", inputs={"input_ids": "negative_ids"},
                             outputs={"context": "negative_context"}))


def _generate() -> tuple:
    return (
        NodeCall("noise"),
        Loop(body=NodeCall("denoise", inputs={"step": "loop_index"}), iters="num_steps"),
        Loop(body=NodeCall("vae_decode", inputs={"chunk": "loop_index"}), iters="decode_chunks",
             accumulate={"frames": "video_chunks"}),
        NodeCall("join"),
    )


def build_graph(dit: WanTransformer, vae: WanVAE, text: UMT5Encoder, *, max_sequence_length: int, shift: float,
                num_train_timesteps: int, decode_chunk_frames: int, name: str = "wan") -> Graph:
    options = diffusion_options(vae.config.z_dim, shift, num_train_timesteps)
    nodes = [
        GraphNode("text_encoder", inputs=("input_ids",), outputs=("context",), engine="stateless",
                  module=lambda: TextEncoderNode(text, max_sequence_length)),
        GraphNode("encode_image", inputs=("image",), outputs=("condition",), engine="stateless",
                  module=lambda: EncodeImageNode(vae)),
        GraphNode("noise", inputs=SETTINGS, optional_inputs=("seed", "shift"), outputs=("latents", "seed"),
                  engine="diffusion", options={"role": "init", **options}),
        GraphNode("denoise", inputs=("latents", "step", "num_steps", "context", "negative_context"),
                  optional_inputs=("shift", "guidance_scale", "condition", "solver_history", "step_cache"),
                  outputs=("latents", "solver_history", "step_cache", "sigma"), engine="diffusion", module=lambda: dit,
                  options={**options, "solver": "unipc", "uncond_inputs": {"context": "negative_context"}}),
        GraphNode("vae_decode", inputs=("latents", "chunk"), optional_inputs=("vae_cache", "condition"),
                  outputs=("frames", "vae_cache"), engine="stateless",
                  module=lambda: DecodeChunkNode(vae, decode_chunk_frames)),
        GraphNode("join", inputs=("video_chunks",), outputs=("video",), engine="function", module=lambda: join_frames),
    ]
    inputs = ("prompt_ids", "negative_ids", *SETTINGS, "decode_chunks")
    t2v = Walk(name="t2v", body=Sequential(_text(), *_generate()), inputs=inputs, optional_inputs=OPTIONAL,
               outputs=("video", "seed"), emit=("sigma", "frames"),
               description="the prompts through UMT5, the UniPC flow loop (CFG rows in one DiT forward), the VAE "
                           "decode chunk by chunk")
    i2v = Walk(name="i2v", body=Sequential(Parallel(_text(), NodeCall("encode_image")), *_generate()),
               inputs=(*inputs, "image"), optional_inputs=OPTIONAL, outputs=("video", "seed"), emit=("sigma", "frames"),
               description="t2v conditioned on a first frame: its latents are frame 0 at t = 0, then in the decode")
    return Graph.build(name, nodes, [t2v, i2v], plan=_plan)


def _plan(env) -> list[str]:
    return [env["walk"]]
