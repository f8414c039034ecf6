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
Then one row per shape (the bf16 panels and the fp32 kernel): each shape's weight in enough copies to stream
from memory, one call a copy, the achieved GB/s of the kernel against a plain read of the same packed bytes by
the same threads, one call a copy too (`read_rate.cpp`), and the rate of one large read.
Then the 120 layer calls of one row replayed from a tape as a served step replays them (`mstar_core.nn.tape`),
with and without each call fetching the next call's weight near its end (`step_ms_replay_{bf16,fp32}` =
[no hints, hinted] ms, `hint_speedup_{bf16,fp32}`; alternated per round, medians).
Final line: JSON (bf16: `step_ms_onednn_R`, `step_ms_amx_R` or `step_ms_panels_R`, `speedup_R`; fp32:
`step_ms_onednn_fp32_R`, `step_ms_kernel_fp32_R`, `speedup_fp32_R`, per row count R; one row per shape:
`shape_1_{bf16,fp32}_NxK` = [us a call, kernel GB/s, read GB/s, us a cache-hot call]; `read_gbs_large`;
`cpu_flags`).

    python benchmarks/decode_linears.py [--quick] [--one-row] [--threads N]
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


def replay_hints(kernel, dtype, name, rounds, gen, out) -> None:
    """The layers' one-row calls replayed from a tape, without and with next-weight hints, alternated, into `out`."""
    from mstar_core.nn import tape as tapes

    if not tapes.available():
        return
    shapes = LAYER * LAYERS
    own = [kernel.pack(torch.randn(n, k, generator=gen).to(dtype)) for n, k in shapes]
    xs = {k: torch.randn(1, k, generator=gen).to(dtype) for k in (576, 1536)}
    recorded = tapes.Tape()
    with recorded.recording():
        for (n, k), packed in zip(shapes, own, strict=True):
            kernel.linear(xs[k], packed, n, None)
    if recorded.failure is not None:
        print(f"{name}: the step did not record ({recorded.failure})", flush=True)
        return
    per_thread = tapes.NEXT_WEIGHT_BYTES or 256 * 1024  # (the hints are off by default: the size tried)
    sides = {"plain": 0, "hinted": per_thread}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(2):  # warm-up
        recorded.replay()
    for _ in range(rounds * 5):  # (a replay takes a few ms: more rounds for the same time)
        for side, per_thread in sides.items():
            recorded.hint_next_weights(per_thread)
            started = time.perf_counter()
            recorded.replay()
            times[side].append(time.perf_counter() - started)
    plain, hinted = (statistics.median(times[side]) * 1e3 for side in sides)
    least = [min(times[side]) * 1e3 for side in sides]  # (what a shared box disturbs least)
    out[f"step_ms_replay_{name}"] = [round(plain, 2), round(hinted, 2)]
    out[f"step_ms_replay_least_{name}"] = [round(t, 2) for t in least]
    out[f"hint_speedup_{name}"] = round(plain / hinted, 3)
    print(f"{name} 1 row, the layers' 120 calls replayed: {plain:6.2f} ms, with next-weight hints "
          f"({per_thread >> 10} KB a thread) {hinted:6.2f} ms ({plain / hinted:.3f}x; least of "
          f"{len(times['plain'])}: {least[0]:6.2f} / {least[1]:6.2f} ms)", flush=True)


def read_rate():
    """`read(tensor, threads)`: `read_rate.cpp`'s plain read of a tensor's bytes (None: no kernels here)."""
    import ctypes
    from pathlib import Path

    from mstar_core.nn import native

    entry = native.function(Path(__file__).with_name("read_rate.cpp").resolve(), "mstar_read_rate",
                            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int], ctypes.c_uint64)
    if entry is None:
        return None
    return lambda t, threads: entry(t.data_ptr(), t.numel() * t.element_size() // 64 * 64, threads)


def one_row_shapes(kernel, dtype, name, threads, rounds, gen, out) -> None:
    """One row through each distinct shape of a step, against a plain read of the same bytes, into `out`.

    The kernel runs through its runner, resolved once, as `PackedLinear` calls it in a served step. `hot`: the
    same call over one copy, cache-resident for the layers' shapes (the head's 57-113 MB is not): what a call
    costs besides streaming its weight from memory.
    """
    read, run = read_rate(), kernel.runner()
    budget = (64 if rounds < 10 else 160) << 20  # bytes of copies a shape: well past the 32 MB L3
    for n, k in sorted(set(LAYER + [HEAD]), key=lambda s: s[0] * s[1]):
        copies = max(2, budget // (n * k * dtype.itemsize))
        packed = [kernel.pack(torch.randn(n, k, generator=gen).to(dtype)) for _ in range(copies)]
        x = torch.randn(1, k, generator=gen).to(dtype)
        size = packed[0].numel() * packed[0].element_size()
        sides = {"kernel": lambda w, x=x, n=n: run(x, w, n, None),
                 "hot": lambda w, x=x, n=n, hot=packed[0]: run(x, hot, n, None)}
        if read is not None:
            sides["read"] = lambda w: read(w, threads)
        times = {side: [] for side in sides}
        for fn in sides.values():
            for w in packed:
                fn(w)
        for _ in range(rounds):
            for side, fn in sides.items():
                started = time.perf_counter()
                for w in packed:
                    fn(w)
                times[side].append((time.perf_counter() - started) / copies)
        call, hot = statistics.median(times["kernel"]), statistics.median(times["hot"])
        floor = statistics.median(times["read"]) if read is not None else float("nan")
        out[f"shape_1_{name}_{n}x{k}"] = [round(call * 1e6, 1), round(size / call / 1e9, 1), round(size / floor / 1e9, 1),
                                          round(hot * 1e6, 1)]
        print(f"{name} 1 row {n:6d} x {k:5d} ({size / 1e6:5.1f} MB): {call * 1e6:7.1f} us a call, "
              f"{size / call / 1e9:5.1f} GB/s (a plain read: {floor * 1e6:7.1f} us, {size / floor / 1e9:5.1f} GB/s; "
              f"cache-hot call: {hot * 1e6:6.1f} us)", flush=True)
        del packed


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
            step_pair(shapes, weights, kernel, rows_list[:1] if args.one_row else rows_list, rounds, gen, labels, out)
            del weights
        for dtype, kernel, _, _ in sections:
            if kernel is not amx_linear:
                name = "bf16" if dtype == torch.bfloat16 else "fp32"
                replay_hints(kernel, dtype, name, rounds, gen, out)
                one_row_shapes(kernel, dtype, name, args.threads, rounds, gen, out)
        read = read_rate()
        if read is not None and not out.get("skipped"):
            large = torch.ones(256 << 20, dtype=torch.uint8)
            read(large, args.threads)
            took = min(_timed(lambda: read(large, args.threads)) for _ in range(3))
            out["read_gbs_large"] = round(large.numel() / took / 1e9, 1)
            print(f"a plain read of 256 MB by {args.threads} threads: {out['read_gbs_large']} GB/s", flush=True)
    return out


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 rounds per row count instead of 15")
    parser.add_argument("--one-row", action="store_true", help="the step at one row only (and the per-shape figures)")
    parser.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    print(json.dumps(main(parser.parse_args())))
