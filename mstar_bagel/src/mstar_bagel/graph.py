"""BAGEL as a Walk Graph. Three cache labels per request (`main`, `cfg_text`, `cfg_img`), all on `llm`:

    t2i:        llm(<|im_start|>prompt<|im_end|>) into main  [snapshot before -> cfg_text, after -> cfg_img]
                -> flow -> vae_decode
    edit:       (vae_encode || vit)(input image)
                -> llm(VAE block, bidirectional, gen expert) -> llm(ViT block, bidirectional)   [each: -> cfg_text]
                -> llm(text) into main [snapshot before -> cfg_text] -> llm(text) into cfg_img
                -> flow (at the input's size) -> vae_decode
    understand: Loop(parts){ vit -> llm(ViT block) | llm(text block) } -> llm(<|im_start|>, samples) -> decode loop
    think:      llm(system) -> llm(prompt) [before -> cfg_text, after -> cfg_img] -> llm(<|im_start|>) -> decode
                loop (the thought, into main); a plan Branch: if the thought ends by opening an image
                (<|vision_start|>) -> think_image: llm(<|im_end|>) -> flow -> vae_decode; else (<|im_end|> or
                max_tokens) the request ends with the text alone
    think_edit: as think with the input image's VAE and ViT blocks after the system prompt (edit's labels)
    flow:       Parallel(count=n){ image_seed -> noise -> Loop(num_steps){ flow_inputs (latent rows, how many CFG branches run)
                  -> Parallel(count=cfg_branches){ pick -> llm_gen read-only on main | cfg_text | cfg_img }
                  -> split -> euler (guidance + Euler step) } -> vae_decode }

Every image block is [<|vision_start|>, rows, <|vision_end|>] at one RoPE position. In the flow loop the
labels are frozen: each branch is a read-only call of `llm_gen` (sharing `llm`'s pages), so the branches of
all requests meet in one forward and nothing is copied per step.
"""

from __future__ import annotations

from mstar_kvcache.walks import decode_iterations

