"""Model specs: `vjepa2` (encode, predict) and `vjepa2-ac` (encode, rollout, plan), graphs and input checks.

Frame inputs (`video`, `frames`, `goal`) are either model-ready float frames `[T, C, crop, crop]`, or, with
`"preprocess": true` (the default for uint8 tensors/arrays), raw pixels 0..255 `[T, H, W, C]` / `[T, C, H, W]`
of any size that get HF `VJEPA2VideoProcessor`'s preprocessing (`mstar_vjepa.preprocess`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_core.checkpoint.presets import ensure_preset
from mstar_core.errors import RequestError
from mstar_core.graph import (
    DynamicLoop,
    FromEnv,
    Graph,
    GraphNode,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    Walk,
)
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_core.sampling import check_int, check_seed
from mstar_vjepa import checkpoint as ckpt
from mstar_vjepa.ac_predictor import PagedACPredictor
from mstar_vjepa.nodes import (
    PREFIX_LABEL,
    ROLLOUT_LABEL,
    SAMPLE_LABEL,
    FrameEncoderNode,
    MaskedPredictorNode,
    PlanStartNode,
    StepTokensNode,
    VideoEncoderNode,
    result_node,
    sample_node,
    update_node,
)
from mstar_vjepa.preprocess import preprocess_video

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_tensor(inputs: Mapping[str, Any], name: str, what: str) -> torch.Tensor:
    """`inputs[name]` as a tensor; ragged or non-numeric lists and ints beyond int64 are the request's fault."""
    try:
        return torch.as_tensor(inputs[name])
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise RequestError(f"input '{name}' is not a numeric array ({str(exc)[:120]}); expected {what}",
                           param=name) from None


def _tensor(inputs: Mapping[str, Any], name: str, ndims: tuple[int, ...], what: str) -> torch.Tensor:
    if name not in inputs:
        raise RequestError(f"missing input '{name}': {what}")
    t = _as_tensor(inputs, name, what)
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise RequestError(f"input '{name}' has dtype {t.dtype}; expected a float array: {what}")
    if t.dim() not in ndims:
        raise RequestError(f"input '{name}' has shape {tuple(t.shape)}; expected {what}")
    return t.float()


