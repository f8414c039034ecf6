"""What masking a padded vocabulary costs a sampling step: `NoTokenColumns.fill` + `sample()` against `sample()` alone.

Shapes: Qwen2's 151,936 logit columns for 151,665 tokens (a 271-id padded tail) at 1 and 16 rows, the same with
20 holes below the tail (a tokenizer with gaps: one `index_fill_` more), and the tiny Llama preset's 448 for 431.
Rows sample as a chat request does by default (temperature 1) and greedily. Alternating blocks, process CPU time
at one thread, medians over blocks (other jobs on the box inflate both sides alike). Final line: JSON.

    python benchmarks/no_token_mask.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def cases():
    from mstar_core.grammar import GrammarVocab

    def vocab(width: int, tokens: int, holes: tuple[int, ...] = ()) -> GrammarVocab:
        return GrammarVocab((b"",) * width, (), width, (*holes, *range(tokens, width)))

    gaps = tuple(range(151000, 151020))
    return [("qwen2_1x151936", 1, vocab(151936, 151665)), ("qwen2_16x151936", 16, vocab(151936, 151665)),
            ("qwen2_holes_16x151936", 16, vocab(151936, 151665, gaps)), ("tiny_llama_1x448", 1, vocab(448, 431))]


def _per_call_ms(base: torch.Tensor, calls: int, fn) -> float:
    """CPU ms of `fn(logits)` per call, each on a fresh copy of `base` made (untimed) just before, as the LM head
    hands the engine a tensor it has just written."""
    spent = 0.0
    for _ in range(calls):
        logits = base.clone()
        start = time.process_time()
        fn(logits)
        spent += time.process_time() - start
    return spent / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks (under a minute)")
    args = parser.parse_args()
    blocks, calls = (5, 10) if args.quick else (15, 20)
    from mstar_kvcache.no_token import NoTokenColumns
    from mstar_kvcache.sampler import sample

    from mstar_core.sampling import SamplingParams

    torch.set_num_threads(1)
    result = {"benchmark": "no_token_mask", "quick": args.quick, "load_average_start": round(os.getloadavg()[0], 2)}
    for name, rows, vocab in cases():
        columns = NoTokenColumns.of(vocab, vocab.vocab_size, torch.device("cpu"))
        base = torch.randn(rows, vocab.vocab_size, generator=torch.Generator().manual_seed(0)) * 3
        for mode, params in (("t1", SamplingParams(temperature=1.0)), ("greedy", SamplingParams())):
            sides = {"sample": lambda lg: lg, "fill_and_sample": columns.fill}
            ms: dict[str, list[float]] = {side: [] for side in sides}
            fill_ms: list[float] = []
            for _ in range(blocks + 1):  # the first block warms up
                for side, mask in sides.items():
                    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
                    ps, hist = [params] * rows, [[]] * rows
                    ms[side].append(_per_call_ms(base, calls, lambda lg, m=mask, g=gens, ps=ps, h=hist: sample(
                        m(lg), ps, g, h, logprobs=False)))
                fill_ms.append(_per_call_ms(base, calls, columns.fill))
            row = {f"{side}_ms_median": round(statistics.median(v[1:]), 4) for side, v in ms.items()}
            row["fill_ms_median"] = round(statistics.median(fill_ms[1:]), 4)
            row["fill_share_of_sample"] = round(row["fill_ms_median"] / row["sample_ms_median"], 4)
            result[f"{name}_{mode}"] = row
            print(f"{name} {mode}: sample {row['sample_ms_median']:.3f} ms, fill+sample "
                  f"{row['fill_and_sample_ms_median']:.3f} ms, fill alone {row['fill_ms_median']:.4f} ms "
                  f"({100 * row['fill_share_of_sample']:.2f}% of sample)", flush=True)
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