from mstar_bagel.modeling import Bagel
from mstar_bagel.nodes import (
    LABELS,
    Detokenize,
    FlowInputs,
    GenLLM,
    PickBranch,
    PickPart,
    SplitVelocities,
    ThinkClose,
    UnderstandLLM,
    VAEDecodeNode,
    VAEEncodeNode,
    ViTNode,
)
from mstar_core.grammar import GrammarVocab
from mstar_core.graph import (
    Branch,
    Copy,
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
from mstar_core.nn.flux_vae import FluxAutoEncoder
from mstar_core.sampling import choice_seed

WALKS = ("t2i", "edit", "understand", "think")
MAX_STEPS = 200
GUIDANCE = ("guidance_scale", "image_guidance_scale", "cfg_interval", "cfg_renorm", "cfg_renorm_min")
FLOW_INPUTS = ("n", "num_steps", "latent_shape", "latent_ids", "latent_grid", "gen_block_ids", "gen_block_at",
               "gen_block_routing", "gen_rows", "gen_position_table")
FLOW_OPTIONAL = ("seed", "shift", "output_size", *GUIDANCE)
LLM_OPTIONAL = ("input_embeds", "embeds_at", "routing", "positions", "sampling")


def _write(inputs: dict[str, str], **options) -> NodeCall:
    """A writing call of `llm`: the ports given, never the request's sampling (nothing drawn); its token kept apart."""
    return NodeCall("llm", inputs={"sampling": None, **inputs},
                    outputs={"next_token": "prefill_token", "finish_reason": "prefill_finish"}, options=options)


def _image_block(prefix: str, rows: str, *, gen: bool) -> NodeCall:
    """An image block [BOI, rows, EOI] into main, bidirectional, at one position; main -> cfg_text after it."""
    inputs = {"input_ids": f"{prefix}_block_ids", "input_embeds": rows, "embeds_at": f"{prefix}_block_at",
              "positions": f"{prefix}_block_positions"}
    if gen:
        inputs["routing"] = f"{prefix}_block_routing"
    return _write(inputs, bidirectional=True, snapshot_after="cfg_text")


def _flow() -> Sequential:
    branch = Sequential(
        NodeCall("pick"),
        NodeCall("llm_gen", inputs={"input_ids": "gen_block_ids", "input_embeds": "latent_rows", "embeds_at": "gen_block_at",
                                    "routing": "gen_block_routing", "positions": "gen_positions", "output_index": "gen_rows"},
                 options={"cache_label": FromEnv("cfg_branch", cfg_label), "write_cache": False,
                          "bidirectional": True}),
    )
    step = Sequential(
        NodeCall("flow_inputs"),
        Parallel(branch, count="cfg_branches", index_name="cfg_branch", collect={"velocity": "branch_velocities"}),
        NodeCall("split"),
        NodeCall("euler", inputs={"step": "loop_index"}),
    )
    one = Sequential(NodeCall("image_seed"), NodeCall("noise", inputs={"seed": "image_seed"}, outputs={"seed": "drawn_seed"}),
                     Loop(body=step, iters="num_steps"), "vae_decode")
    # n images of one prompt: each its own noise and flow, all reading the same frozen labels (nothing copied)
    return Parallel(one, count="n", index_name="image_index",
                    collect={"image": "image", "latents": "latents", "drawn_seed": "seeds", "sigma": "sigma"})


def build_graph(bagel: Bagel, vae: FluxAutoEncoder, tokenizer, eos: int, boi: int, name: str = "bagel",
                grammar_vocab: GrammarVocab | None = None) -> Graph:
    cfg = bagel.config
    latent = (None, cfg.patch_latent_dim)
    diffusion = {"schedule": "flow_euler", "latent_shape": latent, "max_steps": MAX_STEPS}
    nodes = [
        GraphNode("vit", inputs=("pixels",), outputs=("vit_rows",), engine="stateless", module=lambda: ViTNode(bagel)),
        GraphNode("vae_encode", inputs=("pixels",), outputs=("vae_rows",), engine="stateless",
                  module=lambda: VAEEncodeNode(bagel, vae)),
        GraphNode("llm", inputs=("input_ids",), optional_inputs=LLM_OPTIONAL, outputs=("next_token", "finish_reason"),
                  engine="kvcache", module=lambda: UnderstandLLM(bagel, grammar_vocab)),
        GraphNode("llm_gen", inputs=("input_ids", "input_embeds", "embeds_at", "routing", "positions", "output_index"),
                  outputs=("velocity",), engine="kvcache", module=lambda: GenLLM(bagel),
                  options={"share_cache_with": "llm"}),
        GraphNode("image_seed", inputs=("image_index",), optional_inputs=("seed",), outputs=("image_seed",),
                  engine="function", module=lambda: image_seed),
        GraphNode("noise", inputs=("num_steps", "latent_shape"), optional_inputs=("seed", "shift"),
                  outputs=("latents", "timestep", "sigma", "seed"), engine="diffusion", options={"role": "init", **diffusion}),
        GraphNode("flow_inputs", inputs=("latents", "timestep", "sigma", "latent_ids"),
                  optional_inputs=("guidance_scale", "image_guidance_scale", "cfg_interval"),
                  outputs=("latent_rows", "cfg_branches"), engine="function", module=lambda: FlowInputs(bagel)),
        GraphNode("pick", inputs=("gen_position_table", "cfg_branch"), outputs=("gen_positions",), engine="function",
                  module=PickBranch),
        GraphNode("split", inputs=("branch_velocities",), outputs=("velocity", "velocity_uncond", "velocity_uncond_image"),
                  engine="function", module=SplitVelocities),
        GraphNode("euler", inputs=("latents", "step", "num_steps", "velocity"),
                  optional_inputs=("velocity_uncond", "velocity_uncond_image", "shift", *GUIDANCE),
                  outputs=("latents", "timestep", "sigma"), engine="diffusion", options=diffusion),
        GraphNode("vae_decode", inputs=("latents", "latent_grid"), optional_inputs=("output_size",), outputs=("image",),
                  engine="stateless",
                  module=lambda: VAEDecodeNode(vae, cfg.latent_patch_size)),
        GraphNode("pick_part", inputs=("parts", "index"),
                  outputs=("part_is_image", "part_is_text", "vit_pixels", "vit_block_ids", "vit_block_at",
                           "vit_block_positions", "text_ids", "text_positions"), engine="function", module=PickPart),
        GraphNode("detokenize", inputs=("first_token", "decoded"), outputs=("text",), engine="function",
                  module=lambda: Detokenize(tokenizer)),
        GraphNode("think_close", inputs=("decoded", "gen_position_base", "gen_block_ids"),
                  outputs=("close_ids", "gen_position_table"), engine="function", module=lambda: ThinkClose(eos)),
    ]
    text_main = _write({"input_ids": "prompt_ids", "positions": "prompt_positions"}, snapshot_before="cfg_text")
    t2i = Walk(
        name="t2i",
        body=Sequential(_write({"input_ids": "prompt_ids", "positions": "prompt_positions"},
                               snapshot_before="cfg_text", snapshot_after="cfg_img"), _flow()),
        inputs=("prompt_ids", "prompt_positions", *FLOW_INPUTS),
        optional_inputs=FLOW_OPTIONAL,
        outputs=("image", "seeds"),
        emit=("sigma",),
        description="prompt into main (cfg_text: empty; cfg_img: main), then the CFG flow loop and the VAE decode",
    )
    edit = Walk(
        name="edit",
        body=Sequential(
            Parallel(NodeCall("vae_encode", inputs={"pixels": "vae_pixels"}), NodeCall("vit", inputs={"pixels": "vit_pixels"})),
            _image_block("vae", "vae_rows", gen=True),
            _image_block("vit", "vit_rows", gen=False),
            text_main,
            _write({"input_ids": "prompt_ids", "positions": "text_only_positions"}, cache_label="cfg_img"),
            _flow(),
        ),
        inputs=("vae_pixels", "vit_pixels", "vae_block_ids", "vae_block_at", "vae_block_routing", "vae_block_positions",
                "vit_block_ids", "vit_block_at", "vit_block_positions", "prompt_ids", "prompt_positions",
                "text_only_positions", *FLOW_INPUTS),
        optional_inputs=FLOW_OPTIONAL,
        outputs=("image", "seeds"),
        emit=("sigma",),
        description="the input image as a VAE block and a ViT block, the instruction, then the flow at the input's size",
    )
    think = Walk(
        name="think",
        body=Sequential(
            _write({"input_ids": "system_ids", "positions": "system_positions"}, snapshot_before="cfg_text"),
            _write({"input_ids": "prompt_ids", "positions": "prompt_positions"}, snapshot_before="cfg_text",
                   snapshot_after="cfg_img"),
            *_decode("think_start"),
        ),
        inputs=("system_ids", "system_positions", "prompt_ids", "prompt_positions", "think_start", "sampling"),
        outputs=("text", "decoded", "finish_reason"),
        emit=("next_token",),
        description="system prompt and prompt (cfg_text: the system prompt; cfg_img: both), then the thought, decoded "
                    "until <|im_end|> or <|vision_start|>",
    )
    think_edit = Walk(
        name="think_edit",
        body=Sequential(
            _write({"input_ids": "system_ids", "positions": "system_positions"}, snapshot_before="cfg_text",
                   snapshot_after="cfg_img"),
            Parallel(NodeCall("vae_encode", inputs={"pixels": "vae_pixels"}), NodeCall("vit", inputs={"pixels": "vit_pixels"})),
            _image_block("vae", "vae_rows", gen=True),
            _image_block("vit", "vit_rows", gen=False),
            _write({"input_ids": "prompt_ids", "positions": "prompt_positions"}, snapshot_before="cfg_text"),
            _write({"input_ids": "prompt_ids", "positions": "text_only_positions"}, cache_label="cfg_img"),
            *_decode("think_start"),
        ),
        inputs=("system_ids", "system_positions", "vae_pixels", "vit_pixels", "vae_block_ids", "vae_block_at",
                "vae_block_routing", "vae_block_positions", "vit_block_ids", "vit_block_at", "vit_block_positions",
                "prompt_ids", "prompt_positions", "text_only_positions", "think_start", "sampling"),
        outputs=("text", "decoded", "finish_reason"),
        emit=("next_token",),
        description="system prompt, the input image (VAE and ViT blocks) and the instruction, then the thought",
    )
    think_image = Walk(
        name="think_image",
        body=Sequential(NodeCall("think_close"), _write({"input_ids": "close_ids"}), _flow()),
        inputs=("decoded", "gen_position_base", *(n for n in FLOW_INPUTS if n != "gen_position_table")),
        optional_inputs=FLOW_OPTIONAL,
        outputs=("image", "seeds"),
        emit=("sigma",),
        description="the thought closed with <|im_end|> in main, then the flow at the position after it",
    )
    understand = Walk(
        name="understand",
        body=Sequential(
            # the parts in order; each iteration runs exactly one of the two fan-outs (count 1, the other 0)
            Loop(body=Sequential(
                NodeCall("pick_part", inputs={"index": "loop_index"}),
                Parallel(Sequential(NodeCall("vit", inputs={"pixels": "vit_pixels"}), _image_block("vit", "vit_rows", gen=False)),
                         count="part_is_image", index_name="image_part", collect={}),
                Parallel(_write({"input_ids": "text_ids", "positions": "text_positions"}),
                         count="part_is_text", index_name="text_part", collect={}),
            ), iters="num_parts"),
            *_decode("reply_start", positions="reply_positions"),
        ),
        inputs=("parts", "num_parts", "reply_start", "reply_positions", "sampling"),
        outputs=("text", "finish_reason"),
        emit=("next_token",),
        description="text and images in their order (images as ViT blocks), then <|im_start|>; decode until <|im_end|>",
    )
    draws = opens_image(boi)
    branches = [Branch(after=w, choose=draws, walks=("think_image",)) for w in ("think", "think_edit")]
    return Graph.build(name, nodes, [t2i, edit, understand, think, think_edit, think_image], plan=_plan,
                       branches=branches)


def cfg_label(branch: int) -> str:
    """CFG branch i reads label LABELS[i]: main, cfg_text, cfg_img."""
    return LABELS[branch]


def image_seed(image_index: int, seed: int | None = None) -> int | None:
    """Image `i` of a request seeded `s` is the image a single request seeded `s + i` draws (None: a fresh seed)."""
    return choice_seed(seed, image_index)


def _plan(env) -> list[str]:
    return [env["walk"]]


def opens_image(boi: int):
    """The think branch: the image walk if the thought's last sampled token opens an image, else nothing.

    A thought that stops on <|im_end|> or runs out of max_tokens is a text answer: no flow, no VAE decode.
    """

    def choose(env) -> str | None:
        last = ([env["first_token"], *env.get("decoded", ())])[-1]
        return "think_image" if env.get("finish_reason") == "stop" and int(last) == boi else None

    return choose


def _decode(first: str, positions: str | None = None) -> tuple:
    """Feed `first` (sampling its last row), then each sampled token until a stop id or max_tokens; the text."""
    return (
        NodeCall("llm", inputs={"input_ids": first, "positions": positions, "sampling": "sampling"}),
        Copy(first_token="next_token"),
        DynamicLoop(body=NodeCall("llm", inputs={"input_ids": "next_token", "sampling": "sampling"}),
                    until=lambda env: env.get("finish_reason") is not None,
                    max_iters=decode_iterations("sampling"), accumulate={"next_token": "decoded"}),
        NodeCall("detokenize"),
    )