def _int(inputs: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = inputs.get(name, default)
    return check_int(value, name, lo, hi)


def _wants_preprocess(inputs: Mapping[str, Any], name: str) -> bool:
    """`preprocess` if given (a bool), else on exactly when the frames arrive as a uint8 tensor or array."""
    flag = inputs.get("preprocess")
    if flag is not None:
        if not isinstance(flag, bool):
            raise RequestError(f"input 'preprocess' must be true or false, got {flag!r}")
        return flag
    dtype = getattr(inputs.get(name), "dtype", None)
    return dtype == torch.uint8 or str(dtype) == "uint8"  # a torch tensor or a numpy array


def _pixel_frames(inputs, name, cfg) -> torch.Tensor:
    """Raw pixels (0..255) of any size, `[T, H, W, C]` or `[T, C, H, W]`, through the HF/upstream preprocessing."""
    what = f"pixel frames (0..255) [T, H, W, {cfg.in_chans}] or [T, {cfg.in_chans}, H, W], any size"
    if name not in inputs:
        raise RequestError(f"missing input '{name}': {what}")
    t = _as_tensor(inputs, name, what)
    if t.dtype == torch.bool or t.is_complex() or t.dim() not in (3, 4) or t.numel() == 0:
        raise RequestError(f"input '{name}' has shape {tuple(t.shape)} and dtype {t.dtype}; expected {what}")
    if not t.is_floating_point():
        if t.min() < 0 or t.max() > 255:
            raise RequestError(f"input '{name}' has pixel values outside 0..255; expected {what}")
        t = t.to(torch.uint8)
    try:
        return preprocess_video(t[None] if t.dim() == 3 else t, cfg.crop_size, cfg.in_chans)
    except ValueError as exc:
        raise RequestError(f"input '{name}': {exc}") from None


def _frames(inputs, name, cfg) -> torch.Tensor:
    if _wants_preprocess(inputs, name):
        return _pixel_frames(inputs, name, cfg)
    what = (f"float frames [T, {cfg.in_chans}, {cfg.crop_size}, {cfg.crop_size}] (or pixel frames of any size "
            "with 'preprocess': true)")
    t = _tensor(inputs, name, (3, 4), what)
    t = t[None] if t.dim() == 3 else t
    if tuple(t.shape[1:]) != (cfg.in_chans, cfg.crop_size, cfg.crop_size) or t.shape[0] < 1:
        raise RequestError(f"input '{name}' has shape {tuple(t.shape)}; expected {what}")
    return t


def _pick_walk(inputs, graph: Graph, default: str) -> str:
    walk = inputs.get("walk", default)
    if walk not in graph.walks:
        raise RequestError(f"input 'walk' must be one of {sorted(graph.walks)}, got {walk!r}")
    return walk


# -- vjepa2: HF encoder + masked predictor -------------------------------------------------------


def _hf_graph(model) -> Graph:
    nodes = [
        GraphNode("encoder", inputs="video", outputs="latents", engine="function",
                  module=lambda: VideoEncoderNode(model)),
        GraphNode("predictor", inputs="latents", outputs="predicted", optional_inputs=("context_mask", "target_mask"),
                  engine="function", module=lambda: MaskedPredictorNode(model)),
    ]
    walks = [
        Walk(name="encode", body="encoder", inputs="video", outputs="latents", description="video -> patch latents"),
        Walk(name="predict", body=Sequential("encoder", "predictor"), inputs="video", outputs=("latents", "predicted"),
             optional_inputs=("context_mask", "target_mask"),
             description="encode, then predict the target positions from the context positions"),
    ]
    return Graph.build("vjepa2", nodes, walks, plan=lambda env: [env["walk"]])


def load_vjepa2(options: LoadOptions) -> LoadedModel:
    """Load a HF `facebook/vjepa2-*` checkpoint, or the `tiny` preset written in that layout."""
    directory, random = _resolve(options, "vjepa2-tiny", ckpt.write_hf_preset, "config.json")
    model = ckpt.load_hf(directory, options.device, _DTYPES.get(options.dtype or "float32"))
    graph = _hf_graph(model)
    cfg = model.cfg

    def prepare(inputs: Mapping[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = {"walk": _pick_walk(inputs, graph, "encode"), "video": _frames(inputs, "video", cfg)}
        n = (max(env["video"].shape[0], cfg.tubelet_size) // cfg.tubelet_size) * cfg.grid_size**2
        for name in ("context_mask", "target_mask"):
            if name in inputs:
                idx = _as_tensor(inputs, name, "a 1-D list of token indices")
                if idx.dim() != 1 or idx.is_floating_point() or idx.numel() == 0 or idx.min() < 0 or idx.max() >= n:
                    raise RequestError(f"input '{name}' must be a non-empty 1-D list of token indices in [0, {n})")
                env[name] = idx.long()
        if ("context_mask" in env) != ("target_mask" in env):
            raise RequestError("pass both 'context_mask' and 'target_mask', or neither (full coverage)")
        return env

    return LoadedModel("vjepa2", graph, random_weights=random, prepare=prepare, extras={"config": cfg})


# -- vjepa2-ac: encoder + action-conditioned predictor --------------------------------------------


def _ac_graph(encoder, predictor) -> Graph:
    tps = predictor.tokens_per_step
    nodes = [
        GraphNode("encoder", inputs="frames", outputs="latents", engine="function",
                  module=lambda: FrameEncoderNode(encoder)),
        # frame-causal: a token sees its own time step and every earlier one
        GraphNode("ac_predictor", inputs=("input_embeds", "positions"), optional_inputs=("output_index",),
                  outputs="latent", engine="kvcache", module=lambda: PagedACPredictor(predictor),
                  options={"frame_size": tps}),
        *(GraphNode(name, inputs=("context", "states", "actions", "step", "horizon", *more),
                    optional_inputs=("latent", "state"), engine="function", module=lambda: StepTokensNode(predictor),
                    outputs=("step_embeds", "step_positions", "step_rows", "state", "drop_label"))
          for name, more in (("rollout_step", ()), ("sample_step", ("sample", "prefix_frames")))),
        GraphNode("cem_start", inputs=("context", "states", "horizon", "cem", "seed"),
                  outputs=("cem_stats", "cem_rng", "prefix_calls", "prefix_label", "prefix_frames", "prefix_embeds",
                           "prefix_positions", "prefix_rows"), engine="function", module=lambda: PlanStartNode(predictor)),
        GraphNode("cem_sample", inputs=("cem_stats", "cem", "cem_rng"), outputs=("sampled", "actions", "cem_rng"),
                  engine="function", module=lambda: sample_node),
        GraphNode("cem_update", inputs=("cem_stats", "cem", "sampled", "finals", "goal_latents"), outputs="cem_stats",
                  engine="function", module=lambda: update_node),
        GraphNode("cem_result", inputs="cem_stats", outputs=("plan", "costs", "best_actions", "best_cost"),
                  engine="function", module=lambda: result_node),
    ]
    encode_ctx = NodeCall("encoder", outputs={"latents": "context"})
    step_inputs = {"input_embeds": "step_embeds", "positions": "step_positions", "output_index": "step_rows"}
    # each sample's cache label is a fork of the context prefix, chosen from its fan-out index; dropped after its
    # last step, so the next iteration forks afresh
    sample_step = NodeCall("ac_predictor", inputs=step_inputs, options={
        "cache_label": FromEnv("sample", SAMPLE_LABEL), "fork_from": FromEnv("prefix_label"),
        "drop": FromEnv("drop_label")})
    prefix = NodeCall("ac_predictor", inputs={"input_embeds": "prefix_embeds", "positions": "prefix_positions",
                                              "output_index": "prefix_rows"},
                      outputs={"latent": "prefix_latent"}, options={"cache_label": PREFIX_LABEL})
    walks = [
        Walk(name="encode", body="encoder", inputs="frames", outputs="latents", description="frames -> latents"),
        Walk(
            name="rollout",
            body=Sequential(encode_ctx, DynamicLoop(
                body=Sequential("rollout_step", NodeCall("ac_predictor", inputs=step_inputs, options={
                    "cache_label": ROLLOUT_LABEL, "drop": FromEnv("drop_label")})),
                until=lambda env: env["step"] + 1 >= env["horizon"], max_iters="horizon",
                accumulate=("latent", "state"), index_name="step",
            )),
            inputs=("frames", "states", "actions", "horizon"), outputs=("latent", "state"), emit=("latent",),
            description="encode the context once, then one cached predictor call per horizon step",
        ),
        Walk(
            name="plan",
            body=Sequential(
                encode_ctx, NodeCall("encoder", inputs={"frames": "goal"}, outputs={"latents": "goal_latents"}),
                "cem_start", Loop(body=prefix, iters="prefix_calls", index_name="prefix_call"),
                Loop(body=Sequential(
                    "cem_sample",
                    Parallel(Loop(body=Sequential("sample_step", sample_step), iters="horizon", index_name="step"),
                             count="samples", index_name="sample", collect={"latent": "finals"}),
                    "cem_update",
                ), iters="iterations", index_name="iteration"),
                "cem_result",
            ),
            inputs=("frames", "states", "goal", "horizon", "cem", "samples", "iterations", "seed"),
            outputs=("plan", "costs", "best_actions"),
            description="CEM: per iteration, sample action sequences, roll each out on a fork of the context's "
                        "cache, score by L1 to the goal latent, refit mean/std from the elites",
        ),
    ]
    return Graph.build("vjepa2-ac", nodes, walks, plan=lambda env: [env["walk"]])


def load_vjepa2_ac(options: LoadOptions) -> LoadedModel:
    """Load upstream's AC `.pt` checkpoint, or the `tiny` preset written in that layout."""
    directory, random = _resolve(options, "vjepa2-ac-tiny", ckpt.write_ac_preset, ckpt.AC_FILE)
    encoder, predictor = ckpt.load_ac(directory, options.device, _DTYPES.get(options.dtype or "float32"))
    graph = _ac_graph(encoder, predictor)
    ecfg, pcfg = encoder.cfg, predictor.cfg
    tps = predictor.tokens_per_step
    # a page holds one time step (forked samples never share a partial page); every sample's step in one forward
    settings = {"ac_predictor": {"page_size": tps, "num_pages": 8 * pcfg.max_frames, "max_num_seqs": 512,
                                 "max_num_batched_tokens": 128 * tps, "enable_prefix_caching": False}}
    return LoadedModel("vjepa2-ac", graph, random_weights=random, prepare=lambda raw: prepare_ac(raw, graph, ecfg, pcfg),
                       engine_settings=settings, extras={"encoder_config": ecfg, "predictor_config": pcfg})


def prepare_ac(inputs: Mapping[str, Any], graph: Graph, ecfg, pcfg) -> dict[str, Any]:
    """Validate an AC request; the walk defaults to `plan` with a goal, `rollout` with actions, else `encode`."""
    default = "plan" if "goal" in inputs else "rollout" if "actions" in inputs else "encode"
    walk = _pick_walk(inputs, graph, default)
    env: dict[str, Any] = {"walk": walk, "frames": _frames(inputs, "frames", ecfg)}
    if walk == "encode":
        return env
    n_ctx = env["frames"].shape[0]
    states = _tensor(inputs, "states", (1, 2), f"states [7] or [{n_ctx}, 7] (xyz, euler xyz, gripper)")
    states = states[None] if states.dim() == 1 else states
    if tuple(states.shape) != (n_ctx, 7):
        raise RequestError(f"input 'states' has shape {tuple(states.shape)}; expected [{n_ctx}, 7], one per frame")
    env["states"] = states
    max_h = pcfg.max_frames - n_ctx + 1
    if max_h < 1:
        raise RequestError(f"input 'frames' has {n_ctx} frames; at most {pcfg.max_frames} fit the predictor's mask")
    if walk == "rollout":
        actions = _tensor(inputs, "actions", (2,), "actions [H, 7]")
        if actions.shape[1] != 7 or not 1 <= actions.shape[0] <= max_h:
            raise RequestError(f"input 'actions' has shape {tuple(actions.shape)}; expected [H, 7] with 1 <= H <= {max_h}")
        env.update(actions=actions, horizon=actions.shape[0])
        return env
    env["goal"] = _frames(inputs, "goal", ecfg)[-1:]
    env["horizon"] = _int(inputs, "horizon", 1, 1, max_h)
    samples = _int(inputs, "samples", 64, 1, 4096)
    env["cem"] = {"samples": samples, "topk": _int(inputs, "topk", min(10, samples), 1, samples),
                  "iterations": _int(inputs, "iterations", 10, 1, 1000)}
    env.update(samples=samples, iterations=env["cem"]["iterations"])
    env["seed"] = check_seed(inputs.get("seed", 0))
    return env


def _resolve(options: LoadOptions, preset_name: str, writer, marker: str):
    """The checkpoint directory to load, writing the preset (seeded random weights) on first use."""
    if options.checkpoint is not None:
        return options.checkpoint, False
    if options.preset not in (None, "tiny", preset_name):
        raise RequestError(f"unknown preset {options.preset!r}; this model has 'tiny' ({preset_name})")
    return ensure_preset(preset_name, marker, writer), True


SPECS = (
    ModelSpec("vjepa2", load_vjepa2, presets=("tiny",), description="V-JEPA 2 video encoder + masked predictor"),
    ModelSpec("vjepa2-ac", load_vjepa2_ac, presets=("tiny",),
              description="V-JEPA 2-AC world model: cached rollouts and CEM planning"),
)
