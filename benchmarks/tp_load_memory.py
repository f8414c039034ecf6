"""Peak RSS of loading one tensor-parallel rank from safetensors slices against loading the whole model.

Writes a random-weight Llama whose weights dominate a process's memory (about 500 MB fp32; `--quick`: about
120 MB), then loads it in fresh processes: whole (`load_llama`, TP=1) and as rank 0 and rank 1 of TP=2
(`load_llama_tensor_parallel`: each rank copies only its slices out of the memory-mapped file). Each process
reports its RSS after imports, its peak RSS (`VmHWM`, which counts the file pages the slicing touched while
the file was mapped) and, once loaded, its anonymous RSS (the weights it holds). One JSON line:
`peak_rss_ratio` and `held_rss_ratio` are rank / TP=1, both net of the import baseline.

    python benchmarks/tp_load_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FULL = dict(vocab_size=16000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=16,
            num_key_value_heads=4)
QUICK = dict(vocab_size=8000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(directory: str, rank: int) -> dict[str, float]:
    """In this (fresh) process: load rank `rank` of 2 (-1: the whole model); RSS figures in MB."""
    import torch

    from mstar_core.nn import load_llama
    from mstar_core.nn.parallel import TensorParallelGroup, load_llama_tensor_parallel

    torch.set_num_threads(1)
    base, base_anon = status_kb("VmRSS"), status_kb("RssAnon")
    if rank < 0:
        model = load_llama(directory, progress=False)
    else:
        model = load_llama_tensor_parallel(directory, TensorParallelGroup(rank, 2))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"baseline_mb": base / 1024, "peak_mb": (status_kb("VmHWM") - base) / 1024,
            "held_anon_mb": (status_kb("RssAnon") - base_anon) / 1024, "weights_mb": weights / 2**20}


def write(directory: Path, sizes: dict) -> None:
    import torch

    from mstar_core.checkpoint import save_hf_checkpoint
    from mstar_core.nn import LlamaForCausalLM

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **sizes}
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_hf_checkpoint(model, directory, cfg)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~120 MB model instead of ~500 MB")
    parser.add_argument("--measure", nargs=2, metavar=("DIR", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        return 0
    with tempfile.TemporaryDirectory(prefix="mstar-tp-rss-") as tmp:
        write(Path(tmp), QUICK if args.quick else FULL)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        runs = {}
        for name, rank in (("tp1", -1), ("tp2_rank0", 0), ("tp2_rank1", 1)):
            out = subprocess.run([sys.executable, __file__, "--measure", tmp, str(rank)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[name] = json.loads(out.strip().splitlines()[-1])
    full = runs["tp1"]
    report = {"benchmark": "tp_load_memory", "quick": args.quick, **runs,
              "peak_rss_ratio": max(runs[r]["peak_mb"] for r in ("tp2_rank0", "tp2_rank1")) / full["peak_mb"],
              "held_rss_ratio": max(runs[r]["held_anon_mb"] for r in ("tp2_rank0", "tp2_rank1")) / full["held_anon_mb"],
              "weights_ratio": runs["tp2_rank0"]["weights_mb"] / full["weights_mb"], "load": os.getloadavg()[0]}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
