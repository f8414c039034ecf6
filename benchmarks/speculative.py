"""Speculative decoding (prompt lookup) against plain decoding: the real SmolLM2-135M, one request at a time.

Two `AsyncEngine`s serve the same loaded weights in this process, one with the `lm` node's setting
`speculative: {method: ngram, ...}` and one without; requests go through `submit` and the conductor's decode
loop exactly as a server's do, alternating between the two sides prompt by prompt (same run, same load).

- `spec_speedup_c1`: tokens/s with speculation over tokens/s without, on a repetitive workload: a given
  passage to copy out again with a small edit (what editing, quoting and summarising look like to a model: most
  of the reply is in the prompt). Greedy, `--tokens` tokens per reply.
- `spec_text_identical`: every greedy reply with speculation is token for token the reply without it.
- `spec_speedup_random`: the same ratio on prompts of random words, where prompt lookup rarely finds its guess
  (the target is "never slower": >= 0.97).
- `spec_acceptance`: guesses kept over guesses verified, on each workload.

Timing ratios on a shared, loaded box are noisy: the load average is printed with them.

    python benchmarks/speculative.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PASSAGES = [
    "The river town of Ashford grew up around a stone bridge built in the twelfth century. For hundreds of years "
    "the bridge carried wool carts to the market on the far bank, and the inns along the water street grew rich "
    "on the traders who stopped there. When the railway arrived in 1852 the market moved to the station, the inns "
    "closed one by one, and the bridge became a quiet crossing for farmers and walkers.",
    "To replace a bicycle inner tube, first release the brake and remove the wheel from the frame. Push one tyre "
    "lever under the bead of the tyre, hook it to a spoke, and run a second lever around the rim until one side "
    "of the tyre is free. Pull out the old tube, check the inside of the tyre for thorns or glass, and fit the new "
    "tube with a little air in it so that it does not twist.",
    "Our quarterly report shows that revenue rose by eight percent compared with the same period last year, "
    "driven mostly by stronger sales in the northern region. Operating costs were flat, so the margin improved "
    "to fourteen percent. The board has approved a new warehouse near the port, which should shorten delivery "
    "times for customers on the coast from five days to three.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Light energy is absorbed by chlorophyll and "
    "used to split water molecules, releasing oxygen as a by-product. The energy captured in this way is stored "
    "in two carrier molecules, which then power the reactions that turn carbon dioxide from the air into sugars "
    "the plant can use to grow.",
    "The meeting on Tuesday agreed three actions. First, the design team will send the revised floor plans to "
    "the council before the end of the month. Second, the budget for the garden will be cut by a fifth to pay for "
    "the extra parking spaces. Third, residents will be invited to an open evening in the new community hall "
    "once the roof has been finished.",
    "Sourdough bread is made without commercial yeast. A starter of flour and water is left to ferment for several "
    "days until wild yeasts and bacteria make it bubble and smell slightly sour. A portion of the starter is mixed "
    "into the dough, which then rises slowly over many hours, giving the loaf its open crumb, its chewy crust and "
    "its gentle tang.",
]

EDIT = "\n\nThe same text again, copied out word for word with the spelling checked:\n\n"


def repetitive_prompts(count: int) -> list[str]:
    return [passage + EDIT for passage in PASSAGES[:count]]


def random_prompts(count: int, seed: int = 7) -> list[str]:
    words = sorted({w.strip(".,") for p in PASSAGES for w in p.split()})
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(40, 90))) for _ in range(count)]


async def _reply(engine, model: str, ids: list[int], tokens: int) -> tuple[list[int], float, float]:
    """The reply's tokens, its wall time and the process CPU time it took (less disturbed by other jobs)."""
    started, cpu = time.perf_counter(), time.process_time()
    handle = engine.submit(model, {"input_ids": ids, "max_tokens": tokens, "ignore_eos": True})
    out = [int(o.value) async for o in handle if o.name == "next_token"]
    return out, time.perf_counter() - started, time.process_time() - cpu


