"""Wan2.2 TI2V: M* (`mstar_wan` on AsyncEngine) against diffusers' `WanPipeline` run request by request, and the
diffusion engine's step cache (speed-up and quality against the uncached video, same seed).

Both sides load the same random weights (a preset in the diffusers layout, bigger than `tiny` so the DiT
dominates, written once into the preset cache) in this process. M* batches every request's CFG rows (cond + uncond) into one DiT forward and, at
c=4, the rows of all four requests; diffusers runs two forwards per step, one request after another.

- `p50_ratio_c1`: p50 latency of one job alone, M* over diffusers.
- `p50_ratio_c4`: four jobs arriving together: M*'s p50 job latency over the p50 of diffusers serving them one
  after another (job k finishes after k pipeline calls).
- `cpu_ratio_c1`: CPU seconds of this process per job alone, M* over diffusers (less sensitive to the box's load).
- `cache_speedup`, `cache_psnr_db`, `cache_ssim`, `cache_reused_fraction`: a job with `step_cache_threshold`
  against the same job uncached, both at `cache_steps` (20) steps (wall time ratio; PSNR (capped at 99) / SSIM of
  the uint8 videos; the share of DiT rows that skipped every block).
- `peak_rss_mb`: the process's peak resident memory (both sides share the process; CPU has no per-side peak).

Shape (full): DiT 4 heads x 64 (dim 256), 8 layers, FFN 1024; 192x192, 17 frames (5 x 6 x 6 latents: 180
tokens); 20 UniPC steps, guidance 5. `--quick` (< 60 s on 2 idle cores): 4 layers, 128x128, 9 frames, 8 steps (the
step cache at 20). On this shared CPU box the ratios are noisy; the JSON line carries the load average at start and
end.

    python benchmarks/wan_video.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_wan.checkpoint import SERVING_FILE, TINY_SCHEDULER, TINY_TEXT, TINY_VAE, write_preset

from mstar_core.checkpoint.presets import ensure_preset
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

TIME_DAMPING = 0.05
PRESET_VERSION = 1  # (bump when the preset's shapes or weights change)
PROMPTS = ["a red fox running through snow", "a lighthouse at night", "waves on a beach", "a city street in rain"]


def shape(quick: bool) -> dict:
    # the step cache is measured at 20 steps in both: how much a cache may reuse depends on how far each step
    # moves the latents, so its figure at 8 steps would be about the step count, not the cache
    return {"layers": 4 if quick else 8, "side": 128 if quick else 192, "frames": 9 if quick else 17,
            "steps": 8 if quick else 20, "cache_steps": 20, "runs": 2 if quick else 5}


def write_bench_preset(directory: Path, layers: int) -> Path:
    transformer = {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 4,
                   "attention_head_dim": 64, "in_channels": 48, "out_channels": 48, "text_dim": 64,
                   "freq_dim": 256, "ffn_dim": 1024, "num_layers": layers, "cross_attn_norm": True,
                   "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 64}
    text = dict(TINY_TEXT, d_model=64, d_kv=16, d_ff=128, num_heads=4)
    serving = {"max_sequence_length": 64, "height": 64, "width": 64, "num_frames": 9, "num_steps": 8,
               "guidance_scale": 5.0, "fps": 8, "size_scale": 1.0, "decode_chunk_frames": 2}
    write_preset(directory, transformer, TINY_VAE, text, dict(TINY_SCHEDULER, flow_shift=5.0), serving, seed=0)
    # A trained DiT's blocks change little from one step to the next; seeded random ones change completely (the
    # first block's residual moves by more than its own size each step, so no cache would ever reuse anything).
    # Damping the timestep's projection makes consecutive steps differ as a trained model's do (a few percent).
    path = directory / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(path))
    for name in ("condition_embedder.time_proj.weight", "condition_embedder.time_proj.bias"):
        state[name] = state[name] * TIME_DAMPING
    save_file(state, str(path), metadata={"format": "pt"})
    return directory


def bench_preset(layers: int) -> Path:
    """The preset's directory, written once into the preset cache (the same seeded weights on every run)."""
    return ensure_preset(f"wan-bench-{layers}l-d{TIME_DAMPING}-v{PRESET_VERSION}", SERVING_FILE,
                         lambda d: write_bench_preset(d, layers))


def request(i: int, s: dict, seed: int) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "height": s["side"], "width": s["side"], "num_frames": s["frames"],
            "num_steps": s["steps"], "guidance_scale": 5.0, "seed": seed}


def diffusers_pipe(directory: Path):
    import diffusers

    pipe = diffusers.WanPipeline.from_pretrained(str(directory))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_job(pipe, i: int, s: dict, seed: int) -> None:
    pipe(PROMPTS[i % len(PROMPTS)], negative_prompt="", height=s["side"], width=s["side"], num_frames=s["frames"],
         num_inference_steps=s["steps"], guidance_scale=5.0, max_sequence_length=64,
         generator=torch.Generator().manual_seed(seed), output_type="np")


