"""BAGEL's LLM (the mixture-of-transformers decoder, both experts) loaded split across a tensor-parallel group.

Reads only this rank's slices of `ema.safetensors` (`language_model.*`); see `mstar_core.nn.parallel.mot`
for how each expert is split. The ViT, connector, VAE and the latent projections are other nodes' weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mstar_bagel.checkpoint import AE, EMA, _file, ema_mapping, table_sides
from mstar_bagel.config import BagelConfig
from mstar_bagel.modeling import Bagel
from mstar_core.checkpoint import RuleMapping, build_and_load, open_checkpoint
from mstar_core.checkpoint.meta import on_meta
from mstar_core.nn.flux_vae import FluxAutoEncoder
from mstar_core.nn.parallel import SafetensorsSlices, TensorParallelGroup, fill_from_plan
from mstar_core.nn.parallel.mot import MOT_SPLIT, shard_mot
from mstar_core.nn.parallel.shard import layer_dimensions
from mstar_core.nn.qwen2_mot import MoTForCausalLM


def llm_dimensions(llm: MoTForCausalLM) -> dict[str, int]:
    """The sizes a group must divide to split BAGEL's LLM (both experts' heads and columns, the vocabulary)."""
    return layer_dimensions(llm, **MOT_SPLIT)


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


def load_bagel_tensor_parallel(directory: str | Path, group: TensorParallelGroup, *, device: str | torch.device = "cpu",
                               dtype: torch.dtype | None = None) -> tuple[Bagel, FluxAutoEncoder]:
    """`load_bagel` for one rank: the LLM from its slices, the ViT, connector, projections and VAE whole."""
    d = Path(directory)
    cfg = BagelConfig.from_dir(d, table_sides(_file(d, EMA)))
    llm = load_bagel_llm_tensor_parallel(d, group, dtype=dtype, device=device)

    def without_llm() -> Bagel:
        bagel = Bagel(cfg)
        bagel.language_model = nn.Module()  # read above, split: the loader must not expect it here
        return bagel

    bagel = build_and_load(without_llm, open_checkpoint(_file(d, EMA)), ema_mapping(cfg, (r"^language_model\.",)),
                           dtype=dtype, device=device, progress=False)
    bagel.language_model = llm
    vae = build_and_load(lambda: FluxAutoEncoder(cfg.vae), open_checkpoint(_file(d, AE)), RuleMapping(),
                         dtype=torch.float32, device=device, progress=False)
    return bagel, vae
