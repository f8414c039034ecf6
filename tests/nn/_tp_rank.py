"""One rank of the tensor-parallel tests: `python _tp_rank.py RANK WORLD INIT_FILE OUT_DIR CKPT...` (run by the test)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mstar_core.nn import DenseAttention, DenseKVCache, load_llama
from mstar_core.nn.parallel import TensorParallelGroup, load_llama_tensor_parallel, shard_llama


def logits(model, ids: torch.Tensor, context=None) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0]), context or DenseAttention()))


def cached_logits(model, ids: torch.Tensor, cache: DenseKVCache) -> torch.Tensor:
    """Under inference mode, as an engine step runs: the collectives must take inference tensors."""
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0]), cache))


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = TensorParallelGroup.from_process_group()
    ids = load_file(str(out / "ids.safetensors"))["ids"]
    for ckpt in sys.argv[5:]:
        name = Path(ckpt).name
        sliced = load_llama_tensor_parallel(ckpt, group)  # the path a server takes: only this rank's slices read
        split = load_llama(ckpt, progress=False)  # the in-memory path: a full model cut down in place
        shard_llama(split, group)
        attn, cache = sliced.model.layers[0].self_attn, DenseKVCache()
        save_file({
            "sliced": cached_logits(sliced, ids, cache),
            "kv_bytes": torch.tensor([cache.nbytes()]),
            "split": logits(split, ids),
            "param_bytes": torch.tensor([sum(p.numel() * p.element_size() for p in sliced.parameters())]),
            "heads": torch.tensor([attn.num_heads, attn.num_kv_heads]),
        }, str(out / f"{name}.rank{rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
