"""GPU runbook: what only a CUDA machine can show, in one run (under 8 minutes on one H100/H200), one JSON line.

  * `flashinfer`: FlashInfer against the torch paged backend on the same bf16 Llama (1B shape, random
    weights): max |logit difference| of the prefill step (target <= 1e-2 relative to the logit scale)
    and greedy tokens over 64 steps for 8 requests (target: identical; with random weights a bf16
    near-tie can flip a token, so the first divergence and the margin there are reported too);
  * `cuda_graphs`: the kvcache engine with `compile: true` (inductor + CUDA graphs of the pieces
    between attention calls) against eager, fp32: max |logit difference| over 32 decode steps and
    greedy tokens, plus decode tokens/s both ways;
  * `llama8b`: Llama-3-8B shape (random bf16 weights) decode tokens/s at 32 and 128 concurrent
    requests (prompt 128, 128 new tokens, lockstep; steady = full-batch decode steps);
  * `bf16`: the 1B-shape Llama in bf16 against the same weights in fp32 (TF32 off), both through the
    kvcache engine: relative first-step logit difference, greedy tokens over 64 steps for 8 requests
    (share of positions equal before each request's first divergence) and decode tokens/s both ways;
  * `quant`: the same bf16 model with `quantize: fp8` (e4m3 weights, `torch._scaled_mm` with per-row
    activation scales; `fp8_scaled_mm` says whether it ran or fell back to dequantizing) and `quantize: int8`
    (weight-only, dequantized per call on CUDA) against bf16: relative logit difference, greedy share equal,
    decode tokens/s and weight bytes;
  * `vs_vllm`: benchmarks/vs_vllm.py with both servers on the GPU (vLLM's CUDA build from its venv under the
    benchmark cache; skipped when that venv is missing, as this section installs nothing), c=8 and c=32, fp32 and bf16;
  * `tp2_fidelity` (2 or more GPUs; one GPU: a `skipped` line saying so): the 1B-shape bf16 Llama split over
    cuda:0 and cuda:1 (NCCL, each rank reading only its slices) against the same checkpoint on cuda:0: relative
    logit difference, greedy tokens over 32 steps, decode tokens/s, weight bytes and peak memory per rank vs
    TP=1, and an MoE layer at EP=2 vs EP=1 (benchmarks/gpu_tp_check.py);
  * `tp2`: benchmarks/tensor_parallel.py on the GPUs: the same random Llama at TP=2 (ranks on cuda:0 and
    cuda:1, NCCL) and TP=1 (cuda:0): identical greedy tokens, tokens/s at c=1 and c=32, weight + KV bytes per
    rank (ratio target <= 0.6); skipped, saying so, on a machine with fewer than 2 GPUs;
  * `orpheus3b`: Orpheus at the Llama-3.2-3B shape with the real 24 kHz SNAC shape (random weights,
    the tiny tokenizer, so a smaller vocabulary), through `AsyncEngine`: TTFA and audio-seconds per
    second at c=1 and c=16 (published reference on one H100: about 3.4 and 24.2 audio-s/s).

Each section is timed, fails alone (its error goes into the JSON) and is skipped when the budget
(`--budget`, seconds) is spent. Without CUDA it prints `{"cuda": false, ...}` and exits 0;
`--smoke` runs every section at toy shapes on the CPU instead (to check the script itself).

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from gpu_tp_check import check_tensor_parallel

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False)
ORPHEUS_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                  num_key_value_heads=8)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
           tie_word_embeddings=False)


def random_llama(cfg: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A Llama built straight on `device` in `dtype` with seeded random weights (no checkpoint on disk)."""
    from mstar_core.nn import LlamaForCausalLM

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM({"model_type": "llama", **cfg})
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            p.normal_(0, 0.02 if "embed" not in name else 1.0)
    return model.eval()


def make_engine(model, device: torch.device, **settings):
    from mstar_kvcache import KVCacheEngine

    from mstar_core.graph import GraphNode
    from mstar_core.runtime.engine import EngineContext

    node = GraphNode("lm", inputs=("input_ids",), outputs=("next_token", "finish_reason", "logits"), engine="kvcache",
                     optional_inputs=("sampling",))
    return KVCacheEngine(node, model, EngineContext("gpu_check", device, settings))


