"""The Talker (MoE decoder over codec frames) and its code predictor (a small dense decoder, one head per group).

`Talker` is a `kvcache` node module: `input_embeds` only (text/hidden projections plus codec embeddings,
built outside), M-RoPE positions, `codec_head` logits with the top `1024` ids suppressed except EOS
(`TalkerConfig.suppress_from`). Checkpoint names: `talker.model.{layers, norm, codec_embedding}`,
`talker.{text_projection, hidden_projection, codec_head, code_predictor}`.

`CodePredictor` (shared with Qwen3-TTS: `mstar_core.nn.code_predictor`) predicts codes 1..G-1 of a frame.
"""

from __future__ import annotations

from mstar_core.nn.code_predictor import CodePredictor, CodePredictorModel, ResizeMLP
from mstar_core.nn.qwen3_talker import Qwen3Talker, Qwen3TalkerModel
from mstar_qwen_omni.config import TalkerConfig
from mstar_qwen_omni.split import part_dimensions

__all__ = ["CodePredictor", "CodePredictorModel", "ResizeMLP", "Talker", "TalkerModel"]

# Omni's Talker decoder holds the code-0 table only (its text comes projected from the Thinker)
TalkerModel = Qwen3TalkerModel


class Talker(Qwen3Talker):
    """The shared Talker fed by two projections of Thinker rows (its text embeddings and a hidden layer's)."""

    position_axes = 3
    text_projection: ResizeMLP
    hidden_projection: ResizeMLP

    def __init__(self, cfg: TalkerConfig):
        resize = (cfg.thinker_hidden_size, cfg.text.intermediate_size, cfg.text.hidden_size, cfg.text.hidden_act)
        super().__init__(cfg, TalkerModel(cfg), {"text_projection": ResizeMLP(*resize),
                                                 "hidden_projection": ResizeMLP(*resize)})

    def tensor_parallel_dimensions(self, expert_parallel: bool = False) -> dict[str, int]:
        """The sizes a tensor-parallel group must divide to split this node (heads, KV heads, experts or their
        columns, vocabulary); `mstar_qwen_omni.parallel` splits it by the same table."""
        return part_dimensions(self, "talker", expert_parallel)
