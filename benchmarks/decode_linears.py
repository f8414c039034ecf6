"""A decode step's bf16 linears, SmolLM2-135M's shapes: oneDNN's packed call against the AMX tile kernel.

Every linear of one SmolLM2-135M step (30 layers of qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down
576 x 1536, and the tied 49,152 x 576 head), each weight its own random bf16 tensor so the step streams all
268 MB from memory as a served step does, at 1, 2, 8 and 32 rows. oneDNN side: `mkldnn._linear_pointwise`
over the weights packed as `PackedLinear` packs them (a one-row call run as two rows, as the layer does);
AMX side: `amx_linear.linear` over the tile-packed weights (`PackedLinear`'s path for up to 32 rows). Sides
alternate per round; the median step of each is kept. Needs a CPU with AMX (skips cleanly without).
Final line: JSON (`step_ms_onednn_R`, `step_ms_amx_R`, `speedup_R` per row count R, `cpu_flags`).

    python benchmarks/decode_linears.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

#: (out, in) of one layer's linears, then the tied LM head
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30
ROWS = (1, 2, 8, 32)


def main(args: argparse.Namespace) -> dict:
    from vs_vllm import cpu_flags

    from mstar_core.nn import amx_linear
    from mstar_core.nn.packed import PACK_ROWS_HINT

    torch.set_num_threads(args.threads)
    out: dict = {"benchmark": "decode_linears", "quick": args.quick, "threads": args.threads, "cpu_flags": cpu_flags()}
    if not amx_linear.available():
        out["skipped"] = "no AMX tiles on this CPU (or no compiler)"
        return out
    shapes = LAYER * LAYERS + [HEAD]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights]
    tiles = [amx_linear.pack(w) for w in weights]
    linear = torch.ops.mkldnn._linear_pointwise
    rounds = 4 if args.quick else 15

    def step_onednn(xs):
        for (_, k), packed in zip(shapes, onednn, strict=True):
            x = xs[k]
            linear(torch.cat((x, x)) if x.shape[0] == 1 else x, packed, None, "none", [], "")

    def step_amx(xs):
        for (n, k), packed in zip(shapes, tiles, strict=True):
            amx_linear.linear(xs[k], packed, n, None)

    with torch.inference_mode():
        for rows in ROWS:
            xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
            times = {"onednn": [], "amx": []}
            for fn in (step_onednn, step_amx):  # warm-up: primitives, first touch
                fn(xs)
            for _ in range(rounds):
                for side, fn in (("onednn", step_onednn), ("amx", step_amx)):
                    started = time.perf_counter()
                    fn(xs)
                    times[side].append(time.perf_counter() - started)
            a, b = statistics.median(times["onednn"]) * 1e3, statistics.median(times["amx"]) * 1e3
            out[f"step_ms_onednn_{rows}"], out[f"step_ms_amx_{rows}"] = round(a, 2), round(b, 2)
            out[f"speedup_{rows}"] = round(a / b, 3)
            print(f"{rows:2d} rows: oneDNN {a:6.2f} ms, AMX tiles {b:6.2f} ms a step ({a / b:.2f}x)", flush=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 rounds per row count instead of 15")
    parser.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    print(json.dumps(main(parser.parse_args())))