def drive(engine, prompts: list[list[int]], steps: int, sync=lambda: None) -> dict[str, Any]:
    """Greedy lockstep decode straight on the engine; tokens, first-step logits, and per-step times."""
    from mstar_core.runtime.engine import Invocation

    tokens = {i: [] for i in range(len(prompts))}
    first_logits: dict[int, torch.Tensor] = {}
    step_times: list[tuple[int, float]] = []
    for i, p in enumerate(prompts):
        engine.add(Invocation(f"r{i}", "lm", {"input_ids": p}, {}))
    while engine.has_work():
        started = time.perf_counter()
        results = engine.step()
        sync()
        step_times.append((len(results), time.perf_counter() - started))
        for inv, res in results:
            if isinstance(res, BaseException):
                raise res
            i = int(inv.request_id[1:])
            if i not in first_logits:
                first_logits[i] = torch.as_tensor(res["logits"]).float().reshape(-1).cpu()
            tokens[i].append(int(res["next_token"]))
            if len(tokens[i]) < steps:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"]}, {}))
            else:
                engine.release(inv.request_id)
    full = [dt for n, dt in step_times if n == len(prompts)][1:]  # decode steps with the whole batch
    decode_tok_s = len(prompts) * len(full) / sum(full) if full else None
    return {"tokens": tokens, "first_logits": first_logits, "decode_tok_s": decode_tok_s}


def prompts_for(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j) % (vocab - 1) + 1 for j in range(length)] for i in range(n)]


def compare(a: dict, b: dict) -> dict[str, Any]:
    diff = max(float((a["first_logits"][i] - b["first_logits"][i]).abs().max()) for i in a["first_logits"])
    scale = max(float(a["first_logits"][i].abs().max()) for i in a["first_logits"])
    divergence = None
    for i in sorted(a["tokens"]):
        for s, (x, y) in enumerate(zip(a["tokens"][i], b["tokens"][i], strict=True)):
            if x != y:
                divergence = {"request": i, "step": s} if divergence is None or s < divergence["step"] else divergence
                break
    return {"max_abs_logit_diff": diff, "logit_scale": scale, "relative_logit_diff": diff / max(scale, 1e-9),
            "greedy_identical": divergence is None, "first_divergence": divergence}


def check_flashinfer(device, smoke: bool) -> dict[str, Any]:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return {"skipped": "flashinfer is not installed (pip install flashinfer-python)"}
    cfg = TOY if smoke else LLAMA_1B
    model = random_llama(cfg, device, torch.bfloat16)
    prompts = prompts_for(8, 96, cfg["vocab_size"])
    runs = {}
    for backend in ("torch", "flashinfer"):
        engine = make_engine(model, device, num_pages=512, page_size=16, attention_backend=backend,
                             enable_prefix_caching=False)
        runs[backend] = drive(engine, prompts, 64, torch.cuda.synchronize)
    out = compare(runs["torch"], runs["flashinfer"])
    out |= {"decode_tok_s_torch": runs["torch"]["decode_tok_s"], "decode_tok_s_flashinfer": runs["flashinfer"]["decode_tok_s"],
            "ok": out["relative_logit_diff"] <= 1e-2 and out["greedy_identical"]}
    return out


