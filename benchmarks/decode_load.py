"""Where M*'s wall time goes at c=32 (vs_llamacpp.py's workload, in-process): prefill, decode, and between steps.

The real SmolLM2-135M directory `vs_llamacpp.py` exports (the benchmark cache; a run of vs_vllm.py or vs_llamacpp.py
writes it) is served by an `AsyncEngine` with the `llama` preset's defaults; a closed-loop client keeps `--concurrency`
requests in flight over `--waves` x c requests (prompts of 64-200 tokens, 128 output tokens, greedy, ignore_eos), as the
HTTP benchmark does, without HTTP. Every kvcache step is timed (wall and the device thread's CPU time) and split into
the forward (linears and paged attention), the LM head + sampling, and the rest of the step; steps are classed as
decode-only (every row one token), mixed (decode rows and a prefill chunk) or prefill-only. The time between steps
(the conductor, request handles, the event loop: the runtime's per-step cost) and the TTFT / inter-token figures come
with them, and the event loop thread's CPU per output token. CPU time is what the box's other jobs disturb least; read
wall figures with the load printed beside them.
`--kernels` times every call of the replayed decode steps (`Tape.replay_timed`) and prints the replayed layers' wall
time per step by kernel (linears, attention, norms, ...) beside the decode-only step's wall time: at c=1 the step
less its linears is the time the issue-53 split asks for. `--split` times the parts of each decode-only step (the step's
batch and attention plan, the layer inputs, the replay, the LM head where it runs after the replay, the sampler, the
answers) and the gap between steps, wall and device-thread CPU; `--temperature` / `--top-p` sample instead of greedy;
`--head-after-step` runs the step as before the head joined the replay (an A/B in one build).

    python benchmarks/decode_load.py --quick            # c=32, one wave, fp32
    python benchmarks/decode_load.py --dtype bfloat16 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import deque
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class StepLog:
    """Per kvcache step: (decode rows, prefill tokens, wall s, thread CPU s, forward CPU s, head+sampling CPU s, started)."""

    def __init__(self, ops: bool = False, kernels: bool = False):
        from mstar_kvcache import KVCacheEngine
        from mstar_kvcache.answers import CallAnswers
        from mstar_kvcache.step_inputs import StepForward

        from mstar_core.nn import tape as tapes

        self.patched = [(KVCacheEngine, "step"), (KVCacheEngine, "_run"), (StepForward, "run"), (CallAnswers, "sample")]
        self.saved = [getattr(cls, name) for cls, name in self.patched]
        self.steps: list[dict[str, float]] = []
        #: with `kernels`: per kernel entry point, [ns, calls] over every replayed step; and the replays counted
        self.kernels: dict[str, list[int]] = {}
        self.replays = 0
        #: with `ops`, torch.profiler's op table over a few steps of each kind (decode-only and with a prefill chunk)
        self.ops: dict[str, list] = {"decode": [], "prefill": []} if ops else {}
        cur: dict[str, float] = {}
        step0, run0, fwd0, sample0 = self.saved
        log = self

        def step(engine):
            cur.clear()
            cur.update(decode=0, prefill=0, forward=0.0, sample=0.0)
            w, c = time.perf_counter(), time.thread_time()
            profiling = bool(log.ops) and len(log.steps) > 8 and any(len(v) < 4 for v in log.ops.values())
            if profiling:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            results = step0(engine)
            if profiling:
                prof.__exit__(None, None, None)
                kind = "prefill" if cur["prefill"] else "decode"
                if len(log.ops[kind]) < 4 and (kind == "prefill" or cur["decode"] >= 28):
                    log.ops[kind].append(prof.key_averages())
            if cur.get("replay"):  # (a replayed step: its layers' tape and its LM head's)
                log.replays += 1
            if cur["decode"] or cur["prefill"]:
                log.steps.append({**cur, "wall": time.perf_counter() - w, "cpu": time.thread_time() - c, "start": w})
            return results

        def run(engine, work):
            for _, n in work:
                cur["decode" if n == 1 else "prefill"] += n
            return run0(engine, work)

        def timed(key, original):
            def wrapper(*a, **k):
                c = time.thread_time()
                try:
                    return original(*a, **k)
                finally:
                    cur[key] = cur.get(key, 0.0) + time.thread_time() - c
            return wrapper

        def replay(tape):
            for name, ns in tape.replay_timed():
                entry = log.kernels.setdefault(name, [0, 0])
                entry[0] += ns
                entry[1] += 1
                cur["replay"] = cur.get("replay", 0.0) + ns / 1e9

        if kernels:
            self.patched.append((tapes.Tape, "replay"))
            self.saved.append(tapes.Tape.replay)
            tapes.Tape.replay = replay
        KVCacheEngine.step, KVCacheEngine._run = step, run
        StepForward.run, CallAnswers.sample = timed("forward", fwd0), timed("sample", sample0)

    def restore(self) -> None:
        for (cls, name), original in zip(self.patched, self.saved, strict=True):
            setattr(cls, name, original)


class StepSplit:
    """`--split`: each decode-only step's parts timed (wall and the device thread's CPU, nested), and the gap between
    steps split where the event loop sees the step's result (the hand-off to the loop thread) and at the engine's `add`
    (the answers through the conductor to the next call, then the hand-off of that call to the device thread). Per
    part: the median over the decode-only steps, in ms."""

    def __init__(self):
        from mstar_attn_torch.backend import TorchPagedAttention
        from mstar_kvcache import KVCacheEngine, answers, sampler, step_inputs
        from mstar_kvcache import replay as replays
        from mstar_kvcache.answers import CallAnswers
        from mstar_kvcache.scheduler import Scheduler
        from mstar_kvcache.step_inputs import StepForward

        from mstar_core.nn import tape as tapes
        from mstar_core.nn.llama import LlamaForCausalLM
        from mstar_core.runtime import scheduler as node_scheduler

        self.steps: list[dict[str, float]] = []
        # (step end -> the event loop sees its result, -> next add, that add -> next step start) wall s
        self.gaps: list[tuple[float, float, float]] = []
        cur: dict[str, float] = {}
        marks = {"end": None, "seen": None, "add": None}
        self.patched = []
        log = self

        def patch(owner, name, wrapper_of):
            original = getattr(owner, name)
            self.patched.append((owner, name, original))
            setattr(owner, name, wrapper_of(original))

        def timed(label):
            def wrap(original):
                def wrapper(*a, **k):
                    w, c = time.perf_counter(), time.thread_time()
                    try:
                        return original(*a, **k)
                    finally:
                        cur[label + ".wall"] = cur.get(label + ".wall", 0.0) + time.perf_counter() - w
                        cur[label + ".cpu"] = cur.get(label + ".cpu", 0.0) + time.thread_time() - c
                return wrapper
            return wrap

        def step_wrap(original):
            def step(engine):
                cur.clear()
                w, c = time.perf_counter(), time.thread_time()
                results = original(engine)
                end = time.perf_counter()
                if cur.get("rows") == "decode":
                    cur["step.wall"], cur["step.cpu"] = end - w, time.thread_time() - c
                    log.steps.append(dict(cur))
                    if (marks["end"] is not None and marks["seen"] is not None and marks["add"] is not None
                            and marks["end"] < marks["seen"] < marks["add"]):
                        log.gaps.append((marks["seen"] - marks["end"], marks["add"] - marks["seen"], w - marks["add"]))
                    marks["end"], marks["seen"], marks["add"] = end, None, None
                else:
                    marks["end"] = None
                return results
            return step

        def run_wrap(original):
            def run(engine, work):
                cur["rows"] = "decode" if all(n == 1 for _, n in work) else "prefill"
                return original(engine, work)
            return run

        def add_wrap(original):
            def add(engine, invocation):
                if marks["add"] is None:
                    marks["add"] = time.perf_counter()
                return original(engine, invocation)
            return add

        def executor_wrap(original):
            def run_in_executor(loop, executor, fn, *args):
                future = original(loop, executor, fn, *args)
                if getattr(fn, "__name__", "") == "step":  # (a node's step: when the loop thread sees it done)
                    def seen(_):
                        if marks["seen"] is None:
                            marks["seen"] = time.perf_counter()
                    future.add_done_callback(seen)
                return future
            return run_in_executor

        def device_wrap(original):  # (the scheduler's own hand-off to the device thread, where it has one)
            def run_on_device(loop, executor, fn):
                return executor_wrap(lambda _loop, ex, f, *args: original(loop, ex, f))(loop, executor, fn)
            return run_on_device

        patch(asyncio.BaseEventLoop, "run_in_executor", executor_wrap)
        if hasattr(node_scheduler, "run_on_device"):
            patch(node_scheduler, "run_on_device", device_wrap)
        patch(KVCacheEngine, "step", step_wrap)
        patch(KVCacheEngine, "_run", run_wrap)
        patch(KVCacheEngine, "add", add_wrap)
        patch(Scheduler, "schedule", timed("schedule"))
        patch(StepForward, "run", timed("forward"))
        patch(step_inputs, "build_batch", timed("forward.batch"))
        patch(step_inputs, "rope_positions", timed("forward.positions"))
        patch(TorchPagedAttention, "begin", timed("forward.attention_plan"))
        patch(LlamaForCausalLM, "layer_inputs", timed("forward.layer_inputs"))
        patch(tapes.Tape, "replay", timed("forward.replay"))
        patch(replays._Program, "run", timed("forward.program"))
        patch(CallAnswers, "finish", timed("finish"))
        patch(LlamaForCausalLM, "compute_logits", timed("finish.head"))
        patch(answers, "sample_rows", timed("finish.sampler"))
        patch(CallAnswers, "_answer", timed("finish.answer"))
        patch(sampler, "greedy_tokens", timed("finish.sampler.argmax"))

    def restore(self) -> None:
        for owner, name, original in reversed(self.patched):
            setattr(owner, name, original)

    def summary(self) -> dict[str, float]:
        keys = sorted({k for s in self.steps for k in s if k != "rows"})
        out = {k: round(1e3 * statistics.median(s.get(k, 0.0) for s in self.steps), 3) for k in keys}
        if self.gaps:
            # (the step's result handed to the event loop: the device thread's future done, the loop thread woken)
            out["gap_step_to_loop.wall"] = round(1e3 * statistics.median(g[0] for g in self.gaps), 3)
            out["gap_loop_to_add.wall"] = round(1e3 * statistics.median(g[1] for g in self.gaps), 3)
            out["gap_answer_to_add.wall"] = round(1e3 * statistics.median(g[0] + g[1] for g in self.gaps), 3)
            out["gap_add_to_step.wall"] = round(1e3 * statistics.median(g[2] for g in self.gaps), 3)
        out["steps"] = len(self.steps)
        return out


def model_dir() -> Path:
    import vllm_side

    path = vllm_side.cache_dir() / "smollm2-135m-hf"
    if not (path / "config.json").exists():
        raise SystemExit(f"{path} is missing: run benchmarks/vs_vllm.py or vs_llamacpp.py once to export it")
    return path


async def drive(engine, prompts: list[list[int]], concurrency: int, output_tokens: int,
                sampling: dict | None = None) -> dict[str, list[float]]:
    queue = deque(range(len(prompts)))
    ttft, itl = [], []

    async def client() -> None:
        while queue:
            i = queue.popleft()
            sent = last = time.perf_counter()
            handle = engine.submit("llama", {"input_ids": prompts[i], "max_tokens": output_tokens, "ignore_eos": True,
                                             **(sampling or {})})
            first = True
            async for out in handle:
                if out.name != "next_token":
                    continue
                now = time.perf_counter()
                (ttft.append(now - sent) if first else itl.append(now - last))
                first, last = False, now

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(prompts)))))
    return {"ttft": ttft, "itl": itl}


def summarize(steps: list[dict[str, float]], wall: float, concurrency: int) -> dict[str, dict[str, float]]:
    kinds = {"decode": lambda s: not s["prefill"], "mixed": lambda s: s["prefill"] and s["decode"],
             "prefill": lambda s: s["prefill"] and not s["decode"]}
    out = {}
    for kind, test in kinds.items():
        sel = [s for s in steps if test(s)]
        if not sel:
            continue
        row = {"steps": len(sel), "wall_s": round(sum(s["wall"] for s in sel), 2),
               "cpu_s": round(sum(s["cpu"] for s in sel), 2),
               "forward_cpu_s": round(sum(s["forward"] for s in sel), 2),
               "head_sample_cpu_s": round(sum(s["sample"] for s in sel), 2),
               "mean_rows": round(statistics.mean(s["decode"] for s in sel), 1),
               "mean_prefill_tokens": round(statistics.mean(s["prefill"] for s in sel), 1)}
        full = [s for s in sel if s["decode"] >= concurrency * 7 // 8]
        if kind == "decode" and full:
            row["full_batch_steps"] = len(full)
            row["full_batch_step_cpu_ms"] = round(1e3 * statistics.median(s["cpu"] for s in full), 2)
            row["full_batch_step_wall_ms"] = round(1e3 * statistics.median(s["wall"] for s in full), 2)
            row["full_batch_forward_cpu_ms"] = round(1e3 * statistics.median(s["forward"] for s in full), 2)
            row["full_batch_head_sample_cpu_ms"] = round(1e3 * statistics.median(s["sample"] for s in full), 2)
        out[kind] = row
    inside = sum(s["wall"] for s in steps)
    out["between_steps"] = {"wall_s": round(wall - inside, 2), "share": round((wall - inside) / wall, 3),
                            "per_step_ms": round(1e3 * (wall - inside) / max(len(steps), 1), 2)}
    return out


async def main_async(args) -> dict:
    from mstar_llm.model import load_llm
    from vs_vllm import load, make_prompts

    from mstar_core.model import LoadOptions
    from mstar_core.openmp import stop_huge_pages_after_load
    from mstar_core.runtime import AsyncEngine

    if args.head_after_step:  # the step as before issue 53's head replay: A/B in one build
        from mstar_kvcache import replay as replays
        from mstar_kvcache import sampler

        plain_init = replays.StepReplay.__init__

        def init(self, module, node, logits=False):
            plain_init(self, module, node, False)

        replays.StepReplay.__init__ = init
        sampler.greedy_tokens = lambda logits: None
        sampler.draws = lambda logits: False
    path = model_dir()
    loaded = load_llm(LoadOptions(checkpoint=str(path), dtype=args.dtype), progress=False)
    engine = AsyncEngine()
    await engine.add_model(loaded, settings={"lm": json.loads(args.settings)} if args.settings else None)
    stop_huge_pages_after_load()  # as `mstar serve` does once its models are in (MSTAR_HUGE_PAGES_AFTER_LOAD=1 keeps them)
    prompts = make_prompts(path, args.waves * args.concurrency, seed=args.concurrency)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("seed", 0))
                if v is not None} if args.temperature is not None else None
    log = StepLog(ops=args.ops, kernels=args.kernels)
    split = StepSplit() if args.split else None
    try:
        await drive(engine, make_prompts(path, 4, seed=99), 4, 8, sampling)  # warm-up (replays recorded, threads started)
        log.steps.clear()
        log.kernels.clear()
        log.replays = 0
        if split is not None:
            split.steps.clear()
            split.gaps.clear()
        print(f"load before: {load()}", flush=True)
        cpu0, t0, loop0 = time.process_time(), time.perf_counter(), time.thread_time()
        lat = await drive(engine, prompts, args.concurrency, args.output_tokens, sampling)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        loop_cpu = time.thread_time() - loop0  # (the event loop's thread: conductor, scheduler passes, the client)
        print(f"load after: {load()}", flush=True)
    finally:
        if split is not None:
            split.restore()
        log.restore()
        await engine.close()
    if split is not None:
        parts = split.summary()
        print(f"-- decode-only steps split ({parts['steps']} steps, median ms; wall / device-thread CPU; nested):")
        for key in sorted({k.rsplit(".", 1)[0] for k in parts if k.endswith((".wall", ".cpu"))}):
            print(f"   {key:28s} {parts.get(key + '.wall', float('nan')):7.3f} / {parts.get(key + '.cpu', float('nan')):7.3f}")
    for kind, tables in log.ops.items():
        totals: dict[str, float] = {}
        for table in tables:
            for ev in table:
                totals[ev.key] = totals.get(ev.key, 0.0) + ev.self_cpu_time_total / len(tables) / 1e3
        print(f"-- {kind} step ({len(tables)} profiled): top ops by self CPU ms per step (all threads' dispatch)")
        for key, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:18]:
            print(f"   {ms:8.2f}  {key}")
    kernels = {}
    if log.replays:
        decode = [st for st in log.steps if not st["prefill"] and st.get("replay")]
        step_ms = 1e3 * statistics.median(st["wall"] for st in decode) if decode else float("nan")
        outside = 1e3 * statistics.median(st["wall"] - st["replay"] for st in decode) if decode else float("nan")
        total = sum(ns for ns, _ in log.kernels.values()) / log.replays / 1e6
        print(f"-- replayed layers, {log.replays} steps: {total:.2f} ms a step (mean) by kernel; a decode-only step's "
              f"wall p50 {step_ms:.2f} ms, of it outside the replay (p50 per step) {outside:.2f} ms")
        for name, (ns, calls) in sorted(log.kernels.items(), key=lambda kv: -kv[1][0]):
            ms = ns / log.replays / 1e6
            kernels[name] = [round(ms, 3), calls // log.replays]
            print(f"   {ms:8.3f} ms  {calls // log.replays:4d} calls  {name}")
        kernels = {"replay_ms_per_step": round(total, 3), "decode_step_wall_p50_ms": round(step_ms, 3),
                   "outside_replay_p50_ms": round(outside, 3),
                   "by_kernel_ms_calls": kernels}
    tokens = len(lat["itl"]) + len(lat["ttft"])
    out = {"benchmark": "decode_load", "dtype": args.dtype, "head_after_step": args.head_after_step, "concurrency": args.concurrency,
           "requests": len(prompts), "threads": torch.get_num_threads(), "settings": args.settings,
           "wall_s": round(wall, 2), "process_cpu_s": round(cpu, 2), "tok_s": round(tokens / wall, 1),
           # the loop thread's CPU per output token: on 2 cores it is taken from the forward's threads even where it
           # overlaps a step, so it counts against the inter-token time about as the step's own Python does
           "loop_cpu_per_token_us": round(1e6 * loop_cpu / max(len(lat["itl"]) + len(lat["ttft"]), 1), 1),
           "ttft_p50_ms": round(1e3 * statistics.median(lat["ttft"]), 1),
           "ttft_max_ms": round(1e3 * max(lat["ttft"]), 1),
           # (none with --output-tokens 1: a run of prompt steps only)
           "itl_p50_ms": round(1e3 * statistics.median(lat["itl"]), 2) if lat["itl"] else None,
           "itl_p99_ms": round(1e3 * sorted(lat["itl"])[int(0.99 * (len(lat["itl"]) - 1))], 1) if lat["itl"] else None,
           **summarize(log.steps, wall, args.concurrency), **({"replayed": kernels} if kernels else {}),
           **({"split": parts} if split is not None else {}), **({"sampling": sampling} if sampling else {})}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one wave")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--settings", default=None, help="the lm node's kvcache settings as JSON (default: the preset's)")
    parser.add_argument("--ops", action="store_true", help="torch.profiler's op table over a few steps of each kind")
    parser.add_argument("--kernels", action="store_true", help="time each call of the replayed steps, by kernel")
    parser.add_argument("--split", action="store_true",
                        help="time the parts of each decode-only step (head, sampler, ...) and the gap between steps")
    parser.add_argument("--head-after-step", action="store_true",
                        help="A/B: the LM head after the replayed step and tokens picked by torch ops, as before")
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling")
    args = parser.parse_args()
    if args.quick:
        args.waves = 1
    out = asyncio.run(main_async(args))
    print(f"tok/s {out['tok_s']}  TTFT p50 {out['ttft_p50_ms']} ms (max {out['ttft_max_ms']})  inter-token p50 "
          f"{out['itl_p50_ms']} ms, p99 {out['itl_p99_ms']} ms  wall {out['wall_s']} s, process CPU {out['process_cpu_s']} s, "
          f"loop thread CPU {out['loop_cpu_per_token_us']} us a token")
    for key, value in out.items():
        if isinstance(value, dict):
            print(f"{key}: {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
