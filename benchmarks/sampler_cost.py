"""CPU milliseconds per `sample()` call of the kvcache sampler at the shapes the speech models sample.

Shapes: Qwen3-Omni's code predictor (a joined 30,720-id vocabulary, one head's 2,048 ids finite;
top-k 50, top-p 0.8) at 1 and 16 rows, one head alone (2,048 ids), and an Orpheus-like LM
(29,004 ids; repetition penalty 1.3 over 200 ids, temperature 0.6, top-p 0.8) at 1 and 16 rows.
Beside each, the same rows drawn the whole-vocabulary way (`filtered` + `draw`, the path every
row took before top-k rows sampled over their candidates; a row without top-k, like Orpheus's, takes
it on both sides, so ~1x there), alternating in blocks: process CPU
time at one thread, min and median over blocks, so other jobs on the box inflate it little.
Final line: JSON.

    python benchmarks/sampler_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def code_predictor_logits(rows: int, vocab: int = 30720, head: int = 2048) -> torch.Tensor:
    """Each row's own head finite, the other heads' ids -inf (what `CodePredictor.compute_logits` returns)."""
    gen = torch.Generator().manual_seed(0)
    out = torch.full((rows, vocab), float("-inf"))
    for r in range(rows):
        h = r % (vocab // head)
        out[r, h * head : (h + 1) * head] = torch.randn(head, generator=gen) * 3
    return out


def cases() -> list[tuple[str, torch.Tensor, object, list[list[int]]]]:
    from mstar_core.sampling import SamplingParams

    predictor = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)
    orpheus = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)
    gen = torch.Generator().manual_seed(1)
    seen = list(range(100, 300))
    return [
        ("code_predictor_1x30720", code_predictor_logits(1), predictor, [[]]),
        ("code_predictor_16x30720", code_predictor_logits(16), predictor, [[]] * 16),
        ("one_head_1x2048", torch.randn(1, 2048, generator=gen) * 3, predictor, [[]]),
        ("orpheus_1x29004", torch.randn(1, 29004, generator=gen) * 0.5, orpheus, [seen]),
        ("orpheus_16x29004", torch.randn(16, 29004, generator=gen) * 0.5, orpheus, [seen] * 16),
    ]


def whole_vocabulary(logits, params, generators, history):
    """The whole-vocabulary draw for every row (penalties, filters over all ids, one uniform number per row)."""
    from mstar_kvcache.sampler import adjust_logits, draw, filtered

    probs, keep = filtered(adjust_logits(logits, params, history, history), params)
    return draw(probs, keep, generators).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=9, help="alternating blocks per side")
    parser.add_argument("--calls", type=int, default=20, help="calls per block")
    args = parser.parse_args()
    from mstar_kvcache.sampler import sample

    torch.set_num_threads(1)
    sides = {"sample": lambda lg, ps, gs, h: sample(lg, ps, gs, h, logprobs=False).tokens,
             "whole_vocabulary": whole_vocabulary}
    result = {"benchmark": "sampler_cost", "load_average_start": round(os.getloadavg()[0], 2)}
    for name, logits, params, history in cases():
        rows = logits.shape[0]
        ms: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.blocks + 1):  # the first block warms up
            for side, fn in sides.items():
                gens = [torch.Generator().manual_seed(i) for i in range(rows)]
                start = time.process_time()
                for _ in range(args.calls):
                    fn(logits, [params] * rows, gens, history)
                ms[side].append((time.process_time() - start) / args.calls * 1e3)
        row = {f"{side}_ms_{stat}": round(f(v[1:]), 3) for side, v in ms.items()
               for stat, f in (("min", min), ("median", statistics.median))}
        row["speedup_median"] = round(row["whole_vocabulary_ms_median"] / row["sample_ms_median"], 2)
        result[name] = row
        print(f"{name}: sample {row['sample_ms_median']:.3f} ms, whole vocabulary {row['whole_vocabulary_ms_median']:.3f}"
              f" ms (medians; {row['speedup_median']}x)", flush=True)
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