def check_cuda_graphs(device, smoke: bool) -> dict[str, Any]:
    cfg = TOY if smoke else LLAMA_1B
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_llama(cfg, device, torch.float32)
    prompts = prompts_for(16, 48, cfg["vocab_size"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    eager = drive(make_engine(model, device, num_pages=256, page_size=16, attention_backend="torch",
                              enable_prefix_caching=False), prompts, 32, sync)
    engine = make_engine(model, device, num_pages=256, page_size=16, attention_backend="torch",
                         enable_prefix_caching=False, compile=True, compile_buckets=[16, 1024])
    started = time.perf_counter()
    drive(engine, prompts[:2], 2, sync)  # compiles (and captures) the buckets this run uses
    drive(engine, prompts, 2, sync)
    warm = time.perf_counter() - started
    graphed = drive(engine, prompts, 32, sync)
    out = compare(eager, graphed)
    forward = engine.forward_fn
    out |= {"cuda_graphs": bool(getattr(forward, "cuda_graphs", False)), "eager_reason": forward.eager_reason,
            "compile_s": forward.compile_seconds, "warm_up_s": warm, "decode_tok_s_eager": eager["decode_tok_s"],
            "decode_tok_s_graphs": graphed["decode_tok_s"],
            "ok": out["relative_logit_diff"] <= 1e-4 and out["greedy_identical"]}
    return out


def check_llama8b(device, smoke: bool) -> dict[str, Any]:
    cfg = TOY if smoke else LLAMA_8B
    model = random_llama(cfg, device, torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[str, Any] = {}
    for n in (32, 128):
        engine = make_engine(model, device, num_pages=n * 17 + 64, page_size=16, max_num_seqs=n,
                             max_num_batched_tokens=4096, enable_prefix_caching=False)
        started = time.perf_counter()
        run = drive(engine, prompts_for(n, 128, cfg["vocab_size"]), 16 if smoke else 128, sync)
        wall = time.perf_counter() - started
        made = sum(len(t) for t in run["tokens"].values())
        out[f"c{n}"] = {"tok_s": made / wall, "steady_decode_tok_s": run["decode_tok_s"], "wall_s": wall}
        del engine
    return out


async def _orpheus(device, smoke: bool) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from mstar_orpheus.model import load_orpheus
    from mstar_orpheus.preset import write_tiny
    from mstar_orpheus.snac import SNACConfig
    from orpheus_streaming import request_lengths, run_mstar

    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine

    snac = SNACConfig(decoder_dim=64) if smoke else SNACConfig()  # defaults: the real 24 kHz model's shape
    lm = {} if smoke else ORPHEUS_3B
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        directory = write_tiny(Path(tmp), seed=0, snac=snac, **lm)
        loaded = load_orpheus(LoadOptions(checkpoint=str(directory), device=str(device),
                                          dtype="float32" if device.type == "cpu" else "bfloat16"), progress=False)
        build_s = time.perf_counter() - started
    rate = loaded.extras["sample_rate"]
    engine = AsyncEngine()
    await engine.add_model(loaded, settings={"lm": {"num_pages": 4096}})
    out: dict[str, Any] = {"build_s": build_s}
    try:
        await run_mstar(engine, [35, 35], rate)  # warm-up
        for c in (1, 16):
            lengths = [210] if c == 1 else request_lengths(c, 63, 210)
            got = await run_mstar(engine, lengths if not smoke else [35] * c, rate)
            out[f"c{c}"] = {"ttfa_s": got["ttfa_s"], "audio_s_per_s": got["audio_s_per_s"], "rtf": got["rtf"]}
    finally:
        await engine.close()
    out["reference_h100_audio_s_per_s"] = {"c1": 3.4, "c16": 24.2}
    return out


def check_orpheus3b(device, smoke: bool) -> dict[str, Any]:
    return asyncio.run(_orpheus(device, smoke))


def check_vs_vllm(device, smoke: bool, seconds: float = 200.0) -> dict[str, Any]:
    """benchmarks/vs_vllm.py on the GPU: both servers on CUDA, one round at c=8 and c=32, fp32 and bf16.

    vLLM's CUDA build comes from its own venv under the benchmark cache (vllm_side.py), which this section
    never installs (a GPU machine here reaches no registry): without it the section says so and skips.
    """
    import subprocess

    import vllm_side

    if smoke or device.type != "cuda":
        return {"skipped": "needs CUDA (the CPU comparison is benchmarks/vs_vllm.py itself)"}
    python = vllm_side.venv_python(cuda=True)
    if not python.exists():
        return {"skipped": f"no vLLM CUDA venv at {python.parent.parent} (create it: python -m venv DIR && "
                           "DIR/bin/pip install vllm)"}
    cmd = [sys.executable, str(Path(__file__).with_name("vs_vllm.py")), "--device", "cuda", "--no-install",
           "--rounds", "1", "--concurrency", "8,32", "--start-timeout", "120"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"vs_vllm.py did not finish in {seconds:.0f} s", "tail": (exc.stdout or "")[-800:]}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": f"vs_vllm.py exited {out.returncode}", "tail": (out.stdout + out.stderr)[-1500:]}
    result = json.loads(lines[-1])
    keep = ("tok_s_ratio_c8_fp32", "tok_s_ratio_c32_fp32", "tok_s_ratio_c8_bf16", "tok_s_ratio_c32_bf16",
            "ttft_p50_ratio_max", "startup_ratio", "vllm_version", "greedy_texts_identical_float32")
    return {k: result.get(k) for k in keep}


def _agreement(a: dict, b: dict) -> float:
    """Share of greedy positions where two runs agree, counting each request up to its first divergence."""
    same = total = 0
    for i in a["tokens"]:
        total += len(a["tokens"][i])
        for x, y in zip(a["tokens"][i], b["tokens"][i], strict=True):
            if x != y:
                break
            same += 1
    return same / max(total, 1)


def check_bf16(device, smoke: bool) -> dict[str, Any]:
    cfg = TOY if smoke else LLAMA_1B
    torch.backends.cuda.matmul.allow_tf32 = False
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prompts = prompts_for(8, 64, cfg["vocab_size"])
    runs = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = random_llama(cfg, device, dtype)
        engine = make_engine(model, device, num_pages=256, page_size=16, attention_backend="torch",
                             enable_prefix_caching=False)
        runs[name] = drive(engine, prompts, 16 if smoke else 64, sync)
        runs[name]["kv_dtype"] = str(engine.pool.kv.dtype)
        del engine, model
    out = compare(runs["fp32"], runs["bf16"])
    out |= {"greedy_share_equal": _agreement(runs["fp32"], runs["bf16"]), "kv_dtype_bf16": runs["bf16"]["kv_dtype"],
            "decode_tok_s_fp32": runs["fp32"]["decode_tok_s"], "decode_tok_s_bf16": runs["bf16"]["decode_tok_s"],
            "ok": out["relative_logit_diff"] <= 3e-2 and runs["bf16"]["kv_dtype"] == "torch.bfloat16"}
    return out


def check_quant(device, smoke: bool) -> dict[str, Any]:
    from mstar_core.nn.quant import Fp8Linear

    cfg = TOY if smoke else LLAMA_1B
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prompts = prompts_for(8, 64, cfg["vocab_size"])
    modes = [None, "int8"] + (["fp8"] if device.type == "cuda" else [])  # (fp8 is refused off CUDA)
    runs, out = {}, {}
    for mode in modes:
        model = random_llama(cfg, device, torch.bfloat16)
        engine = make_engine(model, device, num_pages=256, page_size=16, attention_backend="torch",
                             enable_prefix_caching=False, **({"quantize": mode} if mode else {}))
        name = mode or "bf16"
        drive(engine, prompts[:2], 2, sync)  # warm-up (the first fp8 call finds out whether _scaled_mm runs)
        runs[name] = drive(engine, prompts, 16 if smoke else 64, sync)
        out[f"weight_bytes_{name}"] = sum(b.numel() * b.element_size() for b in (*model.parameters(), *model.buffers()))
        out[f"decode_tok_s_{name}"] = runs[name]["decode_tok_s"]
        if mode == "fp8":
            out["fp8_scaled_mm"] = all(m.scaled_mm for m in model.modules() if isinstance(m, Fp8Linear))
        del engine, model
    for mode in modes[1:]:
        got = compare(runs["bf16"], runs[mode])
        out[f"{mode}_relative_logit_diff"] = got["relative_logit_diff"]
        out[f"{mode}_greedy_share_equal"] = _agreement(runs["bf16"], runs[mode])
        out[f"{mode}_speedup"] = (runs[mode]["decode_tok_s"] or 0) / (runs["bf16"]["decode_tok_s"] or float("inf"))
    if device.type != "cuda":
        out["fp8"] = {"skipped": "fp8 needs CUDA (the kvcache engine refuses quantize: fp8 on a CPU node)"}
    return out


def check_tp2(device, smoke: bool) -> dict[str, Any]:
    """Tensor parallelism over NCCL: TP=2 against TP=1 (`benchmarks/tensor_parallel.py`, quick shape)."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"tensor_parallel 2 needs 2 or more GPUs; this machine has {torch.cuda.device_count()}"}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tensor_parallel

    args = argparse.Namespace(quick=True, tokens=32, tokens_c32=8, device="cuda:0" if device.type == "cuda" else "cpu")
    out = asyncio.run(tensor_parallel.main_async(args))
    keys = ("memory_per_rank_ratio", "tokens_per_s_ratio_c1", "tokens_per_s_ratio_c32", "same_greedy_tokens",
            "tp1_tokens_per_s_c1", "tp2_tokens_per_s_c1", "tp1_tokens_per_s_c32", "tp2_tokens_per_s_c32")
    return {k: out.get(k) for k in keys}


SECTIONS = [("flashinfer", check_flashinfer, 60), ("cuda_graphs", check_cuda_graphs, 120),
            ("llama8b", check_llama8b, 120), ("bf16", check_bf16, 60), ("quant", check_quant, 90),
            ("tp2_fidelity", check_tensor_parallel, 90), ("tp2", check_tp2, 90), ("orpheus3b", check_orpheus3b, 150),
            ("vs_vllm", check_vs_vllm, 200)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=450.0, help="seconds; a section that may not fit is skipped")
    parser.add_argument("--smoke", action="store_true", help="no CUDA needed: every section at toy shapes on the CPU")
    parser.add_argument("--only", default=None, help="comma-separated sections to run")
    args = parser.parse_args()
    report: dict[str, Any] = {"benchmark": "gpu_check", "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available() and not args.smoke:
        report["skipped"] = "no CUDA device: nothing to check here (run on a GPU machine, or --smoke for the script)"
        print(json.dumps(report))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        report["device"] = torch.cuda.get_device_name(device)
        report["torch"] = torch.__version__
    wanted = set(args.only.split(",")) if args.only else None
    start = time.perf_counter()
    for name, check, expected in SECTIONS:
        if wanted is not None and name not in wanted:
            continue
        left = args.budget - (time.perf_counter() - start)
        if left < expected and not args.smoke:
            report[name] = {"skipped": f"budget: {left:.0f} s left, this section takes about {expected} s"}
            continue
        t0 = time.perf_counter()
        try:
            report[name] = check(device, args.smoke)
        except Exception as exc:  # one section's failure is a finding, not the end of the run
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)[-1500:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{name}: {json.dumps(report[name], default=str)[:400]}", file=sys.stderr, flush=True)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
