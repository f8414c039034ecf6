"""A prompt chunk's causal attention: M*'s prefill kernel (mstar_attn_torch/prefill_attention.cpp) against torch's.

Both sides take what the torch backend hands a layer: queries `[rows, q heads, D]` and keys / values `[rows, kv heads,
D]` as views of one fused projection (rows strided), SmolLM2-135M's heads (9 query, 3 KV, 64) unless told; torch's
side is the backend's call before the kernel (`scaled_dot_product_attention` over the transposed views, `is_causal`,
`enable_gqa`), the kernel's side `prefill_kernel.attend`. Best of `--reps` calls each, alternated, both threads; the
per-layer figure times the model's 30 layers is what a prompt of that length spends in attention.

    python benchmarks/prefill_attention.py            # 64, 94, 128, 256, 512 rows; fp32 and bf16
    python benchmarks/prefill_attention.py --quick    # 94 and 256 rows
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> dict:
    from mstar_attn_torch import prefill_kernel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", default=None, help="comma-separated chunk lengths")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    rows_list = [int(r) for r in (args.rows or ("94,256" if args.quick else "64,94,128,256,512")).split(",")]
    hq, hkv, dim = (int(x) for x in args.heads.split(","))
    out: dict = {"benchmark": "prefill_attention", "threads": torch.get_num_threads(), "heads": [hq, hkv, dim],
                 "layers": args.layers, "kernel_active": prefill_kernel.kernel_for(torch.float32) is not None}
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype is torch.float32 else "bf16"
        for rows in rows_list:
            fused = torch.randn(rows, hq + 2 * hkv, dim).to(dtype)
            q, k, v = fused[:, :hq], fused[:, hq : hq + hkv], fused[:, hq + hkv :]
            res = torch.empty(rows, hq, dim, dtype=dtype)

            def torch_side(q=q, k=k, v=v):
                qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=dim**-0.5, enable_gqa=True)

            def kernel_side(q=q, k=k, v=v, res=res):
                assert prefill_kernel.attend(q, k, v, res, 0, dim**-0.5)

            if not out["kernel_active"]:
                print("the prefill kernel does not compute on this machine (AVX-512 builds only): torch's side alone")
            sides = {"torch": torch_side, **({"kernel": kernel_side} if out["kernel_active"] else {})}
            times = {s: min(best_ms(fn, args.reps // 2) for _ in range(2)) for s, fn in sides.items()}  # alternated
            if "kernel" in times:
                ref = torch_side()[0].transpose(0, 1).float()
                err = (res.float() - ref).abs().max().item()
                out[f"max_abs_diff_{name}_{rows}"] = err
            flops = 4 * hq * dim * rows * (rows + 1) / 2  # scores and weighted sum over each row's causal keys
            for side, ms in times.items():
                out[f"{side}_ms_{name}_{rows}"] = round(ms, 4)
                print(f"{name} {rows:4d} rows  {side:6s} {ms:7.3f} ms a layer ({flops / ms / 1e6:6.1f} GFLOP/s), "
                      f"{ms * args.layers:6.2f} ms over {args.layers} layers")
            if "kernel" in times:
                out[f"speedup_{name}_{rows}"] = round(times["torch"] / times["kernel"], 2)
    out["load"] = os.getloadavg()[0]
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
