"""The captioner as a Walk Graph: what each request does, read top to bottom.

    prefill:  Parallel(vision(whole image), vision(centre crop)) -> splice -> lm(prompt)  -> first token
    decode:   DynamicLoop(lm(last token)) until a finish reason                            -> one token per step
    both:     lm.next_token --FixedChunkPolicy(1)--> detokenize                            -> text pieces
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_kvcache.walks import decode_iterations

from mstar_core.graph import (
    DynamicLoop,
    Graph,
    GraphNode,
    NodeCall,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar_core.streaming import FixedChunkPolicy
from mstar_example_captioner.modeling import Captioner, ImageSplicer
from mstar_example_captioner.tokenizer import CharTokenizer

WALKS = ("prefill", "decode")


class Detokenizer:
    """The `detokenize` node's module (engine `function`): a streamed chunk of token ids -> its text."""

    def __init__(self, tokenizer: CharTokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_ids: Any) -> str:
        return self.tokenizer.decode(token_ids.new_items)  # a streaming consumer receives a `Chunk`


def _finished(env: Mapping[str, Any]) -> bool:
    return env.get("finish_reason") is not None  # the kvcache engine sets it from `sampling`


def build_graph(model: Captioner, tokenizer: CharTokenizer, name: str = "example-captioner") -> Graph:
    lm = model.language_model
    nodes = [
        GraphNode("vision", inputs="pixels", outputs="image_embeds", engine="stateless",
                  module=lambda: model.vision_tower),
        GraphNode("splice", inputs=("input_ids", "global_embeds", "detail_embeds"), outputs="input_embeds",
                  engine="function", module=lambda: ImageSplicer(lm, model.config.image_token_id)),
        GraphNode("lm", inputs="input_ids", optional_inputs=("input_embeds", "sampling"),
                  outputs=("next_token", "finish_reason"), engine="kvcache", module=lambda: lm),
        GraphNode("detokenize", inputs="token_ids", outputs="text", engine="function",
                  module=lambda: Detokenizer(tokenizer)),
    ]
    to_text = StreamingGraphEdge("lm.next_token", "detokenize.token_ids", FixedChunkPolicy(1))
    prefill = Walk(
        name="prefill",
        body=Sequential(
            Parallel(  # two calls of one node: the stateless engine runs them as one batch
                NodeCall("vision", inputs={"pixels": "global_view"}, outputs={"image_embeds": "global_embeds"}),
                NodeCall("vision", inputs={"pixels": "detail_view"}, outputs={"image_embeds": "detail_embeds"}),
            ),
            NodeCall("splice", inputs={"input_ids": "prompt_ids"}, outputs={"input_embeds": "prompt_embeds"}),
            NodeCall("lm", inputs={"input_ids": "prompt_ids", "input_embeds": "prompt_embeds"}),
        ),
        inputs=("global_view", "detail_view", "prompt_ids", "sampling"),
        outputs=("next_token", "finish_reason"),
        emit=("next_token", "text"),
        streams=(to_text,),
        description="encode both views, splice them into the prompt, prefill it and sample the first token",
    )
    decode = Walk(
        name="decode",
        body=DynamicLoop(
            # `step_embeds` is never supplied: decode steps are plain token ids. Naming it keeps the prefill's
            # `prompt_embeds` (still in the env) away from this call, and declaring it below satisfies the check
            # that every optional input can be supplied.
            body=NodeCall("lm", inputs={"input_ids": "next_token", "input_embeds": "step_embeds"}),
            until=_finished,
            max_iters=decode_iterations("sampling"),  # max_tokens - 1: prefill sampled the first token
        ),
        inputs=("next_token", "sampling"),
        optional_inputs=("step_embeds",),
        outputs=("next_token", "finish_reason"),
        emit=("next_token", "text"),
        streams=(to_text,),
        description="feed each token back into the decoder until EOS or max_tokens",
    )
    return Graph.build(name, nodes, [prefill, decode], plan=lambda env: list(WALKS))
