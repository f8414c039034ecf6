"""Where one Whisper request's decode step goes: wall and device-thread CPU per part, per step (issue 47).

In-process `AsyncEngine` on the benchmark's whisper-base-size random checkpoint (`whisper.py`'s), one request at a
time (c=1), 30-second espeak-ng clips, up to 96 tokens; timers (perf_counter and the calling thread's CPU clock) wrap
the decoder engine's step, the module forward, the tied head, the logits rules, and each layer's parts. At `--threads 1`
the device thread does all the work, so its CPU time is the work; at 2 the parallel kernels' second thread is not in it.
Timers add ~1-2 us a wrapped call; parts overlap (the head is inside `answers.finish`, the layers inside `forward`).

    python benchmarks/whisper_step.py [--threads N] [--clips N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whisper import clips, ensure_checkpoint

totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
recording = [False]


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        if not recording[0]:
            return fn(*args, **kwargs)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = totals[name]
            entry[0] += time.perf_counter() - wall
            entry[1] += time.thread_time() - cpu
            entry[2] += 1
    return wrapper


def instrument(decoder_engine) -> None:
    import mstar_whisper.modeling as modeling
    from mstar_kvcache import cross

    module = decoder_engine.module
    for layer in module.layers:
        a, c = layer.self_attn, layer.encoder_attn
        a.qkv = timed("self-attention q/k/v linear", a.qkv)
        a.out_proj.forward = timed("self-attention out linear", a.out_proj.forward)
        c.q_proj.forward = timed("cross q/out linears", c.q_proj.forward)
        c.out_proj.forward = timed("cross q/out linears", c.out_proj.forward)
        layer.fc1.forward = timed("MLP fc1", layer.fc1.forward)
        layer.fc2.forward = timed("MLP fc2", layer.fc2.forward)
        for norm in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm):
            norm.forward = timed("layer norms", norm.forward)
    modeling._gelu = timed("GELU", modeling._gelu)
    modeling._add_residual = timed("residual adds", modeling._add_residual)
    cross.CrossAttentionContext.cross_attend = timed("cross-attention (paged kernel, 1500 frames)",
                                                     cross.CrossAttentionContext.cross_attend)
    cross.CrossAttentionContext.attend = timed("self-attention (paged)", cross.CrossAttentionContext.attend)
    module.forward = timed("module forward (embeddings, 6 layers, norm)", module.forward)
    module.lm_head.forward = timed("tied head (51865 x 512, one row)", module.lm_head.forward)
    module.process_logits = timed("Whisper's logits rules", module.process_logits)
    decoder_engine.forward.run = timed("StepForward.run (batch, context, forward)", decoder_engine.forward.run)
    decoder_engine.answers.finish = timed("answers.finish (head, rules, sampling, answers)",
                                          decoder_engine.answers.finish)
    decoder_engine.step = timed("decoder engine step", decoder_engine.step)
    # (once a request: its encoder output projected to every layer's cross keys and values, stored in pool pages)
    decoder_engine.cross.store_waiting = timed("cross K/V store (once a request, in a step)",
                                               decoder_engine.cross.store_waiting)
    replay = getattr(decoder_engine, "replay", None)
    if replay is not None:  # (a replayed step runs none of the layer parts above: its kernels from C)
        replay.forward = timed("StepReplay.forward (embeddings, layers replayed or recorded)", replay.forward)


async def run(threads: int, count: int) -> None:
    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine

    torch.set_num_threads(threads)
    engine = AsyncEngine()
    await engine.load_model("whisper", LoadOptions(checkpoint=str(ensure_checkpoint("base"))),
                            settings={"decoder": {"num_pages": 1024}})
    instrument(engine.node_engines("whisper")["decoder"])
    audio = clips(count + 1, 30.0)

    async def one(samples) -> float:
        start = time.perf_counter()
        handle = engine.submit("whisper", {"audio": torch.from_numpy(samples), "language": "en", "max_tokens": 96})
        [o async for o in handle]
        await handle.result()
        return time.perf_counter() - start

    await one(audio[0])  # warm-up
    latencies = []
    recording[0] = True
    cpu = time.process_time()
    for samples in audio[1:]:
        latencies.append(await one(samples))
    recording[0] = False
    cpu = time.process_time() - cpu
    replay = getattr(engine.node_engines("whisper")["decoder"], "replay", None)
    replays = "no replay" if replay is None else f"{replay.replayed} steps replayed, {replay.recorded} recorded"
    await engine.close()
    steps = totals["decoder engine step"][2]
    print(f"threads {threads}, {count} requests at c=1: latency {', '.join(f'{x:.2f}' for x in latencies)} s, "
          f"process CPU {cpu / count:.2f} s a request, {steps} decoder steps (~{steps / count:.0f} a request: the "
          "cross K/V store, language detection, prompt, then decode); "
          f"{replays}")
    print(f"{'per step':52s} {'wall ms':>8s} {'thread CPU ms':>14s} {'calls/step':>10s}")
    for name, (wall, thread_cpu, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:52s} {wall * 1e3 / steps:8.2f} {thread_cpu * 1e3 / steps:14.2f} {calls / steps:10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clips", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(run(args.threads, args.clips))


if __name__ == "__main__":
    main()
