"""The decode-lane attention kernel (`lane_attention.cpp`) at a c=32 step's shapes, in GB/s of keys and values read.

SmolLM2-135M's attention (9 query heads over 3 KV heads of 64): `--rows` decoding rows in lanes of 64 to 400 keys
(a fixed seed), 30 layers of lanes so that a step streams its keys and values from memory as a served step does, one
kernel call a layer (each also stores the row's new key and value in its lane and the paged pool). The figure is the
bytes of keys and values the step attends over divided by the step's time (the median of `--rounds`), beside a
plain read of the same bytes by the same threads (`read_rate.cpp`, one call a layer's lanes). `--against SRC`:
another build of the kernel (a copy of lane_attention.cpp under another name, e.g. main's) alternated with this one
round by round, the same step (its results compared too). `--rows 1`: the c=1 call at `--keys` keys. `--threads 1`
times the calling thread's CPU time (what the box's other jobs disturb least); more threads, the wall time.
`--layers 1 --rows 2`: the arithmetic alone (the lanes stay in cache).

    python benchmarks/lane_attention.py [--quick] [--dtype bfloat16] [--rows 32] [--against /tmp/lane_main.cpp]

Final line: JSON (`step_ms` median, `best_ms`, `gbs`, `read_gbs`; per `--against` build, by its file's stem S:
`step_ms_S`, `best_ms_S`, `gbs_S`, `speedup_S` = its step over this one's, `max_abs_diff_S` of the outputs).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch
from mstar_attn_torch import lane_kernel
from mstar_attn_torch.backend import LanePlan

from mstar_core.nn import native

LAYERS, KV_HEADS, GROUP, DIM = 30, 3, 3, 64
READ_SOURCE = Path(__file__).with_name("read_rate.cpp")


def build_step(rows: int, keys: int | None, dtype: torch.dtype, copies: int = LAYERS, seed: int = 0):
    """Lanes `[copies, 2, lanes, kv heads, capacity, dim]` (head-major, as `DecodeLanes` keeps them; layer i reads
    copy i % copies), the step's q/k/v, its pool and slots, and the plan of `rows` rows (each a lane of 64-400 keys,
    or `keys`)."""
    gen = torch.Generator().manual_seed(seed)
    bound = torch.full((rows,), keys) if keys else torch.randint(64, 401, (rows,), generator=gen)
    capacity = (int(bound.max()) + 15) // 16 * 16
    lanes = torch.randn(copies, 2, rows, KV_HEADS, capacity, DIM, generator=gen).to(dtype)
    q = torch.randn(rows, KV_HEADS * GROUP, DIM, generator=gen).to(dtype)
    k = torch.randn(rows, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(rows, KV_HEADS, DIM, generator=gen).to(dtype)
    pool = torch.zeros(LAYERS, 2, 4 * rows, KV_HEADS, DIM, dtype=dtype)
    slots = torch.randperm(4 * rows, generator=gen)[:rows]
    order = torch.randperm(rows, generator=gen)
    plan = LanePlan(order, torch.arange(rows), bound - 1, rows, int(bound.max()), None, True, None, bound)
    return lanes, q, k, v, pool, slots, plan


def step_runner(kernel, step, scale: float):
    """One step's 30 layer calls through `kernel` into a fresh output per layer; returns (run, outputs)."""
    lanes, q, k, v, pool, slots, plan = step
    kv = lanes.transpose(3, 4)  # [layers, 2, lanes, capacity, kv heads, dim] over head-major memory, as DecodeLanes.kv
    call = lane_kernel.LaneCall(kernel, plan)
    outs = torch.empty(LAYERS, *q.shape, dtype=q.dtype)
    store_k, store_v = kv[:, 0], kv[:, 1]
    copies = kv.shape[0]
    assert call.fits(q, k, v, store_k[0])
    call.prepare(q, k, v, store_k[0], outs[0], scale, (pool[0, 0], pool[0, 1], slots))
    layer_bytes = store_k.stride(0) * store_k.element_size()
    pool_bytes = pool.stride(0) * pool.element_size()
    args = [(q.data_ptr(), k.data_ptr(), v.data_ptr(), store_k.data_ptr() + i % copies * layer_bytes,
             store_v.data_ptr() + i % copies * layer_bytes, pool.data_ptr() + i * pool_bytes,
             pool[0, 1].data_ptr() + i * pool_bytes, outs[i].data_ptr()) for i in range(LAYERS)]

    def run():
        for a in args:
            call.call(*a)

    run.keep = (step, kv, pool)  # (the calls take raw pointers: the tensors must outlive them)

    return run, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 60 s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--keys", type=int, default=0, help="every row's key count (0: 64-400, random)")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--layers", type=int, default=LAYERS, help="copies of the lanes in memory (layer i reads copy i %% layers; 1 with few --rows: from cache)")
    parser.add_argument("--against", type=Path, action="append", default=[],
                        help="another lane_attention.cpp (a copy under another name; repeatable)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rounds = args.rounds or (15 if args.quick else 60)
    scale = DIM**-0.5
    kernel = lane_kernel.kernel_for(dtype)
    if kernel is None:
        raise SystemExit("no lane kernel here (no compiler)")
    kernels = {"own": kernel}
    for source in args.against:
        kernels[source.stem] = native.function(source, lane_kernel._ENTRY_POINTS[dtype],
                                               [ctypes.POINTER(lane_kernel.LanePlan)] + [ctypes.c_void_p] * 8, ctypes.c_int)
    runs = {}
    for name, fn in kernels.items():
        step = build_step(args.rows, args.keys, dtype, args.layers)
        runs[name] = step_runner(fn, step, scale)
    bound = build_step(args.rows, args.keys, dtype)[-1].bound
    step_bytes = LAYERS * 2 * KV_HEADS * DIM * int(bound.sum()) * torch.empty((), dtype=dtype).element_size()
    times = {name: [] for name in runs}
    # on one thread, its CPU time (the calls run on the calling thread): time the box's other work takes from it is
    # left out (a busy shared box), the kernel's own stalls on memory are not
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for _ in range(rounds):
        for name, (run, _) in runs.items():
            start = clock()
            run()
            times[name].append(clock() - start)
    result = {"dtype": args.dtype, "rows": args.rows, "threads": torch.get_num_threads(), "step_mb": step_bytes / 1e6}
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        suffix = "" if name == "own" else "_" + name
        result["step_ms" + suffix] = round(ms, 3)
        result["best_ms" + suffix] = round(min(ts) * 1e3, 3)
        result["gbs" + suffix] = round(step_bytes / ms / 1e6, 2)
    for name in runs:
        if name != "own":
            result["speedup_" + name] = round(result["step_ms_" + name] / result["step_ms"], 3)
            result["max_abs_diff_" + name] = (runs["own"][1].float() - runs[name][1].float()).abs().max().item()
    read = native.function(READ_SOURCE, "mstar_read_rate", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int], ctypes.c_uint64)
    if read is not None:  # the same bytes read plainly: each layer's lanes (whole capacity) in one call
        lanes = build_step(args.rows, args.keys, dtype, args.layers)[0]
        layer = lanes[0].numel() * lanes.element_size()
        ts = []
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(LAYERS):
                read(lanes[i % args.layers].data_ptr(), layer // 64 * 64, torch.get_num_threads())
            ts.append(time.perf_counter() - start)
        result["read_gbs"] = round(LAYERS * layer / statistics.median(ts) / 1e9, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
