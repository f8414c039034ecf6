"""The Thinker and the Talker split across a tensor-parallel group, loaded from the checkpoint's slices.

Both decoders split attention by heads and their MoE layers either by experts (`expert_parallel`: each rank
holds `num_experts / N` whole experts) or by each expert's columns; the router, norms and everything outside
the decoder layers are replicated, except the LM heads (the Thinker's `lm_head`, the Talker's `codec_head`),
split by vocabulary rows. The Thinker's token embedding stays whole: the graph's Talker-side text
embedding is read from its full table (`mstar_qwen_omni.model`). The encoders and the code predictor are
other nodes' modules that these two own: replicated, never split here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar_core.checkpoint import read_config
from mstar_core.checkpoint.meta import on_meta
from mstar_core.model import LoadOptions
from mstar_core.nn.parallel import SafetensorsSlices, TensorParallelGroup, fill_from_plan
from mstar_core.nn.parallel.shard import ShardPlan, shard_layers
from mstar_qwen_omni.checkpoint import QwenOmni
from mstar_qwen_omni.config import OmniConfig
from mstar_qwen_omni.split import SPLITS
from mstar_qwen_omni.talker import Talker
from mstar_qwen_omni.thinker import Thinker


def shard_thinker(thinker: Thinker, group: TensorParallelGroup, *, expert_parallel: bool | None = None,
                  module: str = "thinker") -> ShardPlan:
    """This rank's Thinker (layers replaced on meta); the plan reads the published `thinker.*` names."""
    return shard_layers(thinker, group, module=module, checkpoint_prefix="thinker.", **SPLITS["thinker"],
                        expert_parallel=expert_parallel)


def shard_talker(talker: Talker, group: TensorParallelGroup, *, expert_parallel: bool | None = None,
                 module: str = "talker") -> ShardPlan:
    """This rank's Talker decoder and codec head; the plan reads the published `talker.*` names."""
    return shard_layers(talker, group, module=module, checkpoint_prefix="talker.", **SPLITS["talker"],
                        expert_parallel=expert_parallel)


def load_part_tensor_parallel(directory: str | Path, part: str, group: TensorParallelGroup, *,
                              expert_parallel: bool | None = None, dtype: torch.dtype | None = None,
                              device: str | torch.device = "cpu", module: str | None = None) -> Thinker | Talker:
    """Load this rank's `part` (`"thinker"` or `"talker"`) of a Qwen3-Omni checkpoint, reading only its slices."""
    cfg = OmniConfig.from_hf(read_config(directory))
    with on_meta():
        if part == "thinker":
            model = Thinker(cfg.thinker)
            if cfg.enable_audio_output:  # as `QwenOmni` sets it: the Talker reads this layer at media tokens
                model.keep_layer = cfg.talker.accept_hidden_layer
        elif part == "talker":
            model = Talker(cfg.talker)
        else:
            raise ValueError(f"part must be 'thinker' or 'talker', got {part!r}")
    shard = shard_thinker if part == "thinker" else shard_talker
    plan = shard(model, group, expert_parallel=expert_parallel, module=module or part)
    with SafetensorsSlices(directory) as source:
        fill_from_plan(model, plan, source, dtype=dtype, device=device)
    return model.eval()


def load_omni_tensor_parallel(directory: str | Path, group: TensorParallelGroup, options: LoadOptions) -> QwenOmni:
    """`QwenOmni` for one rank: the hosted Thinker / Talker split and read from slices, every other part on meta.

    Only these two split (a rank group hosts only nodes that split); the parts other processes run keep
    their shapes and no memory, as `LoadOptions.device_for` says.
    """
    cfg = OmniConfig.from_hf(read_config(directory))
    with on_meta():
        model = QwenOmni(cfg, cfg.enable_audio_output)
    dtype = options.torch_dtype("qwen3-omni")
    with SafetensorsSlices(directory) as source:
        for part, shard in (("thinker", shard_thinker), ("talker", shard_talker)):
            module, device = getattr(model, part), options.device_for(part)
            if module is None or device == "meta":
                continue
            plan = shard(module, group, module=f"node '{part}'")
            fill_from_plan(module, plan, source, dtype=dtype, device=device)
    return model.eval()
