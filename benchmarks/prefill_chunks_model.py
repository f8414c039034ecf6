"""The kvcache scheduler's prompt chunks at c=32 under a step-cost model: TTFT and inter-token time per policy.

No model runs: the real `Scheduler` and `BlockManager` plan every step of vs_llamacpp.py's c=32 workload (64
requests, 32 in flight in a closed loop, prompts of 64-200 tokens, 128 output tokens), and each step costs
`--step-ms` + `--prompt-ms` a prompt token + `--row-ms` a decode row (defaults: what `decode_load.py` measured on
the 2-core EPYC for the real SmolLM2-135M in fp32). So the figures are free of the box's load and say what the
policy does, not what the machine does; `decode_load.py` measures the same settings on the model.

    python benchmarks/prefill_chunks_model.py                     # no cap (the whole budget), then caps of 64 ... 320
    python benchmarks/prefill_chunks_model.py --shortest-first    # and waiting prompts admitted shortest first
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from mstar_kvcache import scheduler as policy
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.pool import PagePool
from mstar_kvcache.sequence import Sequence


def simulate(prefill_step_tokens: int | None, seed: int, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(seed)
    lengths = [rng.randint(64, 200) for _ in range(args.requests)]
    blocks = BlockManager(PagePool(4096, 16, num_layers=1, num_kv_heads=1, head_dim=2), False)
    sched = policy.Scheduler(blocks, 64, args.budget, prefill_step_tokens=prefill_step_tokens)
    now, submitted, live = 0.0, 0, []
    state: dict[int, dict[str, float]] = {}  # per sequence: tokens out, sent at, last token at
    ttft, itl = [], []

    def submit() -> None:
        nonlocal submitted
        seq = Sequence(str(submitted), "main", tokens=list(range(1, lengths[submitted] + 1)), order=submitted,
                       arrival=now)
        seq.pending = object()
        state[id(seq)] = {"out": 0, "sent": now, "last": now}
        submitted += 1
        live.append(seq)

    for _ in range(min(args.concurrency, args.requests)):
        submit()
    while live:
        plan = sched.schedule(list(live), lambda: live)
        prompt = sum(n for _, n in plan.work if n > 1)
        rows = sum(1 for _, n in plan.work if n == 1)
        now += (args.step_ms + args.prompt_ms * prompt + args.row_ms * rows) / 1e3
        for seq, n in plan.work:
            seq.num_computed += n
            blocks.commit(seq)
            if seq.remaining:
                continue
            s = state[id(seq)]
            (ttft if s["out"] == 0 else itl).append(now - (s["sent"] if s["out"] == 0 else s["last"]))
            s["out"], s["last"] = s["out"] + 1, now
            if s["out"] < args.output_tokens:
                seq.tokens.append(7)
                continue
            blocks.free(seq)
            live.remove(seq)
            if submitted < args.requests:
                submit()
    return {"tok_s": args.requests * args.output_tokens / now, "ttft_p50_s": statistics.median(ttft),
            "ttft_max_s": max(ttft), "itl_p99_ms": 1e3 * sorted(itl)[int(0.99 * (len(itl) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="none,64,96,128,160,192,256,320", help="prefill_step_tokens values")
    parser.add_argument("--seeds", default="32,1,2,3,4,5")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--prompt-ms", type=float, default=1.4)
    parser.add_argument("--row-ms", type=float, default=1.87)
    parser.add_argument("--shortest-first", action="store_true",
                        help="also: waiting prompts admitted shortest first (the scheduler does not do this)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    caps = [None if c == "none" else int(c) for c in args.caps.split(",")]
    policies = [("fifo", policy._rank)]
    if args.shortest_first:
        fifo = policy._rank
        policies.append(("shortest-first", lambda s: (*fifo(s)[:1], 0 if s.pages else len(s.tokens), *fifo(s)[1:])))
    out = {"benchmark": "prefill_chunks_model", "seeds": seeds, "rows": []}
    saved = policy._rank
    try:
        for name, rank in policies:
            policy._rank = rank
            for cap in caps:
                runs = [simulate(cap, seed, args) for seed in seeds]
                row = {"order": name, "prefill_step_tokens": cap,
                       **{k: round(statistics.mean(r[k] for r in runs), 2) for k in runs[0]}}
                out["rows"].append(row)
                print(f"{name:>14} prefill_step_tokens {cap!s:>5}: tok/s {row['tok_s']:6.1f}  TTFT p50 "
                      f"{row['ttft_p50_s']:.2f} s (max {row['ttft_max_s']:.2f})  inter-token p99 {row['itl_p99_ms']:.0f} ms"
                      f"  (means over {len(seeds)} seeds)")
    finally:
        policy._rank = saved
    print(json.dumps(out))


if __name__ == "__main__":
    main()
