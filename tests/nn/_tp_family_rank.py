"""One rank of the model-family tensor-parallel tests: `python _tp_family_rank.py RANK WORLD ROOT` (run by the test).

ROOT holds `jobs.json` (name, kind, checkpoint, expert_parallel) and `inputs.safetensors`; each job's outputs
go to `ROOT/NAME.rankR.safetensors`, with this rank's parameter bytes and the bytes it read from the files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from _tp_families import WHOLE, load_shard, outputs

from mstar_core.nn.parallel import TensorParallelGroup


def main() -> None:
    rank, world, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=world)
    group = TensorParallelGroup.from_process_group()
    inputs = load_file(str(root / "inputs.safetensors"))
    for job in json.loads((root / "jobs.json").read_text()):
        model, read = load_shard(job["kind"], Path(job["checkpoint"]), group, job["expert_parallel"])
        out = outputs(WHOLE.get(job["kind"], job["kind"]), model, inputs)
        out["param_bytes"] = torch.tensor([sum(p.numel() * p.element_size() for p in model.parameters())])
        out["bytes_read"] = torch.tensor([read])
        save_file({k: v.contiguous() for k, v in out.items()}, str(root / f"{job['name']}.rank{rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
