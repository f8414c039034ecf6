"""BAGEL's LLM (the mixture-of-transformers decoder, both experts) loaded split across a tensor-parallel group.

Reads only this rank's slices of `ema.safetensors` (`language_model.*`); see `mstar_core.nn.parallel.mot`
for how each expert is split. The ViT, connector, VAE and the latent projections are other nodes' weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar_bagel.checkpoint import EMA, _file, table_sides
from mstar_bagel.config import BagelConfig
from mstar_core.checkpoint.meta import on_meta
from mstar_core.nn.parallel import SafetensorsSlices, TensorParallelGroup, fill_from_plan
from mstar_core.nn.parallel.mot import shard_mot
from mstar_core.nn.qwen2_mot import MoTForCausalLM


def load_bagel_llm_tensor_parallel(directory: str | Path, group: TensorParallelGroup, *,
                                   dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                                   module: str = "llm") -> MoTForCausalLM:
    """This rank's `MoTForCausalLM` of a BAGEL checkpoint directory (config files + `ema.safetensors`)."""
    d = Path(directory)
    cfg = BagelConfig.from_dir(d, table_sides(_file(d, EMA)))
    with on_meta():
        llm = MoTForCausalLM(cfg.llm)
    plan = shard_mot(llm, group, module=module, checkpoint_prefix="language_model.")
    with SafetensorsSlices(d / EMA) as source:
        fill_from_plan(llm, plan, source, dtype=dtype, device=device)
    return llm.eval()
