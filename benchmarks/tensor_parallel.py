"""Tensor parallelism on CPU, side by side: TP=2 (2 rank processes x 1 thread) vs TP=1 (1 process x 2 threads).

One Llama checkpoint (random weights, written by mstar's `save_hf_checkpoint`, sized so that its
weights dominate the node's memory) is served by two placed engines in this run: `one` (a worker
with 2 torch threads) and `tp` (`tensor_parallel: 2`, 1 thread per rank), same engine settings.
Each is measured alone (the other idle): greedy tokens/s for one stream (c=1) and for 32 concurrent
streams (c=32), then each worker's weight and KV bytes (from its engine's heartbeat gauges) and peak
RSS (VmHWM). Both must produce the same greedy tokens.

`memory_per_rank_ratio` = (weights + KV pool) of the largest TP=2 rank / those of the TP=1 worker
(target <= 0.6). `tokens_per_s_ratio_c1` / `_c32` = TP=2 tokens/s over TP=1's. On 2 shared cores the
throughput ratio is not expected to win: each step adds collectives and the ranks share the cores.

    python benchmarks/tensor_parallel.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {"lm": {"num_pages": 128, "page_size": 16, "max_num_seqs": 32}}
RANKS = {"tp1": ["one"], "tp2": ["tp", "tp.rank1"]}


def write_checkpoint(directory: Path, quick: bool) -> Path:
    """A random Llama (GQA, untied head) whose weights dwarf its KV pool, with the tiny preset's tokenizer."""
    import shutil

    from mstar_llm.preset import ensure_tiny

    from mstar_core.checkpoint import save_hf_checkpoint
    from mstar_core.nn import LlamaForCausalLM

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
              "intermediate_size": 1536, "num_hidden_layers": 4 if quick else 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "float32",
              "bos_token_id": None, "eos_token_id": None}
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.05)
    save_hf_checkpoint(model, directory, config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(ensure_tiny()) / name, directory / name)
    return directory


def placements(device: str) -> dict[str, dict]:
    """TP=1 and TP=2 on `device` (CPU: 2 threads for the one process, 1 per rank; CUDA: ranks on cuda:0, cuda:1)."""
    cpu = device == "cpu"
    one = {"device": device, **({"threads": 2} if cpu else {})}
    tp = {"device": device, "tensor_parallel": 2, **({"threads": 1} if cpu else {})}
    return {"tp1": {"workers": {"one": one}, "nodes": {"lm": "one"}, "engine_settings": SETTINGS},
            "tp2": {"workers": {"tp": tp}, "nodes": {"lm": "tp"}, "engine_settings": SETTINGS}}


def peak_rss_mb(pid: int | None) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, TypeError):
        pass
    return None


async def generate(engine, prompt: list[int], tokens: int) -> list[int]:
    handle = engine.submit("llama", {"input_ids": prompt, "max_tokens": tokens, "ignore_eos": True,
                                     "temperature": 0.0})
    return [o.value async for o in handle if o.name == "next_token"]


async def tokens_per_s(engine, concurrency: int, tokens: int) -> tuple[float, list[list[int]]]:
    prompts = [[3 + (i * 7 + j) % 500 for j in range(24)] for i in range(concurrency)]
    start = time.perf_counter()
    outs = await asyncio.gather(*(generate(engine, p, tokens) for p in prompts))
    return sum(len(o) for o in outs) / (time.perf_counter() - start), outs


async def gauges(engine, ranks: list[str]) -> dict[str, dict]:
    """Each rank's llama/lm gauges from a heartbeat (weights and KV bytes), and its peak RSS."""
    out = {}
    for name in ranks:
        state = engine.cluster.workers[name]
        for _ in range(100):
            if "kv_pages_total" in state.load.get("llama/lm", {}):
                break
            await asyncio.sleep(0.05)
        load = state.load["llama/lm"]
        out[name] = {"parameter_bytes": load["parameter_bytes"], "kv_pool_bytes": load["kv_pool_bytes"],
                     "peak_rss_mb": peak_rss_mb(state.pid)}
    return out


async def main_async(args) -> dict:
    from vs_vllm import cpu_flags

    load_start = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mstar-tp-bench-") as tmp:
        checkpoint = write_checkpoint(Path(tmp), args.quick)
        engines = {}
        device = getattr(args, "device", "cpu")
        chosen = placements(device)
        try:
            async def load(label: str) -> None:
                engine = placed_engine(discover())
                engines[label] = engine
                await engine.load_model("llama", LoadOptions(checkpoint=str(checkpoint), dtype="float32"),
                                        placement=Placement.from_dict(chosen[label]))

            await asyncio.gather(*(load(label) for label in chosen))  # start-ups overlap; measuring does not
            out: dict = {"benchmark": "tensor_parallel", "quick": args.quick, "device": device}
            same = True
            for label, engine in engines.items():
                await generate(engine, [3, 4, 5], 4)  # warm-up
                c1, o1 = await tokens_per_s(engine, 1, args.tokens)
                c32, o32 = await tokens_per_s(engine, 32, args.tokens_c32)
                out[f"{label}_tokens_per_s_c1"], out[f"{label}_tokens_per_s_c32"] = round(c1, 1), round(c32, 1)
                out[f"{label}_ranks"] = await gauges(engine, RANKS[label])
                if label == "tp1":
                    reference = (o1, o32)
                else:
                    same = (o1, o32) == reference
        finally:
            for engine in engines.values():
                await engine.close()

    def memory(rank: dict) -> int:
        return rank["parameter_bytes"] + rank["kv_pool_bytes"]

    one = memory(out["tp1_ranks"]["one"])
    out["memory_per_rank_ratio"] = round(max(memory(r) for r in out["tp2_ranks"].values()) / one, 3)
    rss = [r["peak_rss_mb"] for r in out["tp2_ranks"].values()]
    if None not in rss and out["tp1_ranks"]["one"]["peak_rss_mb"]:
        out["peak_rss_per_rank_ratio"] = round(max(rss) / out["tp1_ranks"]["one"]["peak_rss_mb"], 3)
    out["tokens_per_s_ratio_c1"] = round(out["tp2_tokens_per_s_c1"] / out["tp1_tokens_per_s_c1"], 3)
    out["tokens_per_s_ratio_c32"] = round(out["tp2_tokens_per_s_c32"] / out["tp1_tokens_per_s_c32"], 3)
    out["same_greedy_tokens"] = same
    out["cpu_flags"] = cpu_flags()
    out["load_avg"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, fewer tokens (< 60 s)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens of the c=1 stream (default 16 quick, 128)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:0 for ranks on cuda:0 and cuda:1 (NCCL)")
    parser.add_argument("--tokens-c32", type=int, default=None, help="tokens per c=32 stream (default 4 quick, 32)")
    args = parser.parse_args()
    args.tokens = args.tokens or (16 if args.quick else 128)
    args.tokens_c32 = args.tokens_c32 or (4 if args.quick else 32)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
