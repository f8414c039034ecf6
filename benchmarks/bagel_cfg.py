"""BAGEL classifier-free guidance: M*'s label forks + read-only steps + batched branches vs upstream-style dense CFG.

Both sides run the same weights in the same process on the same requests:

- M*: `mstar_bagel` served through AsyncEngine. The three cache labels share pages copy-on-write
  (`cfg_text` is a snapshot of `main`), every flow step's CFG branches are read-only calls on the shared
  `kvcache` engine, batched into one forward (and with other requests' branches at c=4).
- baseline (upstream BAGEL's structure, `mstar_bagel.reference`): each label's cache a dense deep copy, each
  branch its own forward per step, each step concatenating the branch's cached keys/values with its own;
  requests one after another (no cross-request batching).

Shape (full): LLM hidden 512, 8 layers; 256 output latent tokens; edit with a 256-token VAE image and a
256-token ViT image; 49 Euler steps (t2i: text CFG 4 in (0.4, 1]; edit: text 4, image 2 in [0, 1]).
`--quick` (< 60 s on 2 cores): 2 layers, 2 steps. Latency p50 per request at c=1 and c=4 (closed batch:
all c requests start together; M* runs one request's flow at a time by default, `--flows N` admits N at
once), CPU seconds of this process per side (`*_cpu_ratio`: load-independent). `edit_kv_bytes_ratio`: peak KV
bytes of one edit request, M* over baseline. `--dtype bfloat16` loads the weights in bf16 (the VAE stays float32,
as the loader keeps it); the baseline shares those modules, so both sides run in it. Prints one final JSON line (with
the load average at start and end).

    python benchmarks/bagel_cfg.py --quick [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.bagel.helpers: the dense baseline

from alternating import alternate  # (benchmarks/ is on the path when a script here runs)
from mstar_bagel.checkpoint import write_preset

from mstar_bagel import reference
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine
from tests.bagel.helpers import dense_latents


def sizes(quick: bool) -> tuple[dict, dict, dict]:
    llm = {"model_type": "qwen2", "hidden_size": 512, "num_hidden_layers": 2 if quick else 8,
           "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1376, "vocab_size": 1024,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "hidden_act": "silu",
           "qk_norm": True, "tie_word_embeddings": False, "layer_module": "Qwen2MoTDecoderLayer"}
    vit = {"model_type": "siglip_vision_model", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
           "num_attention_heads": 4, "image_size": 224, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh"}
    # 16x16 latent tokens: a 64x64 image through a 2x VAE and 2x2 latent patches; the ViT sees 16x16 patches of 224px
    top = {"latent_patch_size": 2, "max_latent_size": 16, "vit_max_num_patch_per_side": 16, "mstar_timestep_shift": 3.0,
           "mstar_num_timesteps": 50, "mstar_vae": {"ch": 32, "ch_mult": [1, 2], "z_channels": 16, "norm_groups": 8}}
    return top, llm, vit


def requests(task: str, count: int, steps: int) -> list[dict]:
    out = []
    for i in range(count):
        req = {"task": task, "prompt": f"a small red fox sitting in fresh snow, picture {i}", "num_steps": steps,
               "seed": 10 + i}
        if task == "edit":
            g = torch.Generator().manual_seed(i)
            req["image"] = torch.randint(0, 256, (224, 224, 3), dtype=torch.uint8, generator=g)
        else:
            req.update(width=64, height=64)
        out.append(req)
    return out


async def mstar_latencies(engine: AsyncEngine, reqs: list[dict]) -> list[float]:
    start = time.perf_counter()
    handles = [engine.submit("bagel", r) for r in reqs]

    async def done(h):
        await h.result()
        return time.perf_counter() - start

    return list(await asyncio.gather(*(done(h) for h in handles)))


def baseline_one(loaded, env: dict, seed: int) -> dict:
    """One request through the dense baseline, decoded; its labels (whose caches the KV figure sums)."""
    labels, x = dense_latents(loaded, env, seed)
    rows, cols = env["latent_grid"]
    reference.decode(loaded.extras["vae"], x, rows, cols, loaded.extras["bagel"].config.latent_patch_size)
    return labels


def baseline_latencies(loaded, reqs: list[dict]) -> list[float]:
    start, out = time.perf_counter(), []
    for r in reqs:  # upstream serves one request at a time
        baseline_one(loaded, loaded.prepare_inputs(r), r["seed"])
        out.append(time.perf_counter() - start)
    return out


async def compare(engine: AsyncEngine, loaded, reqs: list[dict], rounds: int) -> list[tuple[list[float], float]]:
    """(M*, baseline): every round's completion times, and the process CPU seconds of all rounds (load-independent:
    both sides run alone in this process); the sides interleaved, M* first in each round."""
    runs = await alternate({"mstar": lambda _: mstar_latencies(engine, reqs),
                            "baseline": lambda _: baseline_latencies(loaded, reqs)}, rounds, swap=False)
    return [([t for run in side for t in run.value], sum(run.cpu_s for run in side)) for side in runs.values()]


async def peak_pages(engine: AsyncEngine, req: dict) -> int:
    pool = engine.node_engines("bagel")["llm"].pool
    handle = engine.submit("bagel", req)
    peak = 0
    while not handle.done:
        peak = max(peak, pool.num_used)
        await asyncio.sleep(0)
    await handle.result()
    return peak


async def run(args) -> dict:
    steps = args.steps or (2 if args.quick else 49)
    top, llm, vit = sizes(args.quick)
    results: dict = {"dtype": args.dtype, "steps": steps, "layers": llm["num_hidden_layers"],
                     "hidden": llm["hidden_size"], "latent_tokens": 256}
    print(f"bagel_cfg: {args.dtype}, {results['layers']} layers, {steps} steps", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_preset(Path(tmp), top, llm, vit)
        async with AsyncEngine() as engine:
            # --gen-budget: llm_gen's token budget per forward (one request's three branches: 774), the engine
            # setting a compute-bound deployment would lower so that batches stop growing past what pays off
            # --flows: llm_gen's max_active_requests (requests whose flows run at once; bagel's default 1)
            gen = ({"max_num_batched_tokens": args.gen_budget} if args.gen_budget else {}) | \
                ({"max_active_requests": args.flows} if args.flows else {})
            settings = {"llm_gen": gen} if gen else None
            loaded = await engine.load_model("bagel", LoadOptions(checkpoint=tmp, dtype=args.dtype), settings=settings)
            # the baseline runs these same modules (loaded.extras), so it is in `--dtype` too: nothing to convert; its
            # float inputs (pixels, noise) are float32 and the modules cast them to their weights' dtype, as in M*
            assert loaded.extras["bagel"].vae2llm.weight.dtype == getattr(torch, args.dtype)
            page = 16
            for task in ("t2i", "edit"):
                warm = requests(task, 1, 1)
                await mstar_latencies(engine, warm)
                baseline_latencies(loaded, warm)
                for c in args.concurrency:
                    reqs = requests(task, c, steps)
                    rounds = (args.repeats or 3) if c == 1 else 1
                    (m, cpu_m), (b, cpu_b) = await compare(engine, loaded, reqs, rounds)
                    if c > 1:  # completion times of the last round: M* staggers them like the sequential baseline
                        results[f"{task}_c{c}_mstar_done_s"] = [round(x, 2) for x in sorted(m[-c:])]
                        results[f"{task}_c{c}_baseline_done_s"] = [round(x, 2) for x in b[-c:]]
                    results[f"{task}_c{c}_cpu_ratio"] = round(cpu_m / cpu_b, 3)
                    results[f"{task}_c{c}_mstar_p50_s"] = round(statistics.median(m), 3)
                    results[f"{task}_c{c}_baseline_p50_s"] = round(statistics.median(b), 3)
                    results[f"{task}_c{c}_p50_ratio"] = round(statistics.median(m) / statistics.median(b), 3)
            # peak KV of one edit request: M*'s pages (labels sharing them) vs the baseline's three dense caches
            edit = requests("edit", 1, 1)[0]
            cfg = loaded.extras["config"].llm
            itemsize = engine.node_engines("bagel")["llm"].pool.kv.element_size()  # KV in the weights' dtype
            page_bytes = page * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
            mstar_bytes = await peak_pages(engine, edit) * page_bytes
            labels = baseline_one(loaded, loaded.prepare_inputs(edit), edit["seed"])
            base_bytes = sum(label.cache.nbytes() for label in labels.values())
            results.update(edit_kv_bytes_mstar=mstar_bytes, edit_kv_bytes_baseline=base_bytes,
                           edit_kv_bytes_ratio=round(mstar_bytes / base_bytes, 3))
            results["llm_gen_largest_batch"] = engine.node_engines("bagel")["llm_gen"].largest_batch
    if 1 in args.concurrency:
        results["t2i_p50_ratio"] = results["t2i_c1_p50_ratio"]
        results["edit_p50_ratio"] = results["edit_c1_p50_ratio"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 steps: under 60 s on 2 cores")
    parser.add_argument("--steps", type=int, default=None, help="Euler steps (default 49, --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per side at c=1, interleaved, median (default 3)")
    parser.add_argument("--gen-budget", type=int, default=None, help="llm_gen max_num_batched_tokens (default: 4 "
                        "requests' branches)")
    parser.add_argument("--flows", type=int, default=None, help="llm_gen max_active_requests: flows run at once "
                        "(default: bagel's, 1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weight dtype of both sides (default float32)")
    parser.add_argument("--concurrency", type=lambda v: [int(c) for c in v.split(",")], default=[1, 4],
                        help="comma-separated concurrencies (default 1,4)")
    args = parser.parse_args()
    torch.manual_seed(0)
    t0, load = time.perf_counter(), os.getloadavg()[0]
    results = asyncio.run(run(args))
    results["load_avg_start_end"] = [round(load, 1), round(os.getloadavg()[0], 1)]
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