async def measure(directory: Path, s: dict, threshold: float) -> dict:
    """Both sides in one process, interleaved run by run (the box's load drifts; each pair sees the same)."""
    pipe = diffusers_pipe(directory)
    out: dict = {k: [] for k in ("m_c1", "d_c1", "m_cpu", "d_cpu", "m_c4", "d_c4", "cached", "uncached",
                                 "videos", "cached_videos")}
    async with AsyncEngine() as plain, AsyncEngine() as cache:
        # (setup, not measured: the two engines load and warm up side by side)
        await asyncio.gather(plain.load_model("wan", LoadOptions(checkpoint=str(directory))),
                             cache.load_model("wan", LoadOptions(checkpoint=str(directory)),
                                              settings={"denoise": {"step_cache_threshold": threshold}}))
        warm = request(0, dict(s, steps=1), 0)
        await asyncio.gather(plain.generate("wan", warm), cache.generate("wan", warm))
        diffusers_job(pipe, 0, dict(s, steps=1), 0)

        async def timed(engine, req):
            t0 = time.perf_counter()
            env = await engine.generate("wan", req)
            return time.perf_counter() - t0, env

        for r in range(s["runs"]):
            c0 = time.process_time()
            dt, env = await timed(plain, request(r, s, 100 + r))
            out["m_cpu"].append(time.process_time() - c0)
            out["m_c1"].append(dt)
            c0, t0 = time.process_time(), time.perf_counter()
            diffusers_job(pipe, r, s, 100 + r)
            out["d_c1"].append(time.perf_counter() - t0)
            out["d_cpu"].append(time.process_time() - c0)
        cache_shape = dict(s, steps=s["cache_steps"])
        for r in range(s["runs"]):  # the same job uncached and cached, alternately
            dt, env = await timed(plain, request(r, cache_shape, 100 + r))
            out["uncached"].append(dt)
            out["videos"].append(env["video"])
            dt, env = await timed(cache, request(r, cache_shape, 100 + r))
            out["cached"].append(dt)
            out["cached_videos"].append(env["video"])
        for r in range(max(1, s["runs"] // 2)):
            got = await asyncio.gather(*(timed(plain, request(i, s, 200 + 4 * r + i)) for i in range(4)))
            out["m_c4"].extend(dt for dt, _ in got)
            done = 0.0
            for i in range(4):  # request by request: job i waits for the ones before it
                t0 = time.perf_counter()
                diffusers_job(pipe, i, s, 200 + 4 * r + i)
                done += time.perf_counter() - t0
                out["d_c4"].append(done)
        stats = cache.node_engines("wan")["denoise"].stats()
        out["reused"] = stats["diffusion_cache_reused_rows"] / max(1, stats["diffusion_cache_reused_rows"]
                                                                   + stats["diffusion_cache_computed_rows"])
    return out


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a.float() - b.float()) ** 2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0**2 / mse)).item()


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 7) -> float:
    """Mean SSIM of the frames' luma (uniform window), in [−1, 1]."""
    def luma(v):
        v = v.float()
        return (0.299 * v[..., 0] + 0.587 * v[..., 1] + 0.114 * v[..., 2])[:, None]  # [T, 1, H, W]

    x, y = luma(a), luma(b)
    pool = torch.nn.functional.avg_pool2d
    k = min(window, x.shape[-1], x.shape[-2])
    mx, my = pool(x, k, 1), pool(y, k, 1)
    vx, vy = pool(x * x, k, 1) - mx**2, pool(y * y, k, 1) - my**2
    cov = pool(x * y, k, 1) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean())


def since_process_start(fallback_t0: float) -> float:
    """Seconds since this process started (Linux: /proc), else since `fallback_t0` (perf_counter)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - fallback_t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache-threshold", type=float, default=0.5)
    args = parser.parse_args()
    s = shape(args.quick)
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    m = asyncio.run(measure(bench_preset(s["layers"]), s, args.cache_threshold))
    med = statistics.median
    pairs = list(zip(m["cached_videos"], m["videos"], strict=True))
    out = {
        "bench": "wan_video", "quick": args.quick,
        **{k: s[k] for k in ("layers", "side", "frames", "steps", "cache_steps")},
        "mstar_p50_c1_s": round(med(m["m_c1"]), 3), "diffusers_p50_c1_s": round(med(m["d_c1"]), 3),
        "p50_ratio_c1": round(med(m["m_c1"]) / med(m["d_c1"]), 3),
        "cpu_ratio_c1": round(med(m["m_cpu"]) / med(m["d_cpu"]), 3),
        "mstar_p50_c4_s": round(med(m["m_c4"]), 3), "diffusers_p50_c4_s": round(med(m["d_c4"]), 3),
        "p50_ratio_c4": round(med(m["m_c4"]) / med(m["d_c4"]), 3),
        "cache_threshold": args.cache_threshold, "cache_reused_fraction": round(m["reused"], 3),
        "cache_speedup": round(med(m["uncached"]) / med(m["cached"]), 3),
        "cache_psnr_db": round(statistics.mean(min(psnr(a, b), 99.0) for a, b in pairs), 2),
        "cache_ssim": round(statistics.mean(ssim(a, b) for a, b in pairs), 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "wall_s": round(since_process_start(t0), 1),  # the whole run: imports, the preset, loads, and the jobs
        "load_avg_start": round(load_start, 2), "load_avg_end": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
    # Nothing is left to write: skip the interpreter's teardown, which took 5-6 s here (freeing both sides'
    # modules and tensors one object at a time) after the figures were out
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
