"""A decode step's linears, SmolLM2-135M's shapes: oneDNN's packed call against M*'s own kernel for this CPU.

Every linear of one SmolLM2-135M step (30 layers of qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down
576 x 1536, and the tied 49,152 x 576 head), each weight its own random tensor so the step streams every
weight from memory as a served step does. oneDNN side: `mkldnn._linear_pointwise` over the weights packed as
`PackedLinear` packs them for oneDNN (a one-row call run as two rows, as the layer does). Own side, where the
CPU has it:
  * bf16 on AMX (`amx_linear.linear`, `PackedLinear`'s path for up to 32 rows): 1, 2, 8 and 32 rows;
  * bf16 on AVX512-BF16 without AMX (`bf16_linear.linear`, its path for every row count): 1, 2, 8, 32 rows and
    the prefill-sized 128 and 512;
  * fp32 on AVX2 or AVX-512 (`fp32_linear.linear`, its path for every row count): the same six row counts.
Sides alternate per round; the median step of each is kept. Skips cleanly on a CPU with none.
Final line: JSON (bf16: `step_ms_onednn_R`, `step_ms_amx_R` or `step_ms_panels_R`, `speedup_R`; fp32:
`step_ms_onednn_fp32_R`, `step_ms_kernel_fp32_R`, `speedup_fp32_R`, per row count R; `cpu_flags`).

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
PREFILL_ROWS = (128, 512)  # (the panel kernels only: they take prefill chunks too)


def step_pair(shapes, weights, kernel, rows_list, rounds, gen, labels, out) -> None:
    """oneDNN against `kernel` (`amx_linear` or `fp32_linear`) over one step's weights, per row count, into `out`."""
    from mstar_core.nn.packed import PACK_ROWS_HINT

    dtype = weights[0].dtype
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights]
    own = [kernel.pack(w) for w in weights]
    linear = torch.ops.mkldnn._linear_pointwise

    def step_onednn(xs):
        for (_, k), packed in zip(shapes, onednn, strict=True):
            x = xs[k]
            linear(torch.cat((x, x)) if x.shape[0] == 1 else x, packed, None, "none", [], "")

    def step_own(xs):
        for (n, k), packed in zip(shapes, own, strict=True):
            kernel.linear(xs[k], packed, n, None)

    onednn_key, own_key, speedup_key, name = labels
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (576, 1536)}
        times = {"onednn": [], "own": []}
        for fn in (step_onednn, step_own):  # warm-up: primitives, first touch
            fn(xs)
        for _ in range(rounds):
            for side, fn in (("onednn", step_onednn), ("own", step_own)):
                started = time.perf_counter()
                fn(xs)
                times[side].append(time.perf_counter() - started)
        a, b = statistics.median(times["onednn"]) * 1e3, statistics.median(times["own"]) * 1e3
        out[f"{onednn_key}_{rows}"], out[f"{own_key}_{rows}"] = round(a, 2), round(b, 2)
        out[f"{speedup_key}_{rows}"] = round(a / b, 3)
        print(f"{dtype} {rows:3d} rows: oneDNN {a:7.2f} ms, {name} {b:7.2f} ms a step ({a / b:.2f}x)", flush=True)


def main(args: argparse.Namespace) -> dict:
    from vs_vllm import cpu_flags

    from mstar_core.nn import amx_linear, bf16_linear, fp32_linear

    torch.set_num_threads(args.threads)
    out: dict = {"benchmark": "decode_linears", "quick": args.quick, "threads": args.threads, "cpu_flags": cpu_flags()}
    sections = []
    if amx_linear.available():
        sections.append((torch.bfloat16, amx_linear, ROWS, ("step_ms_onednn", "step_ms_amx", "speedup", "AMX tiles")))
    elif bf16_linear.available():
        sections.append((torch.bfloat16, bf16_linear, ROWS + PREFILL_ROWS,
                         ("step_ms_onednn", "step_ms_panels", "speedup", "bf16 panels")))
    if fp32_linear.available():
        width = fp32_linear.vector_bits()
        sections.append((torch.float32, fp32_linear, ROWS + PREFILL_ROWS,
                         ("step_ms_onednn_fp32", "step_ms_kernel_fp32", "speedup_fp32", f"{width}-bit fp32 kernel")))
        out["fp32_kernel_bits"] = width
    if not sections:
        out["skipped"] = "no AVX2 CPU here (or no compiler)"
        return out
    shapes = LAYER * LAYERS + [HEAD]
    gen = torch.Generator().manual_seed(0)
    rounds = 4 if args.quick else 15
    with torch.inference_mode():
        for dtype, kernel, rows_list, labels in sections:
            weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes]
            step_pair(shapes, weights, kernel, rows_list, rounds, gen, labels, out)
            del weights
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 rounds per row count instead of 15")
    parser.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    print(json.dumps(main(parser.parse_args())))
