"""Model specs: `vjepa2` (encode, predict) and `vjepa2-ac` (encode, rollout, plan) and their graphs.

Request fields and their checks: `mstar_vjepa.request`.
"""

from __future__ import annotations

from mstar_core.checkpoint.presets import ensure_preset
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
from mstar_vjepa import checkpoint as ckpt
from mstar_vjepa import request
from mstar_vjepa.ac_predictor import PagedACPredictor
from mstar_vjepa.nodes import (
    PREFIX_LABEL,
    SAMPLE_LABEL,
    FrameEncoderNode,
    MaskedPredictorNode,
    PlanStartNode,
    StepTokensNode,
    VideoEncoderNode,
    sample_node,
    update_node,
)
from mstar_vjepa.planner import cem_plan

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
    directory, random = _resolve(options, "vjepa2", "vjepa2-tiny", ckpt.write_hf_preset, "config.json")
    model = ckpt.load_hf(directory, options.device, options.torch_dtype("vjepa2"))
    graph = _hf_graph(model)
    cfg = model.cfg

    return LoadedModel("vjepa2", graph, random_weights=random, prepare=lambda inputs: request.prepare_hf(inputs, cfg),
                       request_schema=request.hf_schema(), extras={"config": cfg})


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
          for name, more in (("rollout_step", ()), ("sample_step", ("sample",)))),
        GraphNode("cem_start", inputs=("context", "states", "horizon", "cem", "seed"),
                  outputs=("cem_stats", "cem_rng", "prefix_calls", "prefix_label", "prefix_embeds", "prefix_positions",
                           "prefix_rows"), engine="function", module=lambda: PlanStartNode(predictor)),
        GraphNode("cem_sample", inputs=("cem_stats", "cem", "cem_rng"), outputs=("sampled", "actions", "cem_rng"),
                  engine="function", module=lambda: sample_node),
        GraphNode("cem_update", inputs=("cem_stats", "cem", "sampled", "finals", "goal_latents"), outputs="cem_stats",
                  engine="function", module=lambda: update_node),
        GraphNode("cem_result", inputs="cem_stats", outputs=("plan", "costs", "best_actions", "best_cost"),
                  engine="function", module=lambda: cem_plan),
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
                # one label, the engine's default; it is freed when the request ends
                body=Sequential("rollout_step", NodeCall("ac_predictor", inputs=step_inputs)),
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
    directory, random = _resolve(options, "vjepa2-ac", "vjepa2-ac-tiny", ckpt.write_ac_preset, ckpt.AC_FILE)
    # the function nodes of the walks use the predictor's embeddings too: it is built where any of them runs
    encoder, predictor = ckpt.load_ac(directory, options.device_for("encoder"), options.torch_dtype("vjepa2"),
                                      options.device_for("ac_predictor", "rollout_step", "sample_step", "cem_start"))
    graph = _ac_graph(encoder, predictor)
    ecfg, pcfg = encoder.cfg, predictor.cfg
    tps = predictor.tokens_per_step
    # a page holds one time step (forked samples never share a partial page); every sample's step in one forward
    settings = {"ac_predictor": {"page_size": tps, "num_pages": 8 * pcfg.max_frames, "max_num_seqs": 512,
                                 "max_num_batched_tokens": 128 * tps}}
    return LoadedModel("vjepa2-ac", graph, random_weights=random,
                       prepare=lambda inputs: request.prepare_ac(inputs, ecfg, pcfg),
                       request_schema=request.ac_schema(pcfg.max_frames), engine_settings=settings,
                       extras={"encoder_config": ecfg, "predictor_config": pcfg})


def _resolve(options: LoadOptions, model: str, preset_name: str, writer, marker: str):
    """The checkpoint directory to load, writing the preset (seeded random weights) on first use."""
    if options.preset_or_checkpoint(model, ("tiny", preset_name)) is None:  # 'tiny' names preset_name here
        return options.checkpoint, False
    return ensure_preset(preset_name, marker, writer), True


SPECS = (
    ModelSpec("vjepa2", load_vjepa2, presets=("tiny",), description="V-JEPA 2 video encoder + masked predictor",
              example=request.HF_EXAMPLE),
    ModelSpec("vjepa2-ac", load_vjepa2_ac, presets=("tiny",),
              description="V-JEPA 2-AC world model: cached rollouts and CEM planning", example=request.AC_EXAMPLE),
)
