"""gpu_check's `tp2_fidelity` section: a Llama split over 2 GPUs (NCCL) against the same weights on one.

The parent writes a random-weight checkpoint (the 1B shape in bf16; `--smoke`: a toy fp32 one on the CPU
over gloo), runs TP=1 on cuda:0 itself and starts 2 rank processes (`python gpu_tp_check.py rank ...`),
each loading only its slices onto cuda:RANK. Reported: relative logit difference of the prompt, greedy
tokens over the decode steps (identical or the first divergence), dense decode tokens/s both ways, weight
bytes and peak allocated memory per rank against TP=1, and an MoE layer at EP=2 against EP=1 (bf16
grouped GEMMs on CUDA). On a machine with fewer than 2 GPUs it returns a `skipped` line and starts nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
           tie_word_embeddings=False)
MOE = dict(hidden=256, intermediate=128, num_experts=8, top_k=2)
PROMPT, STEPS, WORLD = 64, 32, 2


def _write_checkpoints(root: Path, cfg: dict, dtype: torch.dtype) -> None:
    """The Llama (seeded random weights) and one MoE layer (experts stored one module per expert)."""
    from safetensors.torch import save_file

    from mstar_core.checkpoint import save_hf_checkpoint
    from mstar_core.nn import LlamaForCausalLM
    from mstar_core.nn.moe import TopKMoE

    torch.manual_seed(0)
    model = LlamaForCausalLM({"model_type": "llama", **cfg})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.02 if "embed" not in name else 1.0)
    save_hf_checkpoint(model, root / "llama", {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **cfg},
                       dtype=dtype)
    moe = TopKMoE(MOE["hidden"], MOE["intermediate"], MOE["num_experts"], MOE["top_k"])
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, MOE["hidden"] ** -0.5)
    state = {"mlp.gate.weight": moe.gate.weight}
    gate, up = moe.experts.gate_up_proj.chunk(2, dim=1)
    for e in range(MOE["num_experts"]):
        state.update({f"mlp.experts.{e}.gate_proj.weight": gate[e], f"mlp.experts.{e}.up_proj.weight": up[e],
                      f"mlp.experts.{e}.down_proj.weight": moe.experts.down_proj[e]})
    save_file({k: v.detach().to(dtype).contiguous() for k, v in state.items()}, str(root / "moe.safetensors"))


def _moe_block(group, device: str, dtype: torch.dtype, root: Path) -> torch.nn.Module:
    from mstar_core.checkpoint.meta import on_meta
    from mstar_core.nn.moe import TopKMoE
    from mstar_core.nn.parallel import SafetensorsSlices, fill_from_plan, shard_layers

    with on_meta():
        block = torch.nn.Module()
        block.mlp = TopKMoE(MOE["hidden"], MOE["intermediate"], MOE["num_experts"], MOE["top_k"])
    plan = shard_layers(block, group, module="moe", split=("mlp",), expert_parallel=True)
    with SafetensorsSlices(root / "moe.safetensors") as source:
        fill_from_plan(block, plan, source, dtype=dtype, device=device)
    return block


def _run(model, moe, device: str, vocab: int) -> dict[str, Any]:
    """Prompt logits, greedy tokens and decode seconds through a dense cache; the MoE layer's output."""
    from mstar_core.nn import DenseKVCache

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    ids = torch.tensor([(7 * j + 3) % (vocab - 1) + 1 for j in range(PROMPT)], device=device)
    cache = DenseKVCache()
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(PROMPT, device=device), cache))
        tokens = [int(logits[-1].argmax())]
        sync()
        started = time.perf_counter()
        for i in range(STEPS - 1):
            step = torch.tensor([tokens[-1]], device=device)
            out = model.compute_logits(model(step, torch.tensor([PROMPT + i], device=device), cache))
            tokens.append(int(out[-1].argmax()))
        sync()
        seconds = time.perf_counter() - started
        x = torch.randn(32, MOE["hidden"], generator=torch.Generator().manual_seed(1)).to(device, logits.dtype)
        moe_out = moe.mlp(x)
    return {"logits": logits.float().cpu(), "tokens": tokens, "decode_tok_s": (STEPS - 1) / seconds,
            "moe": moe_out.float().cpu(), "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def rank_main(rank: int, root: Path, backend: str, dtype_name: str) -> None:
    """One rank: join the group, load this rank's slices onto its device, run, save what it saw."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from mstar_core.checkpoint import read_config
    from mstar_core.nn.parallel import TensorParallelGroup, load_llama_tensor_parallel

    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=WORLD)
    group = TensorParallelGroup.from_process_group()
    dtype = getattr(torch, dtype_name)
    model = load_llama_tensor_parallel(root / "llama", group, dtype=dtype, device=device)
    out = _run(model, _moe_block(group, device, dtype, root), device, read_config(root / "llama")["vocab_size"])
    peak = torch.cuda.max_memory_allocated(device) if backend == "nccl" else 0
    save_file({"logits": out["logits"], "moe": out["moe"], "tokens": torch.tensor(out["tokens"]),
               "decode_tok_s": torch.tensor([out["decode_tok_s"]]), "param_bytes": torch.tensor([out["param_bytes"]]),
               "peak_bytes": torch.tensor([peak])}, str(root / f"rank{rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def check_tensor_parallel(device: torch.device, smoke: bool) -> dict[str, Any]:
    """TP=2 (and an MoE layer at EP=2) against one device; skipped with a clear line below 2 GPUs."""
    gpus = torch.cuda.device_count()
    if not smoke and gpus < WORLD:
        return {"skipped": f"tensor_parallel 2 needs 2 or more GPUs (one rank each); this machine has {gpus}"}
    from safetensors.torch import load_file

    from mstar_core.nn import load_llama
    from mstar_core.nn.parallel import TensorParallelGroup

    backend, dtype, cfg = ("gloo", torch.float32, TOY) if smoke else ("nccl", torch.bfloat16, LLAMA_1B)
    first = "cpu" if smoke else "cuda:0"
    with tempfile.TemporaryDirectory(prefix="mstar-tp-") as tmp:
        root = Path(tmp)
        _write_checkpoints(root, cfg, dtype)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "rank"]
        procs = [subprocess.Popen([*cmd, str(r), str(root), backend, str(dtype).removeprefix("torch.")], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
        if first.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(first)
        single = _run(load_llama(root / "llama", dtype=dtype, device=first, progress=False),
                      _moe_block(TensorParallelGroup.single(), first, dtype, root), first, cfg["vocab_size"])
        single_peak = torch.cuda.max_memory_allocated(first) if first.startswith("cuda") else 0
        for r, proc in enumerate(procs):
            output, _ = proc.communicate(timeout=300)
            if proc.returncode:
                return {"error": f"rank {r} exited {proc.returncode}", "output": output[-1500:]}
        ranks = [load_file(str(root / f"rank{r}.safetensors")) for r in range(WORLD)]
    scale = float(single["logits"].abs().max())
    diff = max(float((r["logits"] - single["logits"]).abs().max()) for r in ranks)
    tokens = ranks[0]["tokens"].tolist()
    divergence = next((i for i, (a, b) in enumerate(zip(tokens, single["tokens"], strict=True)) if a != b), None)
    moe_diff = max(float((r["moe"] - single["moe"]).abs().max()) for r in ranks)
    return {
        "backend": backend, "dtype": str(dtype), "shape": "toy" if smoke else "llama-1b",
        "relative_logit_diff": diff / max(scale, 1e-9), "greedy_identical": divergence is None,
        "first_divergence_step": divergence, "ranks_agree": all(r["tokens"].tolist() == tokens for r in ranks),
        "decode_tok_s_tp1": single["decode_tok_s"], "decode_tok_s_tp2": float(ranks[0]["decode_tok_s"]),
        "weight_bytes_per_rank_ratio": int(ranks[0]["param_bytes"]) / single["param_bytes"],
        "peak_bytes_per_rank_ratio": (int(ranks[0]["peak_bytes"]) / single_peak) if single_peak else None,
        "moe_ep2_max_abs_diff": moe_diff, "moe_output_scale": float(single["moe"].abs().max()),
    }


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rank":
    rank_main(int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], sys.argv[5])
