"""One linear in the module, several in the checkpoint: q/k/v and gate/up run as one GEMM each.

Checkpoints store `q_proj`, `k_proj`, `v_proj` (and `gate_proj`, `up_proj`) as separate linears;
one wider GEMM is cheaper than three narrow ones (one read of the activations, one kernel launch,
better blocking). `fuse_on_load` keeps the checkpoint layout the module's public face:

* `state_dict()` shows the separate names (row slices of the fused tensor, no copy), so the
  loader checks names and shapes against the checkpoint's own keys, and writers save HF layout;
* `load_state_dict()` concatenates the separate tensors into the fused one, with a shape error
  naming the checkpoint key that does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

_SUFFIXES = ("weight", "bias")


def fuse_on_load(owner: nn.Module, fused: str, parts: Sequence[tuple[str, int]]) -> None:
    """Make `owner.<fused>` (an `nn.Linear` whose output rows are `parts` stacked in order) save and load as `parts`.

    `parts` are `(checkpoint submodule name, output features)`, e.g. `[("q_proj", 512), ("k_proj", 128),
    ("v_proj", 128)]`; their sizes must add up to the fused linear's output features.
    """
    linear = getattr(owner, fused)
    sizes = [rows for _, rows in parts]
    if sum(sizes) != linear.out_features:
        raise ValueError(f"{fused}: parts {list(parts)} add up to {sum(sizes)} rows, the linear has {linear.out_features}")
    names = [name for name, _ in parts]
    # plain attribute: which checkpoint tensors each fused linear is made of (read by tensor-parallel shard plans)
    owner.__dict__.setdefault("checkpoint_parts", {})[fused] = tuple(names)
    # and how many output rows each part has (read by LoRA adapters, which target the parts: `mstar_core.nn.lora`)
    owner.__dict__.setdefault("checkpoint_part_rows", {})[fused] = tuple(sizes)

    def split_on_save(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        # This module's keys are the last ones written (children come first, then this hook), so
        # popping and re-adding them keeps the checkpoint's order: q, k, v, o, norms.
        # Each part's weight then its bias, as `nn.Linear` writes them.
        entries = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        pieces = {suffix: entries[key].split(sizes, dim=0) for suffix in _SUFFIXES
                  if (key := f"{prefix}{fused}.{suffix}") in entries}
        for key, tensor in entries.items():
            if key == f"{prefix}{fused}.weight" or (key == f"{prefix}{fused}.bias" and "weight" not in pieces):
                for i, name in enumerate(names):
                    for suffix, split in pieces.items():
                        state_dict[f"{prefix}{name}.{suffix}"] = split[i]
            elif key != f"{prefix}{fused}.bias":
                state_dict[key] = tensor

    def concat_on_load(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        target = getattr(module, fused)
        for suffix in _SUFFIXES:
            if getattr(target, suffix, None) is None:
                continue
            keys = [f"{prefix}{name}.{suffix}" for name in names]
            present = [k for k in keys if k in state_dict]
            if not present:
                continue  # nothing in checkpoint layout: the fused key itself (or its absence) speaks
            if len(present) < len(keys):
                missing_keys.extend(k for k in keys if k not in state_dict)
                for k in present:
                    state_dict.pop(k)
                continue
            pieces = [state_dict.pop(k) for k in keys]
            ok = True
            for key, piece, rows in zip(keys, pieces, sizes, strict=True):
                want = (rows, target.in_features) if suffix == "weight" else (rows,)
                if tuple(piece.shape) != want:
                    error_msgs.append(
                        f"size mismatch for {key}: checkpoint {list(piece.shape)}, model expects {list(want)} "
                        f"(it is fused into {prefix}{fused}.{suffix})"
                    )
                    ok = False
            if ok:
                state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat(pieces, dim=0)

    owner.register_state_dict_post_hook(split_on_save)
    owner.register_load_state_dict_pre_hook(concat_on_load)