async def run(args) -> dict:
    import torch

    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine
    from mstar_llm import load_llm

    torch.set_num_threads(args.threads)
    loaded = load_llm(LoadOptions(preset="smollm2", dtype=args.dtype), progress=False)
    tokenizer = loaded.extras["tokenizer"]
    speculative = {"method": "ngram", "num_tokens": args.num_tokens, "max_ngram": args.max_ngram,
                   "min_ngram": args.min_ngram}
    # no prefix caching: every prompt is computed on both sides, whichever side ran it first
    plain, spec = AsyncEngine(), AsyncEngine()
    await plain.add_model(loaded, settings={"lm": {"enable_prefix_caching": False}})
    await spec.add_model(loaded, settings={"lm": {"enable_prefix_caching": False, "speculative": speculative}})
    model = loaded.name
    spec_lm = spec.node_engines(model)["lm"]
    results: dict = {"dtype": args.dtype or "float32", "tokens": args.tokens, "speculative": speculative,
                     "threads": args.threads, "load_avg_start": round(os.getloadavg()[0], 2)}
    try:
        warm = tokenizer.encode(PASSAGES[-1] + EDIT).ids
        for side in (plain, spec):  # first forwards record their replays and fault the weights in: not timed
            await _reply(side, model, warm, 16)
        identical = True
        for name, prompts in (("repetitive", repetitive_prompts(args.prompts)), ("random", random_prompts(args.prompts))):
            times = {"plain": 0.0, "spec": 0.0}
            cpu = {"plain": 0.0, "spec": 0.0}
            made = {"plain": 0, "spec": 0}
            before = spec_lm.stats()
            for i, text in enumerate(prompts):
                ids = tokenizer.encode(text).ids
                order = [("plain", plain), ("spec", spec)]
                if i % 2:
                    order.reverse()  # sides alternate which goes first
                replies = {}
                for side, engine in order:
                    for _ in range(args.repeats):
                        tokens, seconds, cpu_seconds = await _reply(engine, model, ids, args.tokens)
                        times[side] += seconds
                        cpu[side] += cpu_seconds
                        made[side] += len(tokens)
                    replies[side] = tokens
                identical = identical and replies["plain"] == replies["spec"]
                if name == "repetitive" and i == 0:
                    results["sample_reply"] = tokenizer.decode(replies["spec"])[:160]
            after = spec_lm.stats()
            proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            key = "c1" if name == "repetitive" else "random"
            plain_rate, spec_rate = made["plain"] / times["plain"], made["spec"] / times["spec"]
            results[f"plain_tok_s_{name}"] = round(plain_rate, 1)
            results[f"spec_tok_s_{name}"] = round(spec_rate, 1)
            results[f"spec_speedup_{key}"] = round(spec_rate / plain_rate, 3)
            # the same ratio in process CPU time per token (what a quiet machine's wall time would show)
            results[f"spec_speedup_{key}_cpu_clock"] = round((cpu["plain"] / made["plain"]) / (cpu["spec"] / made["spec"]), 3)
            results[f"spec_acceptance_{name}"] = round(accepted / proposed, 3) if proposed else None
        results["spec_text_identical"] = identical
    finally:
        await plain.close()
        await spec.close()
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def torch_threads() -> int:
    return len(os.sched_getaffinity(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts per workload, 48 tokens (under a minute on a quiet box)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per workload (at most 6)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per reply")
    parser.add_argument("--repeats", type=int, default=1, help="replies per prompt and side")
    parser.add_argument("--dtype", default=None, help="weights' dtype (default float32; bfloat16)")
    parser.add_argument("--threads", type=int, default=torch_threads(), help="torch threads (default: every core)")
    parser.add_argument("--num-tokens", type=int, default=8, help="guesses per step")
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--min-ngram", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.tokens = 2, 48
    args.prompts = max(1, min(args.prompts, len(PASSAGES)))
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
